"""OrtFullGraphTrainer against torch's optimizers on the same model and batches."""

from __future__ import annotations

import copy
import doctest
import functools
import pickle

import numpy as np
import onnx
import onnxruntime
import pytest
import torch
from onnx import numpy_helper

import ortbridge.training._full_graph as full_graph
import ortbridge.training._graphs._update as update_graph
from ortbridge._runtime import _ort
from ortbridge._runtime._limits import limits
from ortbridge.examples import linear_model
from ortbridge.exceptions import (
    NotFittedError,
    OnnxInputError,
    OnnxModelError,
    TrainingDivergedError,
)
from ortbridge.training import OrtFullGraphTrainer


@pytest.fixture
def make_trainer(backend):
    """``OrtFullGraphTrainer`` on the gradient source under test (each one installed)."""
    return functools.partial(OrtFullGraphTrainer, backend=backend)


N_IN, N_OUT, N_ROWS, BATCH = 4, 2, 50, 10  # 5 steps an epoch, 20 steps in 4 epochs


def _torch_mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(N_IN, 8), torch.nn.Tanh(), torch.nn.Linear(8, N_OUT))


@pytest.fixture(scope="module")
def exported():
    """A torch MLP and its ONNX export (optimize=False keeps every initializer)."""
    module = _torch_mlp().eval()
    batch = torch.export.Dim("batch")
    program = torch.onnx.export(
        module,
        (torch.randn(3, N_IN),),
        dynamo=True,
        optimize=False,
        dynamic_shapes=({0: batch},),
        verbose=False,
    )
    return module, program.model_proto


@pytest.fixture
def data():
    rng = np.random.default_rng(0)
    X = rng.standard_normal((N_ROWS, N_IN)).astype(np.float32)
    y = rng.standard_normal((N_ROWS, N_OUT)).astype(np.float32)
    return X, y


def _torch_reference(module, X, y, make_optimizer, loss_fn, epochs, sample_weight=None):
    """Train a copy of ``module`` on the batches the trainer sees with shuffle=False."""
    module = _torch_mlp() if module is None else module
    optimizer = make_optimizer(module.parameters())
    for _ in range(epochs):
        for start in range(0, len(X), BATCH):
            xb = torch.from_numpy(X[start : start + BATCH])
            yb = torch.from_numpy(y[start : start + BATCH])
            per_element = loss_fn(module(xb), yb)
            per_row = per_element.reshape(len(xb), -1).mean(dim=1)
            if sample_weight is not None:
                per_row = per_row * torch.from_numpy(sample_weight[start : start + BATCH])
            optimizer.zero_grad()
            per_row.mean().backward()
            optimizer.step()
    return {k: v.detach().numpy() for k, v in module.state_dict().items()}


def _fresh_copy(module):
    copy = _torch_mlp()
    copy.load_state_dict(module.state_dict())
    return copy


def _linear_like(model):
    """``torch.nn.Linear`` holding a one-Gemm model's initial weights, in their dtype."""
    weights = {i.name: torch.from_numpy(numpy_helper.to_array(i)) for i in model.graph.initializer}
    n_out, n_in = weights["weight"].shape
    linear = torch.nn.Linear(n_in, n_out, dtype=weights["weight"].dtype)
    linear.load_state_dict(weights)
    return linear


def _max_diff(weights, expected):
    assert set(weights) == set(expected)
    return max(float(np.abs(weights[k] - expected[k]).max()) for k in weights)


def _mse(p, y):
    return (p - y) ** 2


def _l1(p, y):
    return (p - y).abs()


def _elastic(p, y):
    return 0.5 * (p - y).abs() + 0.5 * (p - y) ** 2


OPTIMIZERS = [
    pytest.param("adamw", 1e-2, None, lambda p: torch.optim.AdamW(p, lr=1e-2), id="adamw"),
    pytest.param("sgd", 0.1, None, lambda p: torch.optim.SGD(p, lr=0.1), id="sgd"),
    pytest.param(
        "adamw",
        3e-2,
        {"betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.1},
        lambda p: torch.optim.AdamW(p, lr=3e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1),
        id="adamw-options",
    ),
    pytest.param(
        "sgd",
        0.05,
        {"momentum": 0.9, "weight_decay": 0.01},
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=0.01),
        id="sgd-momentum",
    ),
    pytest.param(
        "sgd",
        0.05,
        {"momentum": 0.9, "nesterov": True},
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True),
        id="sgd-nesterov",
    ),
]


