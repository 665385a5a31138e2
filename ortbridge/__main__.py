"""Command line: ``python -m ortbridge demo`` and ``python -m ortbridge inspect MODEL.onnx``."""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ortbridge", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a torch model with an ONNX layer on digits")
    demo.add_argument("--epochs", type=int, default=15)
    demo.add_argument("--output", default="ortbridge_demo.onnx", help="trained ONNX file")
    demo.add_argument("--seed", type=int, default=0)
    inspect = sub.add_parser("inspect", help="what OnnxModule makes of an ONNX model")
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
    args = parser.parse_args(argv)
    if args.command == "demo":
        from ._demo import run_demo

        result = run_demo(args.epochs, args.output, args.seed)
        if result["accuracy"] < 0.8 or result["max_diff"] > 1e-4:
            print("demo FAILED: accuracy below 0.8 or exported model differs", file=sys.stderr)
            return 1
        return 0
    from ._inspect import inspect_model
    from .exceptions import OrtBridgeError

    try:
        return 0 if inspect_model(args.model, backend=args.backend, check=args.check) else 1
    except OrtBridgeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
