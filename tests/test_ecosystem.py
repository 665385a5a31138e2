"""OnnxModule among torch's tools: state dicts, pickling, export, optimizers,
checkpointing, autocast, torch.compile and devices."""

from __future__ import annotations

import copy
import io
import pickle

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from conftest import compare_with_torch, export, make_mlp
from onnx import numpy_helper
from torch import nn

from ortbridge import OnnxModule
from ortbridge.exceptions import OrtBridgeError

# Every test here runs on each engine installed (see conftest).
pytestmark = pytest.mark.usefixtures("backend")


def batches(n=20, size=16, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(size, 6, generator=gen), torch.randn(size, 3, generator=gen)) for _ in range(n)
    ]


def sgd_losses(model, optimizer, data):
    losses = []
    for x, y in data:
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def assert_same_params(a, b, **tol):
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert sorted(pa) == sorted(pb)
    for name in pa:
        torch.testing.assert_close(pa[name], pb[name], msg=lambda m, n=name: f"{n}: {m}", **tol)


# -- 1. state dicts, deepcopy, pickle -----------------------------------------


def test_state_dict_round_trip_through_torch_save(mlp_proto):
    trained = OnnxModule(mlp_proto)
    sgd_losses(trained, torch.optim.SGD(trained.parameters(), lr=0.1), batches(5))
    state = trained.state_dict()
    assert list(state) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert all(type(v) is torch.Tensor for v in state.values())

    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)

    fresh = OnnxModule(mlp_proto)
    x = torch.randn(5, 6)
    assert not torch.equal(fresh(x), trained(x))
    fresh.load_state_dict(loaded)
    assert_same_params(fresh, trained, rtol=0, atol=0)
    torch.testing.assert_close(fresh(x), trained(x), rtol=0, atol=0)
    # The torch model the graph came from loads the same state dict.
    ref = make_mlp(seed=3)
    ref.load_state_dict(loaded)
    torch.testing.assert_close(ref(x), trained(x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "clone",
    [copy.deepcopy, lambda m: pickle.loads(pickle.dumps(m))],
    ids=["deepcopy", "pickle"],
)
def test_copies_keep_training_like_the_original(mlp_proto, clone):
    original = OnnxModule(mlp_proto)
    opt = torch.optim.SGD(original.parameters(), lr=0.1, momentum=0.9)
    sgd_losses(original, opt, batches(3, seed=5))

    copied = clone(original)
    assert copied is not original
    assert_same_params(copied, original, rtol=0, atol=0)
    for p, q in zip(copied.parameters(), original.parameters()):
        assert p.data_ptr() != q.data_ptr()
    copied_opt = torch.optim.SGD(copied.parameters(), lr=0.1, momentum=0.9)
    # Deep copy: load_state_dict would share the momentum buffers.
    copied_opt.load_state_dict(copy.deepcopy(opt.state_dict()))

    data = batches(10, seed=6)
    ours = sgd_losses(copied, copied_opt, data)
    ref = sgd_losses(original, opt, data)
    assert ours == ref
    assert_same_params(copied, original, rtol=0, atol=0)


# -- 2. to_onnx / save --------------------------------------------------------


def test_exported_model_matches_module_and_keeps_everything_else(mlp_proto, tmp_path):
    proto = onnx.ModelProto()
    proto.CopyFrom(mlp_proto)
    onnx.helper.set_model_props(proto, {"author": "ortbridge-tests"})
    module = OnnxModule(proto, trainable=["2.weight", "2.bias"])
    sgd_losses(module, torch.optim.SGD(module.parameters(), lr=0.1), batches(5))

    path = tmp_path / "trained.onnx"
    module.save(path)
    saved = onnx.load(str(path))
    x = torch.randn(7, 6)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (got,) = session.run(None, {"input": x.numpy()})
    with torch.no_grad():
        want = module(x)
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-6, atol=1e-7)

    assert [n.name for n in saved.graph.node] == [n.name for n in proto.graph.node]
    assert [(o.domain, o.version) for o in saved.opset_import] == [
        (o.domain, o.version) for o in proto.opset_import
    ]
    assert {p.key: p.value for p in saved.metadata_props} == {"author": "ortbridge-tests"}
    assert (saved.ir_version, saved.producer_name) == (proto.ir_version, proto.producer_name)
    assert saved.graph.input == proto.graph.input
    assert saved.graph.output == proto.graph.output
    before = {i.name: numpy_helper.to_array(i) for i in proto.graph.initializer}
    after = {i.name: numpy_helper.to_array(i) for i in saved.graph.initializer}
    assert sorted(before) == sorted(after)
    for name in ("0.weight", "0.bias"):
        np.testing.assert_array_equal(after[name], before[name])
    for name in ("2.weight", "2.bias"):
        assert not np.array_equal(after[name], before[name]), name
        np.testing.assert_array_equal(after[name], module.onnx_weight(name).detach().numpy())
    # to_onnx gives the same model as save.
    assert module.to_onnx().SerializeToString() == saved.SerializeToString()

    # Loaded back, it trains on like the module it was saved from.
    reloaded = OnnxModule(str(path), trainable=["2.weight", "2.bias"])
    data = batches(5, seed=9)
    ours = sgd_losses(reloaded, torch.optim.SGD(reloaded.parameters(), lr=0.1), data)
    ref = sgd_losses(module, torch.optim.SGD(module.parameters(), lr=0.1), data)
    np.testing.assert_allclose(ours, ref, rtol=1e-6)