@pytest.mark.parametrize("optimizer, lr, params, make_torch", OPTIMIZERS)
def test_20_steps_match_torch_optimizer(
    make_trainer, exported, data, optimizer, lr, params, make_torch
):
    module, model = exported
    X, y = data
    trainer = make_trainer(
        model,
        optimizer=optimizer,
        learning_rate=lr,
        optimizer_params=params,
        batch_size=BATCH,
        max_iter=4,
        shuffle=False,
    ).fit(X, y)
    assert trainer.n_steps_ == 20
    expected = _torch_reference(_fresh_copy(module), X, y, make_torch, _mse, epochs=4)
    before = {k: v.detach().numpy() for k, v in module.state_dict().items()}
    assert _max_diff(before, expected) > 1e-2  # the weights did move
    assert _max_diff(trainer.get_weights(), expected) <= 1e-5


@pytest.mark.parametrize(
    "loss, loss_fn",
    [("absolute_error", _l1), ("elastic", _elastic), ("squared_error", _mse)],
    ids=["absolute_error", "elastic", "squared_error"],
)
def test_losses_and_sample_weights_match_torch(make_trainer, exported, data, loss, loss_fn):
    module, model = exported
    X, y = data
    sw = np.random.default_rng(5).uniform(0.2, 3.0, N_ROWS).astype(np.float32)
    trainer = make_trainer(
        model, loss=loss, optimizer="sgd", learning_rate=0.1, batch_size=BATCH, max_iter=4
    )
    trainer.shuffle = False
    trainer.fit(X, y, sample_weight=sw)

    def make(p):
        return torch.optim.SGD(p, lr=0.1)

    expected = _torch_reference(_fresh_copy(module), X, y, make, loss_fn, 4, sample_weight=sw)
    assert _max_diff(trainer.get_weights(), expected) <= 1e-5


def test_log_loss_from_zero_weights_matches_bce_with_logits(make_trainer):
    """Scores are exactly 0 at the first step: the gradient must be sigmoid(0) - y."""
    model = linear_model(N_IN, 1)
    for init in model.graph.initializer:
        init.CopyFrom(
            numpy_helper.from_array(np.zeros_like(numpy_helper.to_array(init)), init.name)
        )
    rng = np.random.default_rng(1)
    X = rng.standard_normal((N_ROWS, N_IN)).astype(np.float32)
    y = (X[:, 0] - X[:, 1] > 0).astype(np.float32)  # shape (N,): reshaped to (N, 1)
    trainer = make_trainer(
        model,
        loss="log_loss",
        optimizer="sgd",
        learning_rate=0.5,
        batch_size=BATCH,
        max_iter=4,
        shuffle=False,
    ).fit(X, y)
    linear = torch.nn.Linear(N_IN, 1)
    torch.nn.init.zeros_(linear.weight)
    torch.nn.init.zeros_(linear.bias)
    optimizer = torch.optim.SGD(linear.parameters(), lr=0.5)
    bce = torch.nn.BCEWithLogitsLoss()
    for _ in range(4):
        for start in range(0, N_ROWS, BATCH):
            xb = torch.from_numpy(X[start : start + BATCH])
            yb = torch.from_numpy(y[start : start + BATCH, None])
            optimizer.zero_grad()
            bce(linear(xb), yb).backward()
            optimizer.step()
    expected = {"weight": linear.weight.detach().numpy(), "bias": linear.bias.detach().numpy()}
    assert _max_diff(trainer.get_weights(), expected) <= 1e-5
    assert trainer.train_losses_[0] < np.log(2) and trainer.train_losses_[-1] < 0.4


