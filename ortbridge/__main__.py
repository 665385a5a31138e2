"""Command line of ortbridge.

``python -m ortbridge demo`` trains a torch model with an ONNX layer inside on
scikit-learn's digits; ``python -m ortbridge inspect MODEL.onnx`` says what
``OnnxModule`` makes of a model.
"""

from __future__ import annotations

import argparse
import json
import re
import sys

from . import __version__


def _plain(text: str) -> str:
    """Docstring text for a terminal: rST's ``literal`` markup dropped."""
    return re.sub(r"``(.+?)``", r"\1", text, flags=re.DOTALL)


def main(argv: list[str] | None = None) -> int:
    """Run the command line on ``argv`` (default: ``sys.argv[1:]``); the exit status."""
    parser = argparse.ArgumentParser(prog="python -m ortbridge", description=_plain(__doc__))
    parser.add_argument("--version", action="version", version=f"ortbridge {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="train a torch model with an ONNX layer on digits",
        description="Train a torch model whose last layer is an ONNX graph on scikit-learn's "
        "digits, write the trained ONNX file and check onnxruntime inference of it.",
    )
    demo.add_argument("--epochs", type=int, default=15)
    demo.add_argument("--output", default="ortbridge_demo.onnx", help="trained ONNX file")
    demo.add_argument("--seed", type=int, default=0)
    inspect = sub.add_parser(
        "inspect",
        help="what OnnxModule makes of an ONNX model",
        description="Print a model's graph (op types, inputs, outputs), the rewrites "
        "ortbridge applies to it, its float initializers (trainable or frozen), the engine "
        "and providers that would run it, and whether a gradient graph can be built. Exit "
        "status: 0 if it trains, 1 if not, 2 if the model cannot be loaded.",
    )
    inspect.add_argument("model", help="path of an .onnx file")
    inspect.add_argument(
        "--backend",
        default="auto",
        choices=["auto", "training-agent", "onnxruntime"],
        help="the engine to try (default: auto, as OnnxModule)",
    )
    inspect.add_argument(
        "--check",
        action="store_true",
        help="compare the gradients with finite differences of onnxruntime inference "
        "on random inputs (ortbridge.gradcheck)",
    )
    inspect.add_argument(
        "--json", action="store_true", help="print the same as one JSON object (machine-readable)"
    )
    args = parser.parse_args(argv)
    if args.command == "demo":
        from ._cli._demo import run_demo

        result = run_demo(args.epochs, args.output, args.seed)
        if result["accuracy"] < 0.8 or result["max_diff"] > 1e-4:
            print("demo FAILED: accuracy below 0.8 or exported model differs", file=sys.stderr)
            return 1
        return 0
    from ._cli._inspect import inspect_model
    from .exceptions import OrtBridgeError

    try:
        ok = inspect_model(args.model, backend=args.backend, check=args.check, as_json=args.json)
    except OrtBridgeError as exc:
        if args.json:
            print(json.dumps({"model": args.model, "error": str(exc)}, indent=2))
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