# -- 3. torch optimizers, schedulers, clipping, accumulation -------------------

OPTIMIZERS = {
    "SGD": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=1e-3),
    "Adam": lambda p: torch.optim.Adam(p, lr=0.01),
    "AdamW": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
}


def train_with(model, make_opt, data, clip=None, scheduler=False):
    opt = make_opt(model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5) if scheduler else None
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        if clip is not None:
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        if sched is not None:
            sched.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_torch_optimizers_with_scheduler_and_clipping(mlp_proto, name):
    data = batches(20)
    ref = make_mlp()
    ours = OnnxModule(mlp_proto)
    ref_losses = train_with(ref, OPTIMIZERS[name], data, clip=0.5, scheduler=True)
    losses = train_with(ours, OPTIMIZERS[name], data, clip=0.5, scheduler=True)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-4)
    assert losses[-1] < losses[0]
    assert_same_params(ours, ref, rtol=1e-4, atol=1e-5)


def test_lbfgs_closure_calls_forward_several_times(mlp_proto):
    x, y = batches(1, size=32)[0]

    def run(model):
        opt = torch.optim.LBFGS(model.parameters(), lr=0.2, max_iter=3, history_size=5)
        calls, losses = [0], []

        def closure():
            calls[0] += 1
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            return loss

        for _ in range(20):
            losses.append(opt.step(closure).item())
        return losses, calls[0]

    ref_losses, ref_calls = run(make_mlp())
    losses, calls = run(OnnxModule(mlp_proto))
    assert calls > 20
    assert calls == ref_calls
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-4)
    assert losses[-1] < losses[0]


def test_gradient_accumulation_equals_one_big_batch(mlp_proto):
    x, y = batches(1, size=32)[0]
    big = OnnxModule(mlp_proto)
    nn.functional.mse_loss(big(x), y).backward()

    accumulated = OnnxModule(mlp_proto)
    for xs, ys in zip(x.chunk(4), y.chunk(4)):
        (nn.functional.mse_loss(accumulated(xs), ys) / 4).backward()
    for (name, p), q in zip(accumulated.named_parameters(), big.parameters()):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


# -- 4. requires_grad_(False) ---------------------------------------------------