def test_one_onnxruntime_call_per_step_and_no_copies(make_trainer, exported, data):
    _, model = exported
    X, y = data
    trainer = make_trainer(model, batch_size=BATCH, max_iter=1, shuffle=False)
    trainer.fit(X, y)  # builds the graph and session
    runner = trainer._active
    calls = []
    real_run = runner.run

    def counting_run(session, binding):
        calls.append(binding)
        return real_run(session, binding)

    runner.run = counting_run
    addresses = [{k: v.data_ptr() for k, v in s.items()} for s in runner.sets]
    loss_address = runner.loss.data_ptr()
    trainer.max_iter = 3
    trainer.fit(X, y)
    assert len(calls) == 15 == trainer.n_steps_ - 5  # one call per step, nothing else
    # The two bindings alternate: each step reads one state set and writes the other.
    assert all(call is runner.bindings[(k + 1) % 2] for k, call in enumerate(calls))
    # Every step wrote its outputs into the buffers bound at build time.
    assert [{k: v.data_ptr() for k, v in s.items()} for s in runner.sets] == addresses
    assert runner.loss.data_ptr() == loss_address
    # No gradient accumulation buffer, no tensor sequence to pack the weights in.
    ops = {n.op_type for n in runner.training.model.graph.node}
    assert not ops & {"InPlaceAccumulatorV2", "SequenceConstruct", "SequenceAt", "Copy"}


def test_predict_and_to_onnx_agree(make_trainer, exported, data):
    _, model = exported
    X, y = data
    trainer = make_trainer(model, learning_rate=1e-2, max_iter=3, random_state=0)
    trainer.fit(X, y)
    prediction = trainer.predict(X)
    exported_model = trainer.to_onnx()
    assert exported_model.ir_version <= 10
    assert [i.name for i in exported_model.graph.input] == [i.name for i in model.graph.input]
    session = onnxruntime.InferenceSession(
        exported_model.SerializeToString(), providers=["CPUExecutionProvider"]
    )
    (from_file,) = session.run(None, {model.graph.input[0].name: X})
    np.testing.assert_allclose(prediction, from_file, rtol=1e-6, atol=1e-6)
    weights = trainer.get_weights()
    for init in exported_model.graph.initializer:
        np.testing.assert_array_equal(numpy_helper.to_array(init), weights[init.name])
    # and it predicts better than the untrained model
    untrained = onnxruntime.InferenceSession(
        model.SerializeToString(), providers=["CPUExecutionProvider"]
    ).run(None, {model.graph.input[0].name: X})[0]
    assert ((prediction - y) ** 2).mean() < ((untrained - y) ** 2).mean()


def test_checkpoint_continues_the_same_trajectory(make_trainer, exported, data, tmp_path):
    _, model = exported
    X, y = data
    options = dict(learning_rate=1e-2, batch_size=BATCH, random_state=3, shuffle=True)
    straight = make_trainer(model, max_iter=4, **options).fit(X, y)

    first = make_trainer(model, max_iter=2, **options).fit(X, y)
    path = tmp_path / "trainer.ckpt"
    first.save_checkpoint(path)
    resumed = make_trainer(model, max_iter=2, **options).load_checkpoint(path)
    np.testing.assert_array_equal(resumed.predict(X), first.predict(X))
    resumed.fit(X, y)
    assert resumed.train_losses_ == straight.train_losses_
    assert resumed.n_steps_ == straight.n_steps_ == 20
    assert _max_diff(resumed.get_weights(), straight.get_weights()) == 0.0
    # the optimizer state was restored too: one more epoch each stays identical
    resumed.max_iter = straight.max_iter = 1
    assert resumed.fit(X, y).train_losses_ == straight.fit(X, y).train_losses_


def test_checkpoint_of_another_optimizer_is_refused(make_trainer, exported, data, tmp_path):
    _, model = exported
    X, y = data
    path = tmp_path / "sgd.ckpt"
    make_trainer(model, optimizer="sgd", max_iter=1).fit(X, y).save_checkpoint(path)
    with pytest.raises(
        OnnxInputError, match="holds optimizer 'sgd' state.*needs optimizer 'adamw'"
    ):
        make_trainer(model).load_checkpoint(path)
    (tmp_path / "junk").write_bytes(b"not a checkpoint")
    with pytest.raises(OnnxInputError, match="is not a trainer checkpoint"):
        make_trainer(model).load_checkpoint(tmp_path / "junk")


