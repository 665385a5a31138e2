"""Which ONNX operators the onnxruntime engine trains: ONNX's node test suite, gradients checked.

Every case of ``onnx.backend.test.case.node`` (each op's own cases, and the
variants with a function op expanded into its body), and a case of each
com.microsoft fused node onnxruntime's transformer optimizer writes
(:mod:`ortbridge._coverage._contrib`, rows ``com.microsoft.<op>``), goes through
``OnnxModule(..., backend="onnxruntime")``: float inputs require grad, the
rest become initializers; outputs are compared with onnxruntime inference of
the same graph, input gradients for a random cotangent with central finite
differences of that inference (float64 where onnxruntime runs the case in
float64), on up to ``--samples`` elements of each input
(:mod:`ortbridge._coverage` has the details and the classes a case ends in).

Hypothesis: the engine trains at least 105 op types with every case
correct, and no case is silently wrong; what it cannot differentiate it
refuses by name. Cases run in forked worker processes, so a case that
kills onnxruntime costs that case only.

Writes ``results/op_coverage.json`` (machine, versions, summary, per op
type, per case) and ``results/op_coverage.rst`` (the per-op-type table).

    python benchmarks/op_coverage.py                   # the whole suite
    python benchmarks/op_coverage.py --ops Conv,Resize --no-write
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ortbridge import _coverage  # noqa: E402
from ortbridge._coverage._contrib import contrib_cases  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", help="comma-separated op types (default: all)")
    parser.add_argument(
        "--no-expanded", action="store_true", help="skip the function-expanded variants"
    )
    parser.add_argument(
        "--no-contrib", action="store_true", help="skip onnxruntime's com.microsoft fused nodes"
    )
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument(
        "--samples", type=int, default=16, help="input elements checked per input (default 16)"
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per case")
    parser.add_argument("--every", type=int, default=50, help="a progress line every N cases")
    parser.add_argument("--out", default=os.path.join(HERE, "results"), help="results folder")
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument(
        "--backend",
        default="onnxruntime",
        choices=["onnxruntime", "training-agent", "auto"],
        help="the engine checked (default onnxruntime; results/op_coverage_<engine>.* "
        "for the others)",
    )
    args = parser.parse_args(argv)

    start = time.perf_counter()
    ops = args.ops.split(",") if args.ops else None
    cases = _coverage.node_cases(ops, expanded=not args.no_expanded)
    if not args.no_contrib:
        cases += contrib_cases(ops)
    collected = time.perf_counter() - start
    print(f"{len(cases)} cases collected in {collected:.1f} s; {args.workers} worker(s)")

    def progress(done, total, result):
        if done % args.every == 0 or done == total:
            elapsed = time.perf_counter() - start
            print(f"  {done}/{total} cases, {elapsed:.0f} s (last: {result.name}: {result.status})")
        if result.status == _coverage.WRONG:
            print(f"  WRONG {result.name}: {result.detail}")

    results = _coverage.run_isolated(
        cases,
        workers=args.workers,
        samples=args.samples,
        timeout=args.timeout,
        quiet=True,
        progress=progress,
        backend=args.backend,
    )
    elapsed = time.perf_counter() - start
    summary = _coverage.summary(results)
    _print_summary(summary, results, elapsed)
    if args.no_write:
        return 0
    info = _coverage.environment()
    info.update(
        workers=args.workers,
        samples=args.samples,
        seconds=round(elapsed, 1),
        collect_seconds=round(collected, 1),
        expanded=not args.no_expanded,
        ops=ops,
        backend=args.backend,
    )
    os.makedirs(args.out, exist_ok=True)
    payload = {
        "info": info,
        "summary": summary,
        "op_types": _coverage.by_op_type(results),
        "cases": [r.as_dict() for r in results],
    }
    stem = "op_coverage" + (
        "" if args.backend == "onnxruntime" else "_" + args.backend.replace("-", "_")
    )
    json_path = os.path.join(args.out, stem + ".json")
    with open(json_path, "w") as f:
        f.write(_json(payload))
    rst_path = os.path.join(args.out, stem + ".rst")
    with open(rst_path, "w") as f:
        f.write(_rst_header(summary, info))
        f.write(_coverage.rst_table(results))
    print(f"wrote {json_path} and {rst_path}")
    return 0


def _json(payload: dict) -> str:
    """``payload`` as JSON, one case a line (a regenerated table diffs line by line)."""
    head = json.dumps({k: v for k, v in payload.items() if k != "cases"}, indent=1)
    cases = ",\n".join("  " + json.dumps(case) for case in payload["cases"])
    return f'{head[:-2]},\n "cases": [\n{cases}\n ]\n}}\n'


def _print_summary(summary, results, elapsed) -> None:
    cases = summary["cases"]
    expanded = summary["expanded_cases"]
    ops = summary["op_types"]
    print(f"done in {elapsed:.0f} s")
    print("cases:          " + ", ".join(f"{k} {v}" for k, v in cases.items()))
    print("expanded cases: " + ", ".join(f"{k} {v}" for k, v in expanded.items()))
    print("op types:       " + ", ".join(f"{k} {v}" for k, v in ops.items()))
    print(f"op types fully correct: {ops[_coverage.TRAINS]}")
    wrong = [r for r in results if r.status == _coverage.WRONG]
    for r in wrong:
        print(f"WRONG {r.name}: {r.detail}")


def _rst_header(summary, info) -> str:
    cases, ops = summary["cases"], summary["op_types"]
    expanded = summary["expanded_cases"]
    return (
        ".. Generated by benchmarks/op_coverage.py: do not edit by hand.\n\n"
        f"onnx {info['onnx']}, onnxruntime {info['onnxruntime']}, onnx-ad {info['onnx_ad']}, "
        f"torch {info['torch']}; {info['cores']} cores, {info['seconds']} s.\n\n"
        f"Cases: {cases['correct']} correct, {cases['wrong']} wrong, {cases['refused']} refused, "
        f"{cases['error']} error, {cases['no-gradient-path']} without a gradient path, "
        f"{cases['skipped']} skipped. Function-expanded variants: {expanded['correct']} correct, "
        f"{expanded['wrong']} wrong of {sum(expanded.values())}. "
        f"Op types: {ops['trains']} train (every case correct), {ops['zero-gradient']} correct "
        f"with zero derivatives only, {ops['partial']} partly, {ops['wrong']} with a wrong case, "
        f"{ops['refused']} refused, {ops['error']} failing.\n\n"
        "``n/a``: cases without a float input or output, or that onnxruntime does not run; "
        "``expanded``: correct / cases of the function-expanded variants.\n\n"
    )


if __name__ == "__main__":
    sys.exit(main())
