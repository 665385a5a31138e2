"""The runtime axis of the training benchmarks: the training build and maintained onnxruntime.

onnxruntime-training 1.19.2 and maintained onnxruntime provide the same
``onnxruntime`` module, so they cannot share a virtual environment. A
benchmark measures its part in the environment it runs in and runs itself
again with the other environment's python (``--other-python``, else the
``ORTBRIDGE_OTHER_PYTHON`` environment variable, else the sibling of this
environment: ``.venv`` and ``.venv-ort`` side by side), then prints both
parts side by side.

The two environments cannot run at the same time (they would share the
cores), so the machine's load may drift between their parts. The repeats are
split in ``--alternations`` shares measured in the order here, there, there,
here, ...: a drift then weighs on both sides alike. Figures are medians over
all shares.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

#: The environments' directory names, as the README's setup makes them.
SIBLINGS = (".venv", ".venv-ort")


def add_arguments(parser) -> None:
    parser.add_argument(
        "--other-python",
        default=os.environ.get("ORTBRIDGE_OTHER_PYTHON"),
        help="python of the other onnxruntime's environment (default: $ORTBRIDGE_OTHER_PYTHON, "
        "else the sibling .venv / .venv-ort of this one)",
    )
    parser.add_argument(
        "--no-other-runtime", action="store_true", help="measure this environment only"
    )
    parser.add_argument(
        "--alternations",
        type=int,
        default=2,
        help="shares of the repeats, alternating between the environments (default 2)",
    )
    # Set on the other environment's runs after the first: what is measured once is not.
    parser.add_argument("--later-share", action="store_true", help=argparse.SUPPRESS)


def runtime() -> dict:
    """Which onnxruntime this process runs."""
    import onnxruntime

    training = hasattr(onnxruntime.capi._pybind_state, "TrainingAgent")
    return {
        "kind": "training build" if training else "maintained",
        "onnxruntime": onnxruntime.__version__,
        "training_build": training,
    }


def other_python(args) -> str | None:
    """The other environment's python, or None when there is none to run."""
    if args.no_other_runtime:
        return None
    if args.other_python:
        return args.other_python
    here = Path(sys.prefix)
    for name in SIBLINGS:
        candidate = here.parent / name / "bin" / "python"
        if name != here.name and here.name in SIBLINGS and candidate.exists():
            return str(candidate)
    return None


def main(script: str, argv, parse_args, measure, summarize, report, settings, count) -> dict:
    """A benchmark's run: its part here and in the other environment, printed, saved.

    ``measure(args)`` returns this environment's part for ``args.<count>``
    repeats (a dict with ``runtime()`` under ``"runtime"`` and its raw
    timings, lists in the dicts under ``"raw"``; what it measures once only,
    it skips when ``args.later_share``); ``summarize(args, part)`` adds the
    figures computed from the raw timings; ``report(args, parts)`` prints the
    parts; ``settings(args)`` is what the saved JSON records of the options.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    total = getattr(args, count)
    python = other_python(args)
    n = max(1, min(args.alternations, total)) if python else 1
    shares = [total // n + (k < total % n) for k in range(n)]
    here, there, error = [], [], None
    for k, share in enumerate(shares):
        order = ("here", "there") if k % 2 == 0 else ("there", "here")
        for side in order:
            if side == "here":
                setattr(args, count, share)
                args.later_share = k > 0
                here.append(measure(args))
            elif python is not None and error is None:
                extra = [f"--{count}", str(share)] + (["--later-share"] if k else [])
                other = run_other(script, forwarded(argv) + extra, python)
                error = other.get("error")
                there += other.get("parts", [])
    setattr(args, count, total)
    parts = [summarize(args, _merged(side)) for side in (here, there) if side]
    parts.sort(key=lambda p: not p["runtime"]["training_build"])  # the training build first
    report(args, parts)
    if error:
        print(f"the other environment's part failed:\n{error}")
    result = {
        **settings(args),
        "alternations": n,
        "parts": parts,
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            "python": sys.version.split()[0],
            "load_average": os.getloadavg(),
        },
    }
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    return result


def _merged(shares: list[dict]) -> dict:
    """One part of several shares: the first's fields, every share's raw timings."""
    part = dict(shares[0])
    raw: dict = {}
    for share in shares:
        for kind, lists in share["raw"].items():
            for way, values in lists.items():
                raw.setdefault(kind, {}).setdefault(way, []).extend(values)
    part["raw"] = raw
    return part


def run_other(script: str, argv: list[str], python: str) -> dict:
    """``script``'s part measured by the other environment's ``python``.

    The part is the JSON ``script`` writes with ``--output``; a failure comes
    back as ``{"error": ...}`` so that this environment's part is still shown.
    """
    with tempfile.TemporaryDirectory() as tmp:
        output = os.path.join(tmp, "part.json")
        command = [python, script, *argv, "--no-other-runtime", "--output", output]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            return {"error": (done.stderr or done.stdout)[-2000:]}
        with open(output, encoding="utf-8") as f:
            return json.load(f)


def forwarded(argv: list[str]) -> list[str]:
    """``argv`` without the options this module and ``--output`` handle."""
    dropped = {"--other-python": 1, "--output": 1, "--no-other-runtime": 0, "--alternations": 1}
    kept, skip = [], 0
    for arg in argv:
        if skip:
            skip -= 1
            continue
        name = arg.split("=", 1)[0]
        if name in dropped:
            skip = dropped[name] if "=" not in arg else 0
            continue
        kept.append(arg)
    return kept


def label(part: dict) -> str:
    """A column title: the runtime of a part."""
    rt = part["runtime"]
    return f"{rt['kind']} {rt['onnxruntime']}"
