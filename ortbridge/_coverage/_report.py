"""The results per op type: counts, a status, the reStructuredText table, the environment."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

import onnx

from ._cases import (
    CLASSES,
    CORRECT,
    ERROR,
    NO_GRADIENT,
    REFUSED,
    SKIPPED,
    WRONG,
    CaseResult,
)

#: Op-type statuses of :func:`by_op_type`, best first.
TRAINS = "trains"
ZERO_GRADIENT = "zero-gradient"
PARTIAL = "partial"
STATUSES = (TRAINS, ZERO_GRADIENT, PARTIAL, WRONG, REFUSED, ERROR, NO_GRADIENT, SKIPPED)


def by_op_type(results: Iterable[CaseResult]) -> dict[str, dict]:
    """Counts per op type over the cases that test the op itself (not expanded functions).

    ``status``: ``trains`` when every case with a gradient path is correct
    (at least one, with a non-zero derivative somewhere; ``zero-gradient``
    when all are correct but the outputs never depend on the inputs where
    checked); ``wrong`` when any case is wrong; ``partial`` when some
    are correct and others refused or failing; else the class all its
    checked cases share (``refused``, ``error``), or ``no-gradient-path`` /
    ``skipped`` when no case could be checked. The ``expanded_*`` counts are
    the function-expanded variants, reported beside it.
    """
    table: dict[str, dict] = {}
    for r in results:
        row = table.setdefault(
            r.op_type,
            {"cases": 0, **{c: 0 for c in CLASSES}, "expanded_cases": 0, "expanded_correct": 0},
        )
        row.setdefault("grad_max", 0.0)
        if r.expanded:
            row["expanded_cases"] += 1
            row["expanded_correct"] += r.status == CORRECT
            row.setdefault("expanded_wrong", 0)
            row["expanded_wrong"] += r.status == WRONG
            continue
        row["cases"] += 1
        row[r.status] += 1
        if r.status == CORRECT and r.grad_max:
            row["grad_max"] = max(row["grad_max"], r.grad_max)
    for row in table.values():
        checked = row[CORRECT] + row[WRONG] + row[REFUSED] + row[ERROR]
        if row[WRONG]:
            status = WRONG
        elif checked and row[CORRECT] == checked:
            status = TRAINS if row["grad_max"] > 0 else ZERO_GRADIENT
        elif row[CORRECT]:
            status = PARTIAL
        elif row[REFUSED]:
            status = REFUSED
        elif row[ERROR]:
            status = ERROR
        elif row[NO_GRADIENT]:
            status = NO_GRADIENT
        else:
            status = SKIPPED
        row["status"] = status
        row.setdefault("expanded_wrong", 0)
    return dict(sorted(table.items()))


def summary(results: Sequence[CaseResult]) -> dict:
    """Case counts by class (direct and expanded cases) and op-type counts by status."""
    ops = by_op_type(results)
    direct = [r for r in results if not r.expanded]
    expanded = [r for r in results if r.expanded]
    return {
        "cases": {c: sum(r.status == c for r in direct) for c in CLASSES},
        "expanded_cases": {c: sum(r.status == c for r in expanded) for c in CLASSES},
        "op_types": {s: sum(row["status"] == s for row in ops.values()) for s in STATUSES},
        "op_types_trained": sorted(k for k, row in ops.items() if row["status"] == TRAINS),
    }


def rst_table(results: Sequence[CaseResult]) -> str:
    """The per-op-type table in reStructuredText (a simple table)."""
    ops = by_op_type(results)
    header = ["op type", "cases", "correct", "wrong", "refused", "error", "n/a", "status",
              "expanded"]  # fmt: skip
    rows = []
    for op, row in ops.items():
        expanded = (
            f"{row['expanded_correct']}/{row['expanded_cases']}" if row["expanded_cases"] else ""
        )
        if row["expanded_wrong"]:
            expanded += f" ({row['expanded_wrong']} wrong)"
        rows.append(
            [
                op,
                row["cases"],
                row[CORRECT],
                row[WRONG],
                row[REFUSED],
                row[ERROR],
                row[NO_GRADIENT] + row[SKIPPED],
                row["status"],
                expanded,
            ]
        )
    cells = [header] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[k]) for r in cells) for k in range(len(header))]
    rule = "  ".join("=" * w for w in widths)
    lines = [rule, "  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip(), rule]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells[1:]]
    lines.append(rule)
    return "\n".join(lines) + "\n"


def environment() -> dict:
    """Versions and machine the results were measured with."""
    import platform

    import onnxruntime
    import torch

    try:
        import onnx_ad

        ad_version = onnx_ad.__version__
    except ImportError:
        ad_version = None
    return {
        "machine": platform.machine(),
        "processor": platform.processor(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "onnx": onnx.__version__,
        "onnxruntime": onnxruntime.__version__,
        "onnx_ad": ad_version,
    }
