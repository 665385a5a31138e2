"""OrtSGD: one onnxruntime call a step, in place, following torch.optim.SGD."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from ortbridge import OnnxModule
from ortbridge._prepare._onnx_utils import make_model
from ortbridge.exceptions import OnnxInputError, OnnxTypeError
from ortbridge.training import OrtSGD, _fused_sgd
from ortbridge.training._graphs import _sgd_rule

HYPER = {
    "plain": {},
    "momentum": {"momentum": 0.9},
    "nesterov": {"momentum": 0.9, "nesterov": True},
    "decay": {"weight_decay": 0.05},
    "momentum-decay": {"momentum": 0.8, "weight_decay": 0.05},
    "nesterov-decay": {"momentum": 0.8, "nesterov": True, "weight_decay": 0.05},
}


def mlp_model(sizes=(6, 8, 3), seed=0, dtype=np.float32):
    """MatMul/Add/Relu layers as plain ONNX."""
    rng = np.random.default_rng(seed)
    elem = TensorProto.FLOAT if dtype == np.float32 else TensorProto.DOUBLE
    nodes, inits, last = [], [], "x"
    for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        inits += [
            numpy_helper.from_array(rng.normal(size=(n_in, n_out)).astype(dtype), f"W{i}"),
            numpy_helper.from_array(rng.normal(size=(n_out,)).astype(dtype), f"b{i}"),
        ]
        nodes += [
            helper.make_node("MatMul", [last, f"W{i}"], [f"m{i}"]),
            helper.make_node("Add", [f"m{i}", f"b{i}"], [f"a{i}"]),
        ]
        last = f"a{i}"
        if i < len(sizes) - 2:
            nodes.append(helper.make_node("Relu", [last], [f"r{i}"]))
            last = f"r{i}"
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", elem, ["n", sizes[0]])],
        [helper.make_tensor_value_info(last, elem, ["n", sizes[-1]])],
        inits,
    )
    return make_model(graph)


def train(module, optimizer, steps=50, gen=None, scheduler=None):
    gen = torch.Generator().manual_seed(0) if gen is None else gen
    dtype = next(module.parameters()).dtype
    for _ in range(steps):
        x = torch.randn(16, 6, generator=gen, dtype=dtype)
        y = torch.randn(16, 3, generator=gen, dtype=dtype)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(module(x), y).backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()


def max_diff(a, b):
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("hyper", list(HYPER))
@pytest.mark.usefixtures("backend")
def test_follows_torch_sgd_on_onnx_module(hyper, monkeypatch):
    """50 steps on an OnnxModule: same weights as torch.optim.SGD, one ORT call a step,
    parameters and velocities never move."""
    kwargs = HYPER[hyper]
    ours, ref = OnnxModule(mlp_model()), OnnxModule(mlp_model())
    optimizer = OrtSGD(ours.parameters(), lr=0.05, **kwargs)
    calls = []
    run = _fused_sgd._Update.run
    monkeypatch.setattr(_fused_sgd._Update, "run", lambda self: calls.append(1) or run(self))
    gen = torch.Generator().manual_seed(0)
    train(ours, optimizer, steps=1, gen=gen)
    addresses = [p.data_ptr() for p in ours.parameters()]
    velocities = [s["momentum_buffer"].data_ptr() for s in optimizer.state.values()]
    train(ours, optimizer, steps=49, gen=gen)
    train(ref, torch.optim.SGD(ref.parameters(), lr=0.05, **kwargs))
    # Two float32 optimizers drift apart by rounding, and each step's gradient
    # depends on the weights: Nesterov's 0.9 momentum amplifies it most (after
    # 50 steps 1.0e-5 or 1.5e-5 depending on how onnxruntime sums the bias
    # gradients; plain SGD 2.4e-7).
    assert max_diff(ours, ref) <= (3e-5 if hyper == "nesterov" else 1e-5)
    assert len(calls) == 50 and len(optimizer._updates) == 1
    assert [p.data_ptr() for p in ours.parameters()] == addresses
    assert [s["momentum_buffer"].data_ptr() for s in optimizer.state.values()] == velocities
    assert len(velocities) == (len(addresses) if "momentum" in kwargs else 0)


@pytest.mark.usefixtures("backend")
def test_float64_groups_and_scheduler():
    """Groups with their own hyperparameters, an LR scheduler changing lr every step.

    A linear model: onnxruntime 1.19.2 has no double ReluGrad kernel on CPU.
    """
    model = mlp_model(sizes=(6, 3), dtype=np.float64)
    ours, ref = OnnxModule(model), OnnxModule(model)

    def groups(module):
        params = dict(module.named_onnx_parameters())
        return [
            {"params": [params["W0"]], "weight_decay": 0.1},
            {"params": [params["b0"]], "momentum": 0.5, "nesterov": True},
        ]

    opt = OrtSGD(groups(ours), lr=0.1, momentum=0.9)
    opt_ref = torch.optim.SGD(groups(ref), lr=0.1, momentum=0.9)
    train(ours, opt, scheduler=torch.optim.lr_scheduler.ExponentialLR(opt, 0.95))
    train(ref, opt_ref, scheduler=torch.optim.lr_scheduler.ExponentialLR(opt_ref, 0.95))
    assert max_diff(ours, ref) <= 1e-12
    assert len(opt._updates) == 1, "a new learning rate must not rebuild the graph"


def test_parameters_without_gradient_are_left_alone():
    a = torch.nn.Parameter(torch.ones(3))
    b = torch.nn.Parameter(torch.ones(2))
    opt = OrtSGD([a, b], lr=0.5, momentum=0.9)
    a.grad = torch.ones(3)
    opt.step()
    assert a.tolist() == [0.5] * 3 and b.tolist() == [1.0, 1.0]
    assert b not in opt.state
    b.grad = torch.ones(2)
    opt.step()  # another layout: both parameters
    assert len(opt._updates) == 2
    torch.testing.assert_close(a.detach(), torch.full((3,), 0.5 - 0.5 * 1.9))
    assert b.tolist() == [0.5, 0.5]


def test_large_tensor_in_place_is_exact():
    """Output bound to the input's memory: exact on a large tensor too."""
    gen = torch.Generator().manual_seed(0)
    w0 = torch.randn(1_000_003, generator=gen, dtype=torch.float64)
    w = torch.nn.Parameter(w0.clone())
    opt = OrtSGD([w], lr=0.01, momentum=0.9, nesterov=True, weight_decay=0.1)
    ref = torch.nn.Parameter(w0.clone())
    opt_ref = torch.optim.SGD([ref], lr=0.01, momentum=0.9, nesterov=True, weight_decay=0.1)
    for _ in range(3):
        g = torch.randn(1_000_003, generator=gen, dtype=torch.float64)
        w.grad, ref.grad = g.clone(), g.clone()
        opt.step()
        opt_ref.step()
    torch.testing.assert_close(w.detach(), ref.detach(), rtol=1e-13, atol=1e-13)


