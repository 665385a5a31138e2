"""Op coverage of the onnxruntime engine: ONNX's node test cases against finite differences.

The whole suite runs in ``benchmarks/op_coverage.py`` (about a minute on 2
cores, cases in worker processes); here, in-process, the cases of a fixed set
of op types across elementwise ops, MatMul/Conv, pooling, normalisation,
reductions, shape ops and recurrent layers, each of which must be correct;
the harness itself on cases built to pass or fail; and the committed table
(``benchmarks/results/op_coverage.json``), which must meet the target and
report no wrong case.
"""

from __future__ import annotations

import json
import os
import re
import signal

import numpy as np
import pytest
import torch
from onnx import helper

pytest.importorskip("onnx_ad")
pytest.importorskip("onnxruntime")

from ortbridge import _coverage  # noqa: E402
from ortbridge.exceptions import OrtBridgeError  # noqa: E402

RESULTS = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    "benchmarks",
    "results",
    "op_coverage.json",
)

#: At least this many op types train with every case correct (the issue's target).
MIN_TRAINED = 105

#: Op types checked here in-process: every case of each must be correct.
OP_TYPES = {
    "elementwise": [
        "Abs", "Add", "Sub", "Mul", "Div", "Exp", "Log", "Sqrt", "Tanh", "Sigmoid", "Relu",
        "LeakyRelu", "Elu", "Selu", "Softplus", "Softsign", "Erf", "Gelu", "HardSigmoid",
        "HardSwish", "Mish", "PRelu", "Clip", "Max", "Min", "Where", "Neg", "Reciprocal",
        "Sin", "Cos",
    ],
    "matmul-conv": ["MatMul", "Gemm", "Conv", "ConvTranspose", "DeformConv", "Col2Im"],
    "pooling": ["MaxPool", "GlobalAveragePool", "GlobalMaxPool", "MaxUnpool"],
    "normalization": [
        "InstanceNormalization", "GroupNormalization", "LpNormalization", "LRN",
        "MeanVarianceNormalization", "RMSNormalization",
    ],
    "reductions": [
        "ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1",
        "ReduceL2", "ReduceLogSumExp", "ReduceSumSquare", "Softmax", "LogSoftmax", "CumSum",
        "CumProd", "TopK",
    ],
    "shape": [
        "Reshape", "Transpose", "Concat", "Split", "Squeeze", "Unsqueeze", "Flatten", "Expand",
        "Tile", "Pad", "Gather", "GatherElements", "GatherND", "DepthToSpace", "SpaceToDepth",
    ],
    "recurrent": ["LSTM", "GRU", "RNN"],
    "other": [
        "GridSample", "AffineGrid", "STFT", "NegativeLogLikelihoodLoss",
        "SoftmaxCrossEntropyLoss",
    ],
}  # fmt: skip
ALL_OPS = sorted(op for ops in OP_TYPES.values() for op in ops)

_EMPTY_BACKWARD = (
    "zero-size input: its gradient is empty, the backward graph has no output left and "
    "onnxruntime refuses to load it (OrtValue indexes should have been populated)"
)
#: Cases of OP_TYPES the engine does not get right yet: each may fail
#: (error, refused) but never be wrong. Remove an entry once it passes.
KNOWN_GAPS = {
    "test_reduce_l1_empty_set": _EMPTY_BACKWARD,
    "test_reduce_l2_empty_set": _EMPTY_BACKWARD,
    "test_reduce_log_sum_exp_empty_set": _EMPTY_BACKWARD,
    "test_reduce_max_empty_set": _EMPTY_BACKWARD,
    "test_reduce_min_empty_set": _EMPTY_BACKWARD,
    "test_reduce_prod_empty_set": _EMPTY_BACKWARD,
    "test_reduce_sum_empty_set": _EMPTY_BACKWARD,
    "test_reduce_sum_empty_set_non_reduced_axis_zero": _EMPTY_BACKWARD,
    "test_reduce_sum_square_empty_set": _EMPTY_BACKWARD,
    "test_reshape_allowzero_reordered": (
        "zero-size input (0, 3, 4) reshaped to (3, 4, 0): the backward graph's Expand fails "
        "onnxruntime's shape inference"
    ),
}


@pytest.fixture(scope="module")
def cases_by_op():
    found: dict[str, list] = {}
    for case in _coverage.node_cases(ALL_OPS, expanded=False):
        found.setdefault(case.op_key, []).append(case)
    return found


def _report(results) -> str:
    return "\n".join(f"{r.name}: {r.status}: {r.detail} {r.note}" for r in results)


