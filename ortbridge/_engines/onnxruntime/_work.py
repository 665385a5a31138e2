"""How many intra-op threads a graph's work is worth.

onnxruntime's CPU products (MLAS) split an operation over the session's
threads from about 64K multiply-adds up, and its elementwise kernels split
large tensors; each split costs a hand-over to the workers and a wait for
them. On a graph of small operations (a small transformer's or ConvNeXt's
gradients at batch 16) those waits cost more than the second core gives
back, and the worker's spinning takes that core from torch between runs.
Measured on 2 cores, one training step with both sessions on one thread
against two (A/B in one process, the training build's environment):
Whisper's encoder 0.86x, ViT 0.86x, ConvNeXt 0.95x, SegFormer 0.97x, but
MobileViT 1.23x, a small CNN 1.13x, ResNet 1.06x, a transformer layer of
width 256 1.83x (an MLP and a UNet decoder 1.02x, a 2-layer LSTM 0.94x).

What separated them: the multiply-adds of the forward graph's products and
convolutions of at least :data:`_LARGE` each (those a second thread
shortens by more than its hand-over; the backward's are about twice the
forward's). Under :data:`_WORTH_THREADS` in all (SegFormer's 1.2M, the
small transformers' and ConvNeXt's none; ResNet's 4.8M, MobileViT's 5.5M,
the others' 10M or more) and no tensor of :data:`_LARGE` elements
(elementwise kernels split those), both sessions run on one thread;
otherwise on torch's count, as before. The forward's shapes come from the
optimiser's last inference of it, so the choice costs no inference of its
own. Scan and Loop bodies are not counted (the LSTM keeps two threads).
Graphs of unknown shapes keep torch's count.
"""

from __future__ import annotations

import numpy as np
import onnx

from .passes._optimize import _shapes

#: A product or convolution of at least this many multiply-adds gains from more threads.
_LARGE = 1 << 20
#: Multiply-adds of the forward in such operations below which sessions run on one thread.
_WORTH_THREADS = 2 << 20
_PRODUCTS = frozenset({"MatMul", "Gemm", "FusedMatMul", "Conv", "ConvTranspose"})


def session_threads(forward: onnx.ModelProto, shapes=None) -> int | None:
    """1 where the ``forward`` graph's large products are too few to pay for a
    second thread; None (torch's count) otherwise or where shapes are unknown.
    ``shapes``: the forward's, where known (inferred if not)."""
    shapes = _shapes(forward) if shapes is None else shapes
    if shapes is None:
        return None
    large = 0
    for node in forward.graph.node:
        if node.op_type == "Constant":  # a rewrite's shapes and axes
            continue
        for name in node.output:
            shape = shapes.get(name)
            if shape is None or not all(isinstance(d, int) for d in shape):
                return None
            if np.prod(shape) >= _LARGE:
                return None
        if node.op_type not in _PRODUCTS:
            continue
        work = _multiply_adds(node, shapes)
        if work is None:
            return None
        if work >= _LARGE:
            large += work
            if large >= _WORTH_THREADS:
                return None
    return 1


def _multiply_adds(node: onnx.NodeProto, shapes) -> int | None:
    """The multiply-adds of a product or convolution; None where a shape is unknown."""
    known = [shapes.get(name) for name in (node.input[0], node.input[1], node.output[0])]
    if any(s is None or not all(isinstance(d, int) for d in s) for s in known):
        return None
    a, b, out = known
    if node.op_type in ("Conv", "ConvTranspose"):
        # Each output (Conv) or input (ConvTranspose) element meets one
        # kernel slice: (C_in / group) x kernel, or (C_out / group) x kernel.
        return int(np.prod(out if node.op_type == "Conv" else a)) * int(np.prod(b[1:]))
    if not a:
        return 0
    trans_a = any(x.name == "transA" and x.i for x in node.attribute)
    inner = a[-2] if trans_a and len(a) >= 2 else a[-1]
    return int(np.prod(out)) * inner
