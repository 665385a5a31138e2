"""Op coverage of the onnxruntime engine: ONNX's node test cases, checked by finite differences.

Each case of ``onnx.backend.test.case.node`` (one node, or its function
expanded into several) becomes an :class:`~ortbridge.OnnxModule` with
``backend="onnxruntime"``: its float32/float64 graph inputs are inputs that
require grad, everything else (axes, pads, indices, shapes, masks, and the
float operands listed in :data:`FROZEN_OPERANDS`) an initializer, as an
exported model has them. The case is converted to float64 where onnxruntime
runs it that way (float32 otherwise, with looser tolerances). The module's
outputs are compared with onnxruntime inference of the same graph, and its
input gradients for a random cotangent with central finite differences of
that inference, on a fixed random subset of each input's elements.

Each case ends in one class:

``correct``
    outputs and every checked gradient element agree.
``wrong``
    an output or a gradient disagrees (see below for kinks): the engine is
    silently wrong there, the worst outcome.
``refused``
    the engine says it cannot differentiate a node
    (:class:`~ortbridge.exceptions.NotDifferentiableError`, naming it).
``no-gradient-path``
    nothing to differentiate: no float32/float64 input, or no float32/float64
    output.
``error``
    any other failure (onnxruntime's own errors, a crash of the process).
``skipped``
    the case cannot be checked here: onnxruntime does not run it at all
    (opset too new, kernel missing), its outputs are random, or it takes
    sequences or optionals, which an ``OnnxModule`` does not.

Finite differences: central, step 1e-6 (float64) or 1e-3 (float32) relative
to the element, with a tolerance that adds the rounding noise of the outputs
that moved. Points of non-differentiability (ReLU or Abs at 0, ties of Max,
Floor at an integer) are handled by accepting any value between the one-sided
derivatives where these differ. A disagreement where the function is not
differentiable (a kink, or a jump: a quarter of the step changes the
difference quotient) is checked again at inputs moved by 1-2%, and the case
is correct, with a note, only if everything agrees there; a disagreement
where the function is differentiable (a NaN gradient where the derivative is
0, say) is wrong at once. Output elements that are infinite or saturated (a
masked attention score) get a zero cotangent.

Two adaptations keep the reference honest. float64: the converted model
must give the float32 outputs, and each input, nudged by 1e-9, must move the
outputs linearly (onnxruntime computes some float64 kernels in float32, such
as GroupNormalization's); otherwise the case runs in float32. Versions: an IR
version newer than onnxruntime reads is lowered, and an opset newer than it
reads is converted down by onnx's version converter (noted on the case;
skipped where the converter refuses). Graphs asking for training behaviour
(a Dropout with ``training_mode`` true, a training BatchNormalization) run
the module in train mode, the others in eval mode.

:func:`run_case` checks one case in-process; :func:`run_isolated` runs many
in forked worker processes, so a case that kills its process (onnxruntime
can) costs that case only. ``benchmarks/op_coverage.py`` runs the whole suite
and writes the table; ``tests/test_op_coverage.py`` checks a subset.

One concern a module: :mod:`._cases` (collecting and preparing the cases,
the classes), :mod:`._reference` (onnxruntime inference, the reference),
:mod:`._float64` (a case in float64), :mod:`._compare` (outputs and finite
differences), :mod:`._check` (:func:`run_case`), :mod:`._workers`
(:func:`run_isolated`) and :mod:`._report` (per op type, the table).
"""

from ._cases import (
    CLASSES,
    CORRECT,
    ERROR,
    FROZEN_OPERANDS,
    NO_GRADIENT,
    REFUSED,
    SKIPPED,
    WRONG,
    CaseResult,
    NodeCase,
    node_cases,
)
from ._check import run_case
from ._report import (
    PARTIAL,
    STATUSES,
    TRAINS,
    ZERO_GRADIENT,
    by_op_type,
    environment,
    rst_table,
    summary,
)
from ._workers import run_isolated

__all__ = [
    "CLASSES",
    "CORRECT",
    "ERROR",
    "FROZEN_OPERANDS",
    "NO_GRADIENT",
    "PARTIAL",
    "REFUSED",
    "SKIPPED",
    "STATUSES",
    "TRAINS",
    "WRONG",
    "ZERO_GRADIENT",
    "CaseResult",
    "NodeCase",
    "by_op_type",
    "environment",
    "node_cases",
    "rst_table",
    "run_case",
    "run_isolated",
    "summary",
]