def test_requires_grad_false_parameters_get_no_grad(mlp_proto):
    ours, ref = OnnxModule(mlp_proto), make_mlp()
    for model in (ours, ref):
        model.get_submodule("0").weight.requires_grad_(False)
        model.get_submodule("2").bias.requires_grad_(False)
    data = batches(5)
    losses = train_with(ours, lambda p: torch.optim.SGD(p, lr=0.1), data)
    ref_losses = train_with(ref, lambda p: torch.optim.SGD(p, lr=0.1), data)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    params = dict(ours.named_parameters())
    assert params["0.weight"].grad is None
    assert params["2.bias"].grad is None
    torch.testing.assert_close(params["0.weight"], ref.get_submodule("0").weight, rtol=0, atol=0)
    for name, p in ref.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(params[name].grad, p.grad, rtol=1e-4, atol=1e-6)
            torch.testing.assert_close(params[name], p, rtol=1e-5, atol=1e-6)


# -- 5. torch -> ONNX -> torch ------------------------------------------------


def sandwich(middle):
    torch.manual_seed(7)
    return nn.Sequential(nn.Linear(5, 6), nn.ReLU(), middle, nn.ReLU(), nn.Linear(3, 2))


def test_torch_onnx_torch_trains_end_to_end(mlp_proto):
    ref = sandwich(make_mlp())
    ours = sandwich(OnnxModule(mlp_proto))
    gen = torch.Generator().manual_seed(3)
    data = [
        (torch.randn(16, 5, generator=gen), torch.randn(16, 2, generator=gen)) for _ in range(10)
    ]
    losses, ref_losses = [], []
    for model, out in ((ours, losses), (ref, ref_losses)):
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        for step, (x, y) in enumerate(data):
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            if step == 0:
                first = model[0].weight.grad.clone()
                assert first.abs().sum() > 0
                out.append(first)
            opt.step()
            out.append(loss.item())
    torch.testing.assert_close(losses[0], ref_losses[0], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(losses[1:], ref_losses[1:], rtol=1e-4)
    assert_same_params(ours, ref, rtol=1e-4, atol=1e-5)


# -- 6. activation checkpointing ----------------------------------------------


def test_checkpoint_gives_the_same_gradients(mlp_proto):
    from torch.utils.checkpoint import checkpoint

    layer = OnnxModule(mlp_proto)
    x = torch.randn(8, 6)
    results = []
    for use_checkpoint in (False, True):
        layer.zero_grad()
        xi = x.clone().requires_grad_(True)
        out = checkpoint(layer, xi, use_reentrant=False) if use_checkpoint else layer(xi)
        (out**2).sum().backward()
        results.append([xi.grad] + [p.grad.clone() for p in layer.parameters()])
    for plain, checkpointed in zip(*results):
        torch.testing.assert_close(checkpointed, plain, rtol=0, atol=0)


# -- 7. autocast --------------------------------------------------------------


def test_autocast_bf16_input_is_cast_to_float32(mlp_proto):
    torch.manual_seed(11)
    first = nn.Linear(4, 6)
    ours = nn.Sequential(copy.deepcopy(first), OnnxModule(mlp_proto))
    ref = nn.Sequential(copy.deepcopy(first), make_mlp())
    x = torch.randn(8, 4)
    seen = []
    ours[1].register_forward_pre_hook(lambda m, args: seen.append(args[0].dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ours(x)
        hidden = ref[0](x)
        assert hidden.dtype == torch.bfloat16
        # Reference: the float32 part computed in float32, as OnnxModule does.
        with torch.autocast("cpu", enabled=False):
            ref_out = ref[1](hidden.float())
    assert seen == [torch.bfloat16]
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6)
    (out**2).sum().backward()
    (ref_out**2).sum().backward()
    for name, p in ref[1].named_parameters():
        q = dict(ours[1].named_parameters())[name]
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6)
    # The bfloat16 layer's backward is the same computation on both sides: the
    # float32 gradients entering it agree far below bfloat16's resolution, so its
    # gradients agree exactly (measured on 30 seeds, both engines).
    for name in ("weight", "bias"):
        got, want = getattr(ours[0], name).grad, getattr(ref[0], name).grad
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=0, atol=0)