@pytest.mark.parametrize("op_type", ALL_OPS)
def test_every_case_of_the_op_type_is_correct(op_type, cases_by_op):
    cases = cases_by_op.get(op_type)
    assert cases, f"onnx has no node test case for {op_type}"
    results = [_coverage.run_case(case) for case in cases]
    if all(r.status == _coverage.SKIPPED for r in results):
        # An older onnxruntime (the training build's 1.19.2 reads opsets up to 21).
        pytest.skip(f"onnxruntime runs no case of {op_type}: {results[0].detail}")
    checked = [r for r in results if r.status not in (_coverage.NO_GRADIENT, _coverage.SKIPPED)]
    assert checked, f"no case of {op_type} has a gradient to check:\n{_report(results)}"
    gaps = [r for r in checked if r.name in KNOWN_GAPS]
    assert all(r.status != _coverage.WRONG for r in gaps), _report(gaps)
    checked = [r for r in checked if r.name not in KNOWN_GAPS]
    bad = [r for r in checked if r.status != _coverage.CORRECT]
    assert not bad, f"{len(bad)} of {len(checked)} case(s) of {op_type}:\n{_report(bad)}"
    # Every case compared gradient elements (zero-size inputs: their shapes only).
    assert all(r.checked > 0 or "zero-size" in r.note for r in checked), _report(checked)
    assert any(r.grad_max for r in checked), "every derivative checked was zero"


def test_graphs_built_per_shape_save_the_outputs_they_read():
    """A graph built for one input shape may read an output the first one built
    does not (LayerNormalization written out as its function body, where a
    view of an output is taken in the backward): each call saves what the
    graph that ran reads."""
    names = {
        "test_layer_normalization_3d_axis1_epsilon_expanded",
        "test_layer_normalization_3d_axis_negative_2_epsilon_expanded",
    }
    cases = [c for c in _coverage.node_cases(["LayerNormalization"]) if c.name in names]
    assert len(cases) == 2
    results = [_coverage.run_case(case) for case in cases]
    assert all(r.status == _coverage.CORRECT for r in results), _report(results)


# -- the harness on cases built to pass or fail -----------------------------------