def test_graphs_load_whatever_ir_version_the_model_has(make_trainer, data):
    """A model written by a newer onnx than onnxruntime loads (IR 11 for onnxruntime
    1.19.2, 14 for 1.31.1) still trains: the graphs get the runtime's IR version."""
    X, _ = data
    max_ir, _ = limits()
    model = linear_model(N_IN, 1)
    model.ir_version = max_ir + 1
    for opset in model.opset_import:
        opset.version = 21
    with pytest.raises(Exception, match="(?i)ir.?version|unsupported model"):
        onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    trainer = make_trainer(model, optimizer="sgd", learning_rate=0.1, max_iter=2)
    trainer.fit(X, X[:, :1] * 2.0)
    training = trainer._active.training.model
    assert training.ir_version == max_ir
    assert {o.domain or "ai.onnx": o.version for o in training.opset_import}["ai.onnx"] == 21
    assert trainer.to_onnx().ir_version == max_ir
    onnx.checker.check_model(trainer.to_onnx())
    assert trainer.predict(X).shape == (N_ROWS, 1)


def test_float64_model_trains(make_trainer):
    model = linear_model(N_IN, 1)
    graph = model.graph
    for init in graph.initializer:
        init.CopyFrom(
            numpy_helper.from_array(numpy_helper.to_array(init).astype(np.float64), init.name)
        )
    for value in list(graph.input) + list(graph.output):
        value.type.tensor_type.elem_type = onnx.TensorProto.DOUBLE
    X = np.random.default_rng(0).standard_normal((40, N_IN))
    y = X @ np.arange(1.0, N_IN + 1)
    trainer = make_trainer(
        model, optimizer="sgd", learning_rate=0.1, max_iter=30, batch_size=BATCH, shuffle=False
    )
    start = _linear_like(model)
    trainer.fit(X, y)
    assert trainer.predict(X).dtype == np.float64
    sgd = functools.partial(torch.optim.SGD, lr=0.1)
    expected = _torch_reference(start, X, y[:, None], sgd, _mse, epochs=30)
    assert _max_diff(trainer.get_weights(), expected) <= 1e-12
    assert trainer.train_losses_[-1] < 1e-6


def test_frozen_initializers_stay_put(make_trainer, exported, data):
    module, model = exported
    X, y = data
    trainer = make_trainer(model, trainable=["2.weight", "2.bias"], max_iter=2)
    trainer.fit(X, y)
    assert set(trainer.get_weights()) == {"2.weight", "2.bias"}
    frozen = {i.name: numpy_helper.to_array(i) for i in trainer.to_onnx().graph.initializer}
    np.testing.assert_array_equal(frozen["0.weight"], module.state_dict()["0.weight"].numpy())
    assert not np.array_equal(frozen["2.weight"], module.state_dict()["2.weight"].numpy())


def test_switching_to_sample_weights_keeps_the_state(make_trainer, exported, data):
    _, model = exported
    X, y = data
    options = dict(optimizer="sgd", learning_rate=0.1, batch_size=BATCH, shuffle=False)
    one_call = make_trainer(model, max_iter=2, **options)
    one_call.fit(X, y, sample_weight=np.ones(N_ROWS))
    two_calls = make_trainer(model, max_iter=1, **options)
    two_calls.fit(X, y).fit(X, y, sample_weight=np.ones((N_ROWS, 1)))
    assert _max_diff(two_calls.get_weights(), one_call.get_weights()) <= 1e-6
    assert two_calls.reset().fit(X, y).n_steps_ == 5


def test_shuffling_is_seeded(make_trainer, exported, data):
    _, model = exported
    X, y = data
    a = make_trainer(model, max_iter=2, random_state=7).fit(X, y).train_losses_
    b = make_trainer(model, max_iter=2, random_state=7).fit(X, y).train_losses_
    c = make_trainer(model, max_iter=2, random_state=8).fit(X, y).train_losses_
    assert a == b != c