# -- 8. torch.compile ---------------------------------------------------------


def test_torch_compile_matches_eager(mlp_proto):
    """torch.compile (inductor) compiles the model with the ONNX layer as one
    operator; outputs, gradients and three SGD steps match eager."""
    torch._dynamo.reset()
    eager = sandwich(OnnxModule(mlp_proto))
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model)
    x = torch.randn(8, 5)
    out_eager = eager(x)
    out_compiled = compiled(x)
    torch.testing.assert_close(out_compiled, out_eager, rtol=1e-6, atol=1e-7)
    out_eager.sum().backward()
    out_compiled.sum().backward()
    for (name, p), q in zip(eager.named_parameters(), compiled_model.parameters()):
        assert q.grad is not None, name
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-6, atol=1e-7)

    gen = torch.Generator().manual_seed(2)
    data = [(torch.randn(8, 5, generator=gen), torch.randn(8, 2, generator=gen)) for _ in range(3)]
    ref = sgd_losses(eager, torch.optim.SGD(eager.parameters(), lr=0.1), data)
    ours = sgd_losses(compiled, torch.optim.SGD(compiled.parameters(), lr=0.1), data)
    np.testing.assert_allclose(ours, ref, rtol=1e-5)
    assert_same_params(compiled_model, eager, rtol=1e-5, atol=1e-6)


# -- 9. devices and dtypes ----------------------------------------------------


def test_move_from_meta_to_cpu_runs_on_the_moved_weights(mlp_proto):
    """A real device move on a machine without a GPU: meta -> cpu. The graph then
    computes with the moved weights (loaded after the move), gradients included."""
    layer = OnnxModule(mlp_proto)
    x = torch.randn(3, 6)
    layer(x).sum().backward()  # sessions built on the cpu before the move
    assert layer.to("meta") is layer
    assert all(p.is_meta for p in layer.parameters())
    assert layer.to_empty(device="cpu") is layer
    assert all(p.device.type == "cpu" for p in layer.parameters())
    ref = make_mlp(seed=3)
    layer.load_state_dict(ref.state_dict())
    layer.zero_grad(set_to_none=True)
    compare_with_torch(ref, layer, [x.requires_grad_()], rtol=1e-5, atol=1e-6)
    assert layer.to("cpu") is layer and layer.cpu() is layer


def test_input_on_another_device_names_the_input(mlp_proto):
    layer = OnnxModule(mlp_proto)
    with pytest.raises(OrtBridgeError, match=r"input 'input' is on meta but the module is on cpu"):
        layer(torch.empty(3, 6, device="meta"))


def test_half_is_refused_clearly(mlp_proto):
    layer = OnnxModule(mlp_proto).half()
    with pytest.raises(OrtBridgeError, match=r"weight '0.weight' is torch.float16 .*float32"):
        layer(torch.randn(3, 6).half())


