"""A torch model holding ONNX layers compiles, exports and ships as one ONNX file.

Traced (``torch.compile``, ``torch.export``, ``torch.jit``), each layer is the
operator ``ortbridge::onnx_layer``: ``fullgraph=True`` compiles, a dynamic
batch compiles once, and both ONNX exporters write the layers' graphs inline,
with their current weights, into one file that plain onnxruntime runs.
"""

from __future__ import annotations

import copy
import io
import warnings

import numpy as np
import onnx
import pytest
import torch
from conftest import export
from torch import nn

from ortbridge import OnnxModule
from ortbridge.exceptions import OrtBridgeError

pytestmark = pytest.mark.usefixtures("backend")


def _close(ours, theirs, rel=1e-5, scale=None):
    # Relative to the magnitude compared: kernels round differently per processor.
    scale = max(float(theirs.abs().max()), 1e-3) if scale is None else scale
    torch.testing.assert_close(ours, theirs, rtol=rel, atol=rel * scale)


def _two_layers():
    """Linear -> ONNX MLP -> Tanh -> ONNX head, and the same model in torch."""
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    head = nn.Linear(4, 3)
    first = nn.Linear(5, 8)
    ours = nn.Sequential(
        copy.deepcopy(first),
        OnnxModule(export(mlp, (torch.randn(2, 8),))),
        nn.Tanh(),
        OnnxModule(export(head, (torch.randn(2, 4),))),
    )
    return ours, nn.Sequential(first, mlp, nn.Tanh(), head)


def _step(model, x):
    model.zero_grad()
    out = model(x)
    (out**2).sum().backward()
    return out.detach(), [p.grad.clone() for p in model.parameters()]


def _compare(model, reference, x):
    out, grads = _step(model, x)
    ref_out, ref_grads = _step(reference, x)
    _close(out, ref_out)
    assert len(grads) == len(ref_grads)
    # One scale for all: a bias before a BatchNorm has a gradient of zero up to rounding.
    scale = max(float(r.abs().max()) for r in ref_grads)
    for g, r in zip(grads, ref_grads):
        _close(g, r, scale=scale)


def test_compile_fullgraph_matches_eager_with_a_dynamic_batch():
    torch._dynamo.reset()
    ours, reference = _two_layers()
    compiled = torch.compile(ours, fullgraph=True, dynamic=True, backend="aot_eager")
    counters = torch._dynamo.utils.counters
    counters.clear()
    for batch in (6, 9, 17, 3):
        _compare(compiled, reference, torch.randn(batch, 5))
    assert counters["stats"]["unique_graphs"] == 1  # one compilation for every batch


def test_compile_with_inductor_trains_as_eager():
    torch._dynamo.reset()
    ours, reference = _two_layers()
    compiled = torch.compile(ours, fullgraph=True)
    gen = torch.Generator().manual_seed(1)
    opt = torch.optim.SGD(ours.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05)
    for _ in range(3):
        x = torch.randn(8, 5, generator=gen)
        for model, optimizer in ((compiled, opt), (reference, ref_opt)):
            optimizer.zero_grad()
            (model(x) ** 2).mean().backward()
            optimizer.step()
    for p, q in zip(ours.parameters(), reference.parameters()):
        _close(p.detach(), q.detach())


def test_compiled_train_mode_batch_norm_updates_statistics_once():
    torch._dynamo.reset()
    torch.manual_seed(3)
    net = nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5), nn.Tanh(), nn.Linear(5, 2))
    with torch.no_grad():
        net[1].running_var.uniform_(0.5, 2)
    layer = OnnxModule(export(net.eval(), (torch.randn(4, 6),))).train()
    reference = copy.deepcopy(net).train()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    for _ in range(2):
        _compare(compiled, reference, torch.randn(7, 6))
    for name in ("1.running_mean", "1.running_var"):
        _close(layer.get_buffer(name), reference.get_buffer(name))


def test_compiled_step_runs_the_engine_forward_once(monkeypatch):
    """The backward reads what the forward saved (a handle), as eager does:
    one forward per step, and nothing kept after the backward."""
    from ortbridge import _function, _torch_op

    torch._dynamo.reset()
    ours, reference = _two_layers()
    compiled = torch.compile(ours, fullgraph=True, backend="aot_eager")
    forward = _function._forward
    runs = []
    monkeypatch.setattr(_function, "_forward", lambda *a: runs.append(1) or forward(*a))
    _compare(compiled, reference, torch.randn(5, 5))
    assert len(runs) == 2  # two layers, one forward each
    assert not _torch_op._STATES


def test_compiled_state_is_freed_without_a_backward():
    from ortbridge import _torch_op

    torch._dynamo.reset()
    ours, _ = _two_layers()
    compiled = torch.compile(ours, fullgraph=True, backend="aot_eager")
    out = compiled(torch.randn(4, 5))
    assert len(_torch_op._STATES) == 2
    del out  # the graph goes, and what the forwards kept with it
    assert not _torch_op._STATES


def test_compiled_second_backward_runs_the_forward_again():
    torch._dynamo.reset()
    ours, reference = _two_layers()
    with torch._functorch.config.patch(donated_buffer=False):  # torch's retain_graph rule
        compiled = torch.compile(ours, fullgraph=True, backend="aot_eager")
        x = torch.randn(6, 5)
        out = compiled(x)
        first = torch.autograd.grad(out.sum(), list(ours.parameters()), retain_graph=True)
        second = torch.autograd.grad(out.sum(), list(ours.parameters()))
    want = torch.autograd.grad(reference(x).sum(), list(reference.parameters()))
    for a, b, w in zip(first, second, want):
        _close(a, w)
        _close(b, w)