def test_errors_say_what_was_expected(make_trainer, exported, data):
    _, model = exported
    X, y = data
    with pytest.raises(NotFittedError, match="call fit or load_checkpoint before predict"):
        make_trainer(model).predict(X)
    with pytest.raises(OnnxInputError, match=r"optimizer='adam' is not supported.*'adamw', 'sgd'"):
        make_trainer(model, optimizer="adam").fit(X, y)
    with pytest.raises(OnnxInputError, match=r"optimizer_params \['lr'\] are not options"):
        make_trainer(model, optimizer_params={"lr": 1}).fit(X, y)
    with pytest.raises(
        OnnxInputError, match=r"\['fc.weight'\] is not a floating-point initializer"
    ):
        make_trainer(model, trainable=["fc.weight"]).fit(X, y)
    with pytest.raises(OnnxInputError, match=r"y: expected 50 rows.*got shape \(49, 2\)"):
        make_trainer(model).fit(X, y[:49])
    with pytest.raises(
        OnnxInputError, match=r"sample_weight: expected shape \(50,\), got \(50, 2\)"
    ):
        make_trainer(model).fit(X, y, sample_weight=np.ones((N_ROWS, 2)))
    with pytest.raises(
        OnnxInputError, match=r"input 'input': expected shape \('N', 4\), got \(50, 3\)"
    ):
        make_trainer(model).fit(X[:, :3], y)
    shapeless = linear_model(N_IN, 1)
    shapeless.graph.input[0].type.tensor_type.ClearField("shape")  # onnxruntime's error then
    # onnxruntime's error for the builder's shape-generic graph, onnx's for
    # onnx-ad's graph, built for the batch's shapes
    wrong_shapes = r"(failed to run a training step|cannot run a batch of shapes).*\(32, 3\).*Gemm"
    with pytest.raises(OnnxModelError, match=wrong_shapes):
        make_trainer(shapeless, max_iter=1).fit(X[:, :3], y[:, :1])
    with pytest.raises(TrainingDivergedError, match="training loss is (nan|inf).*learning_rate"):
        make_trainer(model, optimizer="sgd", learning_rate=1e6, max_iter=5).fit(X, y * 1e3)


def test_docstring_examples():
    for module in (full_graph, update_graph):
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert result.failed == 0
    assert doctest.testmod(full_graph).attempted > 0


def test_pickle_and_deepcopy_keep_the_training_state(make_trainer, exported, data):
    _, model = exported
    X, y = data
    options = dict(learning_rate=1e-2, batch_size=BATCH, random_state=1, max_iter=1)
    trainer = make_trainer(model, **options).fit(X, y)
    clone = pickle.loads(pickle.dumps(trainer))
    twin = copy.deepcopy(trainer)
    np.testing.assert_array_equal(clone.predict(X), trainer.predict(X))
    losses = trainer.fit(X, y).train_losses_
    assert clone.fit(X, y).train_losses_ == losses == twin.fit(X, y).train_losses_
    unfitted = pickle.loads(pickle.dumps(make_trainer(model, max_iter=3)))
    assert unfitted.max_iter == 3 and not hasattr(unfitted, "train_losses_")


def test_batch_norm_is_refused_with_a_pointer_to_onnx_module(make_trainer):
    model = linear_model(N_IN, 3)
    graph = model.graph
    out = graph.output[0].name
    graph.node[-1].output[0] = "pre_bn"
    for name, value in (("scale", 1.0), ("shift", 0.0), ("mean", 0.0), ("var", 1.0)):
        graph.initializer.append(numpy_helper.from_array(np.full(3, value, np.float32), name))
    graph.node.append(
        onnx.helper.make_node(
            "BatchNormalization", ["pre_bn", "scale", "shift", "mean", "var"], [out], name="bn"
        )
    )
    X = np.ones((4, N_IN), np.float32)
    with pytest.raises(OnnxModelError, match=r"BatchNormalization nodes \['bn'\].*OnnxModule"):
        make_trainer(model).fit(X, np.ones((4, 3), np.float32))


