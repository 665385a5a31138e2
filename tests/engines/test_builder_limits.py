"""The training build's gradient builder: the table of what it gets wrong, and the node suite.

Each entry of :data:`ortbridge._engines.training_agent._limits.LIMITS` is checked
against the installed runtime with the table switched off (an entry no
longer true fails here: remove it), then with the table on: the training-agent
engine rewrites the node and trains it correctly, or refuses it by name;
``auto`` trains it. Then ONNX's whole node suite through the training-agent
engine: no case may be wrong, none may kill the process. Cases run in forked
workers (:func:`ortbridge._coverage.run_isolated`).
"""

from __future__ import annotations

import pytest
import torch
from builder_probes import probe
from conftest import requires_training_build

from ortbridge import OnnxModule, _coverage
from ortbridge._engines.training_agent import _limits as limits
from ortbridge.exceptions import NotDifferentiableError

pytestmark = requires_training_build

#: What the onnxruntime engine refuses too (by name): "auto" cannot train them.
_NEITHER = {"split-to-sequence"}
#: Trained straight through (torch's fake quantization), which finite
#: differences cannot check: ``tests/test_quantized.py`` checks it against torch.
_STRAIGHT_THROUGH = {
    "fake-quantize-per-axis",
    "fake-quantize-raw-zero-point",
    "fake-quantize-shared-zero-point",
    "fake-quantize-trainable-scale",
    "fake-quantize-into-integer-product",
}
#: Node cases no engine checks: opset 8's Scan declares shapes its test data do not have.
_HARNESS_ERRORS = {"test_scan_sum"}


@pytest.fixture(scope="module")
def suite():
    return _coverage.node_cases()


@pytest.fixture(scope="module")
def probes(suite):
    return [probe(limit.probe, suite) for limit in limits.LIMITS]


def test_every_entry_is_still_true_on_the_installed_runtime(probes):
    with limits.unguarded():
        results = _coverage.run_isolated(probes, quiet=True, backend="training-agent")
    stale = []
    for limit, result in zip(limits.LIMITS, results):
        if limit.kind == limits.WRONG:
            true = result.status == _coverage.WRONG
        elif limit.kind == limits.CRASH:
            true = "process died" in result.detail
        else:
            true = result.status in (_coverage.ERROR, _coverage.REFUSED)
        if not true:
            stale.append(f"{limit.key} ({limit.kind}): {result.status} {result.detail[:200]}")
    assert not stale, "entries no longer true here; remove them:\n" + "\n".join(stale)


def test_training_agent_rewrites_or_refuses_each_entry_by_name(probes):
    results = _coverage.run_isolated(probes, quiet=True, backend="training-agent")
    for limit, result in zip(limits.LIMITS, results):
        if limit.rewritten and limit.key in _STRAIGHT_THROUGH:  # values: tests below
            assert result.status == _coverage.WRONG, (limit.key, result.detail)
            assert "finite differences 0" in result.detail, result.detail
            continue
        if limit.rewritten or limit.key == "concat-float64":  # trains in float32
            assert result.status == _coverage.CORRECT, (limit.key, result.detail)
            continue
        assert result.status == _coverage.REFUSED, (limit.key, result.detail)
        assert "op type" in result.detail and "node '" in result.detail, result.detail
        assert 'backend="onnxruntime"' in result.detail, result.detail
        assert ".cc:" not in result.detail and "lambda" not in result.detail, result.detail


def test_auto_trains_each_entry_or_both_engines_refuse_it(probes):
    results = _coverage.run_isolated(probes, quiet=True, backend="auto")
    for limit, result in zip(limits.LIMITS, results):
        if limit.key in _STRAIGHT_THROUGH:
            assert result.status != _coverage.REFUSED, (limit.key, result.detail)
            continue
        want = _coverage.REFUSED if limit.key in _NEITHER else _coverage.CORRECT
        assert result.status == want, (limit.key, result.detail)


def _gradients(case, backend):
    layer = OnnxModule(case.model, trainable=[], backend=backend)
    args = [torch.from_numpy(v.copy()).requires_grad_() for v in case.inputs]
    layer(*args).sum().backward()
    return [a.grad for a in args]