def test_compiled_checkpoint_matches_eager():
    from torch.utils.checkpoint import checkpoint

    torch._dynamo.reset()
    ours, reference = _two_layers()
    compiled = torch.compile(
        lambda x: checkpoint(ours, x, use_reentrant=False), fullgraph=True, backend="aot_eager"
    )
    x = torch.randn(4, 5)
    compiled(x).sum().backward()
    reference(x).sum().backward()
    for p, q in zip(ours.parameters(), reference.parameters()):
        _close(p.grad, q.grad)


def test_compiled_under_autocast_matches_eager_under_autocast():
    """In an autocast region the layer takes its inputs in the graph's dtype,
    compiled as eagerly; the torch parts around it autocast as torch's do."""
    torch._dynamo.reset()
    ours, _ = _two_layers()
    compiled = torch.compile(ours, fullgraph=True, backend="aot_eager")
    x = torch.randn(6, 5)
    results = []
    for model in (compiled, ours):
        ours.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        out.float().square().sum().backward()
        results.append((out.detach(), [p.grad.clone() for p in ours.parameters()]))
    (out, grads), (want, want_grads) = results
    assert out.dtype == want.dtype
    _close(out.float(), want.float())
    for g, w in zip(grads, want_grads):
        _close(g, w)


def test_torch_checkpoint_is_torch_s_own_after_onnxruntime_is_imported():
    """onnxruntime-training's import swaps in ORTModule's wrapper, which
    torch.compile cannot trace with use_reentrant=; ortbridge gives it back."""
    import torch.utils.checkpoint as checkpointing

    from ortbridge._runtime import _ort

    _ort.runtime()
    assert checkpointing.checkpoint.__module__ == "torch.utils.checkpoint"


def test_compiled_train_mode_dropout_backward_uses_the_forward_masks():
    torch._dynamo.reset()
    layer = OnnxModule(export(nn.Sequential(nn.Dropout(0.5)).train(), (torch.randn(4, 6),)))
    compiled = torch.compile(layer.train(), fullgraph=True, backend="aot_eager")
    x = (torch.rand(64, 6) + 0.5).requires_grad_()  # no zeros: a zero output is a dropped one
    out = compiled(x)
    out.sum().backward()
    kept = out.detach() != 0
    assert 0 < int(kept.sum()) < kept.numel()
    # d out / d x is the mask over (1 - p), the same mask the forward drew.
    torch.testing.assert_close(x.grad, kept.float() * 2)


def test_exported_train_mode_dropout_backward_is_refused_by_name():
    net = nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.3), nn.Linear(8, 2))
    layer = OnnxModule(export(net.train(), (torch.randn(4, 6),))).train()
    module = torch.export.export(layer, (torch.randn(3, 6),)).module()
    out = module(torch.randn(3, 6))
    with pytest.raises(OrtBridgeError, match="draws Dropout masks in train mode.*eval mode"):
        out.sum().backward()


def test_torch_export_with_a_dynamic_batch_matches_eager():
    ours, reference = _two_layers()
    program = torch.export.export(
        ours, (torch.randn(6, 5),), dynamic_shapes=({0: torch.export.Dim("batch")},)
    )
    calls = [n for n in program.graph.nodes if "onnx_layer" in str(n.target)]
    assert len(calls) == 2
    module = program.module()
    for batch in (6, 11):
        x = torch.randn(batch, 5)
        _close(module(x).detach(), reference(x).detach())


def _trained_and_exported(dynamo: bool):
    ours, reference = _two_layers()
    # One SGD step first: the file must hold the trained weights.
    opt = torch.optim.SGD(ours.parameters(), lr=0.1)
    _step(ours, torch.randn(8, 5))
    opt.step()
    ours.eval()
    x = torch.randn(6, 5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if dynamo:
            program = torch.onnx.export(
                ours, (x,), dynamo=True, dynamic_shapes=({0: torch.export.Dim("batch")},)
            )
            proto = program.model_proto
        else:
            buffer = io.BytesIO()
            torch.onnx.export(
                ours, (x,), buffer, dynamo=False, input_names=["x"], dynamic_axes={"x": {0: "n"}}
            )
            proto = onnx.load_from_string(buffer.getvalue())
    return ours, proto


@pytest.mark.parametrize("dynamo", [True, False], ids=["dynamo", "torchscript"])
def test_onnx_export_writes_one_file_plain_onnxruntime_runs(dynamo):
    import onnxruntime as ort

    ours, proto = _trained_and_exported(dynamo)
    assert all(n.domain in ("", "ai.onnx") for n in proto.graph.node)
    assert [n.op_type for n in proto.graph.node].count("Gemm") == 4  # 1 torch, 3 inlined
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    for batch in (6, 13):  # the batch stays dynamic
        x = torch.randn(batch, 5)
        (got,) = session.run(None, {name: x.numpy()})
        with torch.no_grad():
            want = ours(x)
        _close(torch.from_numpy(np.asarray(got)), want)


def test_traced_output_shapes_keep_symbolic_dims():
    ours, _ = _two_layers()
    program = torch.export.export(
        ours, (torch.randn(6, 5),), dynamic_shapes=({0: torch.export.Dim("batch")},)
    )
    out = next(n for n in program.graph.nodes if n.op == "output").args[0][0]
    placeholder = [n for n in program.graph.nodes if n.op == "placeholder"][-1]
    # The batch of the output is the input's symbol, not a new unbacked size.
    assert str(out.meta["val"].shape[0]) == str(placeholder.meta["val"].shape[0])