def test_training_paths_benchmark_runs(tmp_path):
    """The benchmark's smallest configuration, this environment's part: every way runs."""
    import importlib.util
    import json
    import sys
    from pathlib import Path

    folder = Path(__file__).parents[2] / "benchmarks"
    spec = importlib.util.spec_from_file_location(
        "bench_training_paths", folder / "bench_training_paths.py"
    )
    bench = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(folder))  # its helper module sits beside it
    try:
        spec.loader.exec_module(bench)
    finally:
        sys.path.remove(str(folder))
    output = tmp_path / "result.json"
    argv = ["--sizes", "4,8,1", "--batch", "4", "--steps", "2", "--rounds", "1"]
    threads = torch.get_num_threads()
    try:
        result = bench.main(
            [*argv, "--threads", "1", "--no-other-runtime", "--output", str(output)]
        )
    finally:
        torch.set_num_threads(threads)  # the script sets the process's count
    assert json.loads(output.read_text()) == json.loads(json.dumps(result))
    (part,) = result["parts"]
    ways = {row["way"]: row for row in part["rows"]}
    assert part["skipped"] == {}
    assert ways["full graph, onnx-ad"]["ratio_to_full_graph"] == 1.0
    expected = {"OnnxModule + torch SGD", "OnnxModule + OrtSGD", "torch eager (reference)"}
    if _ort.has_training():
        expected |= {"full graph, builder", "ort training api (reference)"}
    assert expected <= set(ways)


def test_old_model_with_initializers_listed_as_inputs(make_trainer, data):
    """IR 3 / opset 9: initializers are also graph inputs; Gemm is the opset-9 form."""
    X, _ = data
    model = linear_model(N_IN, 1)
    graph = model.graph
    for init in graph.initializer:
        graph.input.append(
            onnx.helper.make_tensor_value_info(init.name, init.data_type, list(init.dims))
        )
    del model.opset_import[:]
    model.opset_import.append(onnx.helper.make_opsetid("", 9))
    model.ir_version = 3
    y = X @ np.arange(1.0, N_IN + 1, dtype=np.float32)
    # Three epochs, short of convergence: the weights still show every step.
    trainer = make_trainer(
        model, optimizer="sgd", learning_rate=0.1, max_iter=3, batch_size=BATCH, shuffle=False
    )
    start = _linear_like(model)
    trainer.fit(X, y)
    sgd = functools.partial(torch.optim.SGD, lr=0.1)
    expected = _torch_reference(start, X, y[:, None], sgd, _mse, epochs=3)
    assert _max_diff(trainer.get_weights(), expected) <= 1e-5
    session = onnxruntime.InferenceSession(
        trainer.to_onnx().SerializeToString(), providers=["CPUExecutionProvider"]
    )
    np.testing.assert_allclose(session.run(None, {"x": X})[0], trainer.predict(X), rtol=1e-6)


def test_dropout_is_off_in_predictions(make_trainer):
    """A model exported in train mode trains with Dropout and predicts without it."""
    from conftest import export

    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(4, 32), torch.nn.ReLU(), torch.nn.Dropout(0.5), torch.nn.Linear(32, 1)
    ).train()
    onx = export(net, (torch.zeros(2, 4),))
    rng = np.random.default_rng(0)
    X = rng.standard_normal((64, 4)).astype(np.float32)
    y = X[:, :1] - X[:, 1:2]
    trainer = make_trainer(onx, optimizer="sgd", learning_rate=0.05, max_iter=3)
    trainer.fit(X, y)
    # torch's network in eval mode (no Dropout) with the trained weights.
    net.load_state_dict({k: torch.from_numpy(v) for k, v in trainer.get_weights().items()})
    with torch.no_grad():
        expected = net.eval()(torch.from_numpy(X)).numpy()
    np.testing.assert_allclose(trainer.predict(X), expected, rtol=1e-5, atol=1e-6)
    session = onnxruntime.InferenceSession(
        trainer.to_onnx().SerializeToString(), providers=["CPUExecutionProvider"]
    )
    name = session.get_inputs()[0].name
    np.testing.assert_allclose(session.run(None, {name: X})[0], trainer.predict(X), rtol=1e-6)
    assert not any(n.op_type == "Dropout" for n in trainer.to_onnx().graph.node)