def test_rebinds_when_memory_changes():
    """New gradient tensors, a replaced parameter, a loaded state: all followed."""
    w = torch.nn.Parameter(torch.zeros(4))
    opt = OrtSGD([w], lr=1.0, momentum=0.5)
    w.grad = torch.ones(4)
    opt.step()  # w = -1, v = 1
    w.data = torch.full((4,), 10.0)  # new memory
    w.grad = torch.full((4,), 2.0)  # new memory
    opt.step()  # v = 2.5, w = 7.5
    assert w.tolist() == [7.5] * 4
    state = copy.deepcopy(opt.state_dict())
    other = OrtSGD([w], lr=1.0, momentum=0.5)
    other.load_state_dict(state)
    other.step()  # v = 0.5 * 2.5 + 2 = 3.25
    assert w.tolist() == [4.25] * 4
    assert other.state[w]["momentum_buffer"].tolist() == [3.25] * 4


def test_pickle_keeps_velocities():
    w = torch.nn.Parameter(torch.zeros(3))
    opt = OrtSGD([w], lr=0.1, momentum=0.9)
    w.grad = torch.ones(3)
    opt.step()
    restored = pickle.loads(pickle.dumps(opt))
    velocity = next(iter(restored.state.values()))["momentum_buffer"]
    assert velocity.tolist() == [1.0] * 3
    assert restored._updates == {}


def test_autograd_sees_the_update():
    """The in-place write bumps the version counter, as torch's own in-place ops do."""
    w = torch.nn.Parameter(torch.ones(3))
    opt = OrtSGD([w], lr=0.1)
    out = (w * w).sum()  # saves w for backward
    w.grad = torch.ones(3)
    opt.step()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.backward()


def test_errors_name_what_is_wrong():
    w = torch.nn.Parameter(torch.ones(3))
    with pytest.raises(OnnxInputError, match="lr must be a finite number >= 0, got -1"):
        OrtSGD([w], lr=-1)
    with pytest.raises(OnnxInputError, match="nesterov=True needs momentum > 0"):
        OrtSGD([w], lr=0.1, nesterov=True)
    half = torch.nn.Parameter(torch.ones(3, dtype=torch.float16))
    half.grad = torch.ones(3, dtype=torch.float16)
    with pytest.raises(OnnxTypeError, match="parameter 0 of group 0 is a torch.float16"):
        OrtSGD([half], lr=0.1).step()
    strided = torch.nn.Parameter(torch.ones(4, 4).t())
    strided.grad = torch.ones(4, 4)
    with pytest.raises(OnnxInputError, match=r"shape \(4, 4\)\) is not contiguous"):
        OrtSGD([strided], lr=0.1).step()


