"""``ortbridge.gradcheck``: a module's gradients against finite differences of onnxruntime.

The reference is the graph itself, run by onnxruntime inference (never the
engine under test): central finite differences of ``sum(cotangent * outputs)``
for a random cotangent, in float64 where the graph converts (its outputs must
agree with the float32 graph and move linearly under a tiny nudge), float32
otherwise with a larger step. The machinery is the op-coverage harness's
(:mod:`._coverage`), which checks ONNX's node test suite the same way.
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import TYPE_CHECKING

import numpy as np
import torch

from . import _prepare
from .exceptions import OnnxInputError, OnnxTypeError

if TYPE_CHECKING:
    from .module import OnnxModule


@dataclasses.dataclass
class GradcheckEntry:
    """How one input's or weight's gradient compares with finite differences."""

    name: str
    #: ``"input"`` or ``"weight"``.
    kind: str
    #: Elements checked (a sample of at most ``samples``).
    checked: int
    max_abs_error: float
    #: Relative to the finite difference (floored at ``atol``).
    max_rel_error: float
    passed: bool
    #: The first disagreement, in words (None when passed).
    detail: str | None = None


@dataclasses.dataclass
class GradcheckReport:
    """Per input and per weight: errors against finite differences, and a verdict.

    True in a boolean context when every gradient agrees.
    """

    entries: list[GradcheckEntry]
    #: ``"float64"`` or ``"float32"``: the precision of the reference.
    dtype: str
    engine: str
    eps: float
    atol: float
    rtol: float

    @property
    def passed(self) -> bool:
        return all(e.passed for e in self.entries)

    def __bool__(self) -> bool:
        return self.passed

    def __str__(self) -> str:
        width = max([len(e.name) for e in self.entries] + [4])
        lines = [
            f"gradcheck ({self.engine} engine, {self.dtype} finite differences, step {self.eps:g},"
            f" atol {self.atol:g}, rtol {self.rtol:g}): " + ("passed" if self.passed else "FAILED"),
            f"  {'name':{width}s}  kind    checked  max abs err  max rel err  result",
        ]
        for e in self.entries:
            lines.append(
                f"  {e.name:{width}s}  {e.kind:6s}  {e.checked:7d}  {e.max_abs_error:11.3g}  "
                f"{e.max_rel_error:11.3g}  {'ok' if e.passed else 'FAIL'}"
            )
            if e.detail:
                lines.append(f"    {e.detail}")
        return "\n".join(lines)


def gradcheck(
    module: OnnxModule,
    *inputs: torch.Tensor,
    eps: float | None = None,
    atol: float | None = None,
    rtol: float | None = None,
    samples: int = 16,
    seed: int = 0,
) -> GradcheckReport:
    """Compare ``module``'s gradients with central finite differences of onnxruntime inference.

    Parameters
    ----------
    module : OnnxModule
        Checked in its current mode (``train()`` or ``eval()``); a Dropout
        drawing masks in train mode makes the graph random: call ``eval()``.
        Its weights, buffers and gradients are left as they were.
    *inputs : torch.Tensor
        The graph's inputs; float ones are checked.
    eps : float, optional
        Finite-difference step, relative to each element (default 1e-6 in
        float64, 1e-3 in float32).
    atol, rtol : float, optional
        Tolerances (default 1e-6 / 1e-4 in float64, 5e-4 / 1e-2 in float32),
        widened by the rounding noise of the outputs.
    samples : int
        Elements checked per input and per weight (chosen at random).
    seed : int
        Seeds the cotangent and the elements sampled.

    Returns
    -------
    GradcheckReport
        One entry per float input and trainable weight; ``bool(report)`` is
        True when all pass, ``print(report)`` shows the table.
    """
    from ._coverage import _compare, _float64, _reference
    from .module import OnnxModule

    if not isinstance(module, OnnxModule):
        raise OnnxTypeError(f"gradcheck takes an OnnxModule, got {type(module).__name__}")
    bridge = module._bridge
    mode = _prepare.TRAIN if module.training else _prepare.EVAL
    n_in = len(bridge.input_names)
    if len(inputs) != n_in:
        raise OnnxInputError(
            f"gradcheck: the graph takes {n_in} input(s) {bridge.input_names}, got {len(inputs)}"
        )
    weights = module._weights()
    tensors = [torch.as_tensor(t) for t in inputs] + list(weights)
    model, _ = bridge._variant(mode, for_gradient=False, tensors=tensors)
    if mode == _prepare.TRAIN and any(n.op_type == "Dropout" for n in model.graph.node):
        raise OnnxInputError(
            "gradcheck needs a deterministic graph, and a Dropout in train mode draws a new "
            "mask at every run: call module.eval() first"
        )
    n_user = len(module.output_names)
    del model.graph.output[n_user:]  # train mode's running statistics are not checked
    checked = [
        i for i, t in enumerate(tensors) if t.is_floating_point() and (i < n_in or t.requires_grad)
    ]
    if not checked:
        raise OnnxInputError("gradcheck: no float input and no trainable weight to check")
    names = bridge.feed_names
    # Copies: onnxruntime's training-mode BatchNormalization writes the new
    # running statistics over its inputs' memory.
    values32 = [t.detach().cpu().numpy().copy() for t in tensors]
    rng = np.random.default_rng(seed)
    session32 = _reference._reference_session(model)
    outputs32 = session32.run(None, dict(zip(names, values32)))
    dtype, session, values = "float32", session32, values32
    if not any(v.dtype == np.float16 for v in values32):
        converted = _float64._as_float64(model, names, values32, outputs32, rng)
        if converted is not None:
            _, session, values = converted
            dtype = "float64"
    default = _compare._TOLERANCES[dtype]
    tol = _compare._Tolerance(
        rtol=default.rtol if rtol is None else rtol,
        atol=default.atol if atol is None else atol,
        step=default.step if eps is None else eps,
        eps=default.eps,
    )
    seeded = [i for i, o in enumerate(outputs32) if np.asarray(o).dtype.kind == "f"]
    # Infinite or saturated outputs have no derivative: no cotangent there.
    cotangents = [
        np.where(_compare._regular(outputs32[i]), rng.standard_normal(np.shape(outputs32[i])), 0.0)
        for i in seeded
    ]
    grads = _module_gradients(module, tensors, checked, seeded, cotangents, outputs32)
    reference = session.run(None, dict(zip(names, values)))
    entries = []
    for i in checked:
        picks = [np.zeros(0, dtype=np.int64)] * len(values)
        picker = np.random.default_rng(zlib.crc32(names[i].encode()) + seed)
        picks[i] = _compare._pick(values[i].size, samples, picker)
        check = _compare._finite_differences(
            session, names, values, seeded, cotangents, reference, picks, grads, tol
        )
        entries.append(
            GradcheckEntry(
                names[i],
                "input" if i < n_in else "weight",
                check.checked,
                check.abs_error,
                check.rel_error,
                check.failure is None,
                check.failure,
            )
        )
    return GradcheckReport(entries, dtype, module.backend, tol.step, tol.atol, tol.rtol)


def _module_gradients(module, tensors, checked, seeded, cotangents, outputs32):
    """The module's gradients of ``sum(cotangent * outputs)``, state left untouched."""
    buffers = {k: b.detach().clone() for k, b in module.named_buffers()}
    try:
        leaves = [
            t.detach().clone().requires_grad_(i in checked) if i < len(module.input_names) else t
            for i, t in enumerate(tensors)
        ]
        out = module(*leaves[: len(module.input_names)])
        out = list(out) if isinstance(out, tuple) else [out]
        pairs = [(out[i], c) for i, c in zip(seeded, cotangents) if out[i].requires_grad]
        wanted = [leaves[i] for i in checked]
        grads = [None] * len(wanted)
        if pairs:
            grads = torch.autograd.grad(
                [o for o, _ in pairs],
                wanted,
                [torch.as_tensor(c, dtype=o.dtype, device=o.device) for o, c in pairs],
                allow_unused=True,
            )
    finally:
        with torch.no_grad():
            for k, b in module.named_buffers():
                b.copy_(buffers[k])
    full = [np.zeros(np.shape(t)) for t in tensors]
    for i, g in zip(checked, grads):
        if g is not None:
            full[i] = g.detach().cpu().double().numpy()
    return full