def test_batch_norm_state_dicts_load_both_ways():
    """A torch BatchNorm model's state dict (with ``num_batches_tracked``, which
    the graph does not use) loads strictly; running statistics follow torch."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
    module = OnnxModule(export(ref, (torch.randn(4, 6),)))
    ref.train()
    for x, _ in batches(3, size=16):
        ref(x)
        module(x)
    ours, theirs = module.state_dict(), ref.state_dict()
    assert "1.num_batches_tracked" not in ours
    assert sorted(ours) == sorted(k for k in theirs if not k.endswith("num_batches_tracked"))
    for name, value in ours.items():
        torch.testing.assert_close(value, theirs[name], rtol=1e-5, atol=1e-6)

    fresh = OnnxModule(module.to_onnx())
    with torch.no_grad():
        ref[1].running_mean.add_(1.0)
    assert fresh.load_state_dict(theirs).unexpected_keys == []
    torch.testing.assert_close(fresh.onnx_weight("1.running_mean"), ref[1].running_mean)
    # The other way too: torch's BatchNorm fills in the counter (as for old state dicts).
    make_bn = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
    make_bn.load_state_dict(fresh.state_dict())
    torch.testing.assert_close(make_bn[1].running_mean, ref[1].running_mean)


def test_load_state_dict_assign_and_functional_call(mlp_proto):
    """Parameters swapped in by ``assign=True`` or ``torch.func.functional_call``
    are the ones the graph computes with, and get the gradients."""
    ref = make_mlp(seed=4)
    state = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    x = torch.randn(5, 6)
    want = ref(x)
    want.sum().backward()

    assigned = OnnxModule(mlp_proto)
    assigned.load_state_dict(state, assign=True)
    assert all(p.data_ptr() == state[n].data_ptr() for n, p in assigned.named_parameters())
    out = assigned(x)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    out.sum().backward()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(dict(assigned.named_parameters())[name].grad, p.grad)

    module = OnnxModule(mlp_proto)
    params = {k: v.clone().requires_grad_(True) for k, v in state.items()}
    out = torch.func.functional_call(module, params, (x,))
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    out.sum().backward()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(params[name].grad, p.grad)
    assert all(p.grad is None for p in module.parameters())


def test_module_on_meta_device_is_refused_clearly(mlp_proto):
    layer = OnnxModule(mlp_proto).to("meta")
    assert all(p.is_meta for p in layer.parameters())
    with pytest.raises(OrtBridgeError, match=r"cannot run on torch device meta: use cpu or cuda"):
        layer(torch.empty(3, 6, device="meta"))


@pytest.mark.parametrize(
    "clone",
    [copy.deepcopy, lambda m: pickle.loads(pickle.dumps(m))],
    ids=["deepcopy", "pickle"],
)
def test_copies_of_a_module_with_session_options(mlp_proto, clone):
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    module = OnnxModule(mlp_proto, session_options=options)
    copied = clone(module)
    assert module._session_options is options
    kept = copied._session_options
    assert isinstance(kept, ort.SessionOptions) and kept is not options
    assert kept.intra_op_num_threads == 1
    assert kept.graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    x = torch.randn(4, 6)
    torch.testing.assert_close(copied(x), module(x), rtol=0, atol=0)


def test_weight_norm_parametrization_and_backward_hook(mlp_proto):
    """torch's parametrizations wrap an ONNX weight like a torch one; to_onnx
    writes the computed weight; full backward hooks see the ONNX layer's grads."""
    from torch.nn.utils.parametrizations import weight_norm

    ours, ref = OnnxModule(mlp_proto), make_mlp()
    weight_norm(ours.get_submodule("0"), "weight")
    weight_norm(ref[0], "weight")
    seen = []
    ours.register_full_backward_hook(lambda mod, gin, gout: seen.append((gin[0], gout[0])))
    x = torch.randn(5, 6, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    out, want = ours(x), ref(x_ref)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    (out**2).sum().backward()
    (want**2).sum().backward()
    params = dict(ours.named_parameters())
    assert "0.parametrizations.weight.original0" in params
    for name, p in ref.named_parameters():
        torch.testing.assert_close(params[name].grad, p.grad, rtol=1e-5, atol=1e-6)
    assert len(seen) == 1
    torch.testing.assert_close(seen[0][1], 2 * out.detach())
    torch.testing.assert_close(seen[0][0], x.grad)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-6)

    session = ort.InferenceSession(
        ours.to_onnx().SerializeToString(), providers=["CPUExecutionProvider"]
    )
    (exported,) = session.run(None, {"input": x.detach().numpy()})
    np.testing.assert_allclose(exported, out.detach().numpy(), rtol=1e-6, atol=1e-7)