def test_a_zero_point_held_as_raw_bytes_trains_as_on_the_onnxruntime_engine():
    """The builder's QDQ fusion fails on a zero point in ``raw_data`` (what
    ``numpy_helper`` writes); rewritten into the typed field, the agent's
    straight-through gradients equal the onnxruntime engine's."""
    case = probe("raw_zero_point_fake_quantization")
    with limits.unguarded(), pytest.raises(NotDifferentiableError, match="corrupted protobuf"):
        _gradients(case, "training-agent")
    agent = _gradients(case, "training-agent")
    engine = _gradients(case, "onnxruntime")
    assert all(g is not None and g.abs().max() > 0 for g in agent)
    for mine, theirs in zip(agent, engine):
        torch.testing.assert_close(mine, theirs)


def test_a_trainable_scale_gets_no_gradient_from_the_builder():
    """The builder's FakeQuant passes the weight's gradient but gives the
    scale none (silently: a scale asked for stays as it is); the table
    refuses it by name before the builder sees it."""
    case = probe("trainable_scale_fake_quantization")
    with limits.unguarded():
        x, w, scale = _gradients(case, "training-agent")
    engine = _gradients(case, "onnxruntime")
    torch.testing.assert_close(w, engine[1])
    assert scale is None or not scale.any(), scale
    assert engine[2].abs() > 0
    with pytest.raises(NotDifferentiableError, match="with a trainable scale"):
        _gradients(case, "training-agent")


def test_refusal_comes_before_the_builder_and_names_the_node(monkeypatch):
    from ortbridge._engines.training_agent import _engine as _training_agent

    def builder_called(*args, **kwargs):
        raise AssertionError("the builder was handed a graph of the table")

    monkeypatch.setattr(_training_agent, "_capi", builder_called)
    case = probe("loop_of_weight")
    layer = OnnxModule(case.model, trainable=[], backend="training-agent")
    x, w = (torch.from_numpy(v).requires_grad_() for v in case.inputs)
    with pytest.raises(NotDifferentiableError) as caught:
        layer(x, w)
    assert caught.value.node == "Loop_y" and caught.value.op_type == "Loop"
    assert "the training-agent engine cannot train node 'Loop_y' (op type Loop)" in str(
        caught.value
    )


def test_node_suite_on_the_training_agent_is_never_wrong(suite):
    results = _coverage.run_isolated(suite, quiet=True, backend="training-agent")
    counts = _coverage.summary(results)["cases"]
    wrong = [f"{r.name}: {r.detail}" for r in results if r.status == _coverage.WRONG]
    assert not wrong, "silently wrong gradients:\n" + "\n".join(wrong)
    errors = [
        f"{r.name}: {r.detail[:300]}"
        for r in results
        if r.status == _coverage.ERROR and r.name not in _HARNESS_ERRORS
    ]
    assert not errors, "failures that are not refusals by name:\n" + "\n".join(errors)
    assert counts[_coverage.CORRECT] >= 250, counts


@pytest.mark.parametrize("op_types", [sorted({op for lim in limits.LIMITS for op in lim.op_types})])
def test_node_cases_of_the_table_under_auto_are_never_wrong(suite, op_types):
    cases = [c for c in suite if c.op_key in set(op_types)]
    results = _coverage.run_isolated(cases, quiet=True, backend="auto")
    wrong = [f"{r.name}: {r.detail}" for r in results if r.status == _coverage.WRONG]
    assert not wrong, "silently wrong gradients:\n" + "\n".join(wrong)
    died = [r.name for r in results if "process died" in r.detail]
    assert not died, died


def test_an_entry_for_every_configuration_names_none():
    from onnx import helper

    node = helper.make_node("ConvTranspose", ["x", "w"], ["y"], name="up")
    limit = next(lim for lim in limits.LIMITS if lim.key == "conv-transpose")
    text = limits.describe(node, limit)
    assert text.startswith("node 'up' (op type ConvTranspose): onnxruntime-training"), text