def test_closure_and_non_contiguous_gradients():
    """Strided gradients are copied (and kept alive until the run), every step."""
    a = torch.nn.Parameter(torch.ones(2, 3))
    b = torch.nn.Parameter(torch.ones(3, 2))
    opt = OrtSGD([a, b], lr=0.5, momentum=0.5)
    ref_a, ref_b = torch.nn.Parameter(torch.ones(2, 3)), torch.nn.Parameter(torch.ones(3, 2))
    ref = torch.optim.SGD([ref_a, ref_b], lr=0.5, momentum=0.5)
    for step in range(3):

        def closure(step=step):
            opt.zero_grad()
            a.grad = torch.arange(6.0).reshape(3, 2).t() * (step + 1)
            b.grad = torch.arange(6.0).reshape(2, 3).t() - step
            return torch.tensor(1.5)

        assert opt.step(closure).item() == 1.5
        assert not a.grad.is_contiguous() and not b.grad.is_contiguous()
        ref_a.grad, ref_b.grad = a.grad.clone(), b.grad.clone()
        ref.step()
        torch.testing.assert_close(a.detach(), ref_a.detach())
        torch.testing.assert_close(b.detach(), ref_b.detach())


def test_update_graph_is_one_valid_model():
    """Every parameter of every group and dtype in one checked model, no copies."""
    import onnx

    momentum = _sgd_rule._Flags(True, True, True, True, unit_grad=False, unit_step=False)
    plain = _sgd_rule._Flags(False, False, False, False, unit_grad=False, unit_step=False)
    sets = ((TensorProto.FLOAT, momentum), (TensorProto.DOUBLE, plain))
    model = _sgd_rule.build_update_graph((sets, ((0, 2), (1, 1), (0, 1))))
    onnx.checker.check_model(model, full_check=True)
    assert [o.name for o in model.graph.output] == [
        "w0_new", "v0_new", "w1_new", "w2_new", "v2_new",
    ]  # fmt: skip
    assert "Identity" not in {n.op_type for n in model.graph.node}
    assert model.ir_version == 10


def test_scalar_and_mixed_dtype_parameters():
    """0-d parameters, and float32 beside float64 in one group (two sets of scalars)."""
    gen = torch.Generator().manual_seed(0)
    shapes = [((), torch.float32), ((3,), torch.float64), ((2, 2), torch.float32)]
    start = [torch.randn(s, generator=gen, dtype=d) for s, d in shapes]
    ours = [torch.nn.Parameter(t.clone()) for t in start]
    ref = [torch.nn.Parameter(t.clone()) for t in start]
    opt = OrtSGD(ours, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)
    opt_ref = torch.optim.SGD(ref, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)
    for _ in range(5):
        for p, q in zip(ours, ref):
            g = torch.randn(p.shape, generator=gen, dtype=p.dtype)
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        opt_ref.step()
    for p, q in zip(ours, ref):
        torch.testing.assert_close(p.detach(), q.detach())
    assert len(next(iter(opt._updates.values())).scalars) == 2


def test_state_dicts_interchange_with_torch_sgd():
    """A state dict of either optimizer loads into the other and training goes on."""
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(5, generator=gen)
    grads = [torch.randn(5, generator=gen) for _ in range(4)]

    def run(first, second):
        w = torch.nn.Parameter(start.clone())
        opt = first([w], lr=0.1, momentum=0.9, nesterov=True)
        for g in grads[:2]:
            w.grad = g.clone()
            opt.step()
        other = second([w], lr=0.1, momentum=0.9, nesterov=True)
        other.load_state_dict(opt.state_dict())
        for g in grads[2:]:
            w.grad = g.clone()
            other.step()
        return w.detach()

    reference = run(torch.optim.SGD, torch.optim.SGD)
    torch.testing.assert_close(run(OrtSGD, torch.optim.SGD), reference)
    torch.testing.assert_close(run(torch.optim.SGD, OrtSGD), reference)
    w = torch.nn.Parameter(torch.ones(2))
    w.grad = torch.ones(2)
    opt = OrtSGD([w], lr=0.1)
    opt.load_state_dict(torch.optim.SGD([w], lr=0.1, momentum=0.5, dampening=0.1).state_dict())
    with pytest.raises(OnnxInputError, match="group 0 has dampening=0.1"):
        opt.step()
