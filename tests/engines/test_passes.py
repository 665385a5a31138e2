"""The onnxruntime engine's optimiser: one contract, one ordered list of passes."""

from __future__ import annotations

import pytest

from ortbridge._engines.onnxruntime import passes
from ortbridge._engines.onnxruntime.passes import _pipeline


def _recording(monkeypatch, fail=None):
    calls = []

    def make(one):
        def call(graphs):
            calls.append(one.name)
            if one.name == fail:
                raise ValueError("broken")

        return passes.Pass(one.name, one.stage, one.static, call)

    monkeypatch.setattr(_pipeline, "PASSES", tuple(make(one) for one in passes.PASSES))
    return calls


def test_a_stage_runs_its_passes_in_the_lists_order(monkeypatch):
    calls = _recording(monkeypatch)
    for stage in (passes.PRIMAL, passes.REVERSE, passes.BACKWARD):
        passes.run(stage, passes.Graphs(), static=True)
    assert calls == [one.name for one in passes.PASSES]


def test_shape_generic_graphs_get_only_the_passes_that_need_no_static_shapes(monkeypatch):
    calls = _recording(monkeypatch)
    for stage in (passes.PRIMAL, passes.REVERSE, passes.BACKWARD):
        passes.run(stage, passes.Graphs(), static=False)
    assert calls == [one.name for one in passes.PASSES if not one.static]
    assert calls  # folding and the fused activations run on every graph


def test_an_error_names_the_pass_it_came_from(monkeypatch):
    name = next(one.name for one in passes.PASSES if one.stage == passes.BACKWARD)
    _recording(monkeypatch, fail=name)
    with pytest.raises(ValueError, match="broken") as info:
        passes.run(passes.BACKWARD, passes.Graphs(), static=True)
    assert f"optimiser pass {name!r}" in "".join(info.value.__notes__)


def test_every_pass_has_a_known_stage_and_a_unique_name():
    names = [one.name for one in passes.PASSES]
    assert len(set(names)) == len(names)
    assert {one.stage for one in passes.PASSES} <= {passes.PRIMAL, passes.REVERSE, passes.BACKWARD}
    # The view collapsing runs after every pass that leaves views behind.
    backward = [one.name for one in passes.PASSES if one.stage == passes.BACKWARD]
    assert backward.index("views collapsed") > backward.index("Scan outputs without copies")