def _unary_case(op_type: str, x: np.ndarray, **attrs) -> _coverage.NodeCase:
    node = helper.make_node(op_type, ["x"], ["y"], **attrs)
    elem = helper.np_dtype_to_tensor_dtype(x.dtype)
    graph = helper.make_graph(
        [node],
        f"test_{op_type.lower()}_built",
        [helper.make_tensor_value_info("x", elem, x.shape)],
        [helper.make_tensor_value_info("y", elem, x.shape)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return _coverage.NodeCase(model.graph.name, op_type, "", False, model, [x], [])


def test_a_kink_on_the_inputs_is_not_a_wrong_gradient():
    # Abs at 0 and Relu at 0: any value between the one-sided derivatives is right.
    x = np.array([[-1.5, 0.0, 0.0, 2.0], [0.0, 3.0, -0.5, 0.0]], dtype=np.float32)
    for op in ("Abs", "Relu"):
        result = _coverage.run_case(_unary_case(op, x))
        assert result.status == _coverage.CORRECT, result
        assert result.dtype == "float64"  # converted: onnxruntime runs both in float64
        assert result.checked == x.size


def test_a_scaled_gradient_is_wrong(monkeypatch):
    grad = torch.autograd.grad

    def off_by_one_percent(outputs, inputs, grad_outputs, **kwargs):
        return [g * 1.01 for g in grad(outputs, inputs, grad_outputs, **kwargs)]

    monkeypatch.setattr(torch.autograd, "grad", off_by_one_percent)
    x = np.linspace(-2.0, 2.0, 12).reshape(3, 4)
    result = _coverage.run_case(_unary_case("Tanh", x))
    assert result.status == _coverage.WRONG
    assert result.detail.startswith("x[0] (x=-2): gradient ")


def test_a_nan_gradient_where_the_function_is_smooth_is_wrong(monkeypatch):
    grad = torch.autograd.grad

    def nan_first(outputs, inputs, grad_outputs, **kwargs):
        grads = [g.clone() for g in grad(outputs, inputs, grad_outputs, **kwargs)]
        grads[0].view(-1)[0] = float("nan")
        return grads

    monkeypatch.setattr(torch.autograd, "grad", nan_first)
    # Not rescued by moving the inputs: the derivative exists where it failed.
    result = _coverage.run_case(_unary_case("Sigmoid", np.linspace(-1.0, 1.0, 6)))
    assert result.status == _coverage.WRONG
    assert "gradient nan" in result.detail
    assert not result.note


def test_a_graph_without_float_input_has_no_gradient_path():
    case = _unary_case("Abs", np.arange(6, dtype=np.int64))
    result = _coverage.run_case(case)
    assert result.status == _coverage.NO_GRADIENT
    assert result.detail == "no float32/float64 graph input"


def test_a_crashing_case_costs_only_itself(monkeypatch, cases_by_op):
    if torch.cuda.is_initialized():  # checked at run time: earlier tests may use CUDA
        pytest.skip("forked workers cannot run autograd after this process used CUDA")
    cases = cases_by_op["Relu"] + cases_by_op["Tanh"]
    doomed = cases[1].name
    run_case = _coverage.run_case

    def crash_on_one(case, **kwargs):
        if case.name == doomed:
            os.kill(os.getpid(), signal.SIGSEGV)
        return run_case(case, **kwargs)

    # Worker processes are forked: they inherit the patched function.
    monkeypatch.setattr(_coverage, "run_case", crash_on_one)
    results = _coverage.run_isolated(cases, workers=2, quiet=True)
    assert [r.name for r in results] == [c.name for c in cases]
    for r in results:
        if r.name == doomed:
            assert r.status == _coverage.ERROR
            assert r.detail == f"the process died (exit code {-signal.SIGSEGV})"
        else:
            assert r.status == _coverage.CORRECT, r


def test_forked_workers_refused_after_cuda_was_used(monkeypatch, cases_by_op):
    """torch's autograd fails in every child forked after CUDA work: the harness
    says so before forking, instead of reporting each case as an error."""
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(OrtBridgeError, match=r"forked processes.*after CUDA was used"):
        _coverage.run_isolated(cases_by_op["Relu"], workers=2, quiet=True)


def test_op_type_status_counts_only_cases_with_a_gradient_path():
    def result(name, status, grad_max=1.0, expanded=False):
        return _coverage.CaseResult(name, "Op", expanded, status, grad_max=grad_max)

    rows = _coverage.by_op_type(
        [
            result("a", _coverage.CORRECT),
            result("b", _coverage.NO_GRADIENT, None),
            result("c", _coverage.SKIPPED, None),
            result("a_expanded", _coverage.WRONG, expanded=True),
        ]
    )
    assert rows["Op"]["status"] == _coverage.TRAINS
    assert (rows["Op"]["expanded_cases"], rows["Op"]["expanded_wrong"]) == (1, 1)
    rows = _coverage.by_op_type([result("a", _coverage.CORRECT), result("b", _coverage.REFUSED)])
    assert rows["Op"]["status"] == _coverage.PARTIAL
    rows = _coverage.by_op_type([result("a", _coverage.CORRECT, 0.0)])
    assert rows["Op"]["status"] == _coverage.ZERO_GRADIENT
    rows = _coverage.by_op_type([result("a", _coverage.CORRECT), result("b", _coverage.WRONG)])
    assert rows["Op"]["status"] == _coverage.WRONG


# -- the committed table ------------------------------------------------------------


@pytest.fixture(scope="module")
def committed():
    assert os.path.isfile(RESULTS), (
        f"{RESULTS} is missing: run `python benchmarks/op_coverage.py` and commit its results"
    )
    with open(RESULTS) as f:
        return json.load(f)


def test_committed_table_meets_the_target_with_no_wrong_case(committed):
    summary = committed["summary"]
    wrong = [c["name"] for c in committed["cases"] if c["status"] == _coverage.WRONG]
    assert not wrong, f"the committed table reports wrong gradients: {wrong}"
    assert summary["cases"]["wrong"] == summary["expanded_cases"]["wrong"] == 0
    trained = summary["op_types_trained"]
    assert len(trained) == summary["op_types"][_coverage.TRAINS] >= MIN_TRAINED
    # The table agrees with the op types tested here: correct but for the known gaps.
    gaps = {}
    for case in committed["cases"]:
        if case["name"] in KNOWN_GAPS:
            gaps[case["op_type"]] = gaps.get(case["op_type"], 0) + 1
    for op in ALL_OPS:
        row = committed["op_types"][op]
        assert row["correct"] and row["error"] + row["refused"] <= gaps.get(op, 0), (op, row)
    # Every refusal is a NotDifferentiableError naming the node ("the rest refused by name").
    unnamed = [
        case["name"]
        for case in committed["cases"]
        if case["status"] == _coverage.REFUSED
        and not re.match(r"NotDifferentiableError: .*node '[^'?]+'", case["detail"])
    ]
    assert not unnamed, f"refusals that do not name the node: {unnamed}"


def test_committed_table_agrees_with_its_cases(committed):
    results = [_coverage.CaseResult(**case) for case in committed["cases"]]
    assert committed["op_types"] == _coverage.by_op_type(results)
    assert committed["summary"] == _coverage.summary(results)
    assert len(results) == len({r.name for r in results}) > 1000
    assert {r.status for r in results} <= set(_coverage.CLASSES)
