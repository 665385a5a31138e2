"""Quantized files written by onnxruntime's quantizer, and torch's fake quantization of them.

:func:`quantized_file` quantizes a float file with onnxruntime's
``quantize_static`` (a tool nobody here wrote), calibrated on fixed random
batches. :class:`FakeQuantized` is the reference: the same file run by torch
op by op, each weight a float tensor holding its dequantized value, each
``QuantizeLinear``/``DequantizeLinear`` pair ``torch.fake_quantize_per_tensor_affine``
or ``..._per_channel_affine``, each int32 bias its float value; torch's
autograd gives the gradients (straight through inside the range, as torch's
quantization-aware training defines them).
"""

from __future__ import annotations

import math
import os

import numpy as np
import onnx
import torch
import torch.nn.functional as F
from onnx import helper, numpy_helper


def quantized_file(
    source: str, target: str, feeds, *, fmt: str = "QDQ", per_channel: bool = False,
    activations: str = "QUInt8", weights: str = "QInt8",
) -> str:  # fmt: skip
    """``source`` quantized by onnxruntime's ``quantize_static`` into ``target``."""
    from onnxruntime.quantization import (
        CalibrationDataReader,
        QuantFormat,
        QuantType,
        quantize_static,
    )

    class _Batches(CalibrationDataReader):
        def __init__(self):
            self._left = iter(feeds)

        def get_next(self):
            return next(self._left, None)

    quantize_static(
        source, target, _Batches(), quant_format=getattr(QuantFormat, fmt),
        per_channel=per_channel, activation_type=getattr(QuantType, activations),
        weight_type=getattr(QuantType, weights),
    )  # fmt: skip
    assert os.path.exists(target)
    return target


def _attrs(node):
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


class FakeQuantized(torch.nn.Module):
    """A QDQ file as torch computes it under fake quantization (see the module)."""

    def __init__(self, path: str, learnable_scales: bool = False):
        super().__init__()
        model = onnx.load(path)
        self.graph = model.graph
        self.consts = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
        self.weights = torch.nn.ParameterDict()
        self._names = {}
        #: With ``learnable_scales``: each pair's scale a parameter (by its
        #: initializer's name), under torch's LSQ fake quantization.
        self.scales = {}
        if learnable_scales:
            for node in self.graph.node:
                if node.op_type == "DequantizeLinear" and node.input[1] not in self.scales:
                    value = torch.from_numpy(self.consts[node.input[1]].astype(np.float32))
                    self.scales[node.input[1]] = torch.nn.Parameter(value.clone())
        for node in self.graph.node:
            if node.op_type == "DequantizeLinear" and node.input[0] in self.consts:
                scale, zero = self._params(node)
                q = self.consts[node.input[0]].astype(np.int64)
                value = self._along(scale, q.ndim, node) * (
                    q - self._along(zero, q.ndim, node)
                ).astype(np.float32)
                self._add(node.input[0], value)
        # A quantized table gathered before its DequantizeLinear (onnx's older
        # quantizer: an embedding, T5's position bias): the table a float
        # parameter, fake-quantized where it is read, the pair's dequantization
        # then of a float already.
        self._tables = {}  # table -> the DequantizeLinear that scales its rows
        producers = {out: n for n in self.graph.node for out in n.output}
        for node in self.graph.node:
            if node.op_type != "DequantizeLinear" or node.input[0] in self.consts:
                continue
            source = producers.get(node.input[0])
            while source is not None and source.op_type in ("Transpose", "Reshape"):
                source = producers.get(source.input[0])
            if source is not None and source.op_type == "Gather" and source.input[0] in self.consts:
                scale, zero = self._params(node)
                q = self.consts[source.input[0]].astype(np.int64)
                self._add(source.input[0], float(scale) * (q - int(zero)).astype(np.float32))
                self._tables[source.input[0]] = node
        # Weight-only int8: ``Mul(Cast(q), scale)``, symmetric, the scale per
        # channel along the axis where it has more than one value.
        self._weight_only = {}  # the Mul's output -> (weight, scale, axis)
        for node in self.graph.node:
            if node.op_type != "Mul":
                continue
            cast = next((producers.get(i) for i in node.input if producers.get(i)), None)
            scale = next((i for i in node.input if i in self.consts), None)
            if cast is None or scale is None or cast.op_type != "Cast":
                continue
            if self.consts.get(cast.input[0], np.zeros(0)).dtype != np.int8:
                continue
            q, s = self.consts[cast.input[0]], self.consts[scale].astype(np.float32)
            axes = [d for d in range(s.ndim) if s.shape[d] > 1]
            self._add(cast.input[0], q.astype(np.float32) * s)
            axis = axes[0] + q.ndim - s.ndim if axes else None
            self._weight_only[node.output[0]] = (cast.input[0], s.reshape(-1), axis)
        # Dynamic quantization: an *Integer node's weight, its scale read from
        # the Mul of the activation's and the weight's scales that rescales it.
        self._dynamic = {}  # *Integer output -> (weight name, weight scale, zero point)
        readers = {}
        for node in self.graph.node:
            for name in node.input:
                readers.setdefault(name, []).append(node)
        for node in self.graph.node:
            if node.op_type in ("ConvInteger", "MatMulInteger"):
                cast = readers[node.output[0]][0]
                mul = readers[cast.output[0]][0]
                scales = next(n for n in self.graph.node if set(n.output) & set(mul.input))
                scale = self.consts[next(i for i in scales.input if i in self.consts)]
                w = node.input[1]
                zero = self.consts[node.input[3]] if len(node.input) > 3 else np.zeros((), np.int8)
                q = self.consts[w].astype(np.int64)
                self._add(w, scale * (q - zero.astype(np.int64)).astype(np.float32))
                self._dynamic[node.output[0]] = (w, scale, zero)

    def _add(self, onnx_name, value):
        key = f"w{len(self._names)}"
        self._names[onnx_name] = key
        self.weights[key] = torch.nn.Parameter(torch.from_numpy(np.asarray(value, np.float32)))

    def parameter(self, onnx_name: str) -> torch.nn.Parameter:
        return self.weights[self._names[onnx_name]]

    def train_float(self, onnx_name: str) -> torch.nn.Parameter:
        """Make the file's float initializer ``onnx_name`` a parameter (a LoRA
        branch's adapter beside the integers); returned."""
        self._add(onnx_name, self.consts[onnx_name])
        return self.parameter(onnx_name)

    def _const(self, onnx_name: str) -> torch.Tensor:
        if onnx_name in self._tables:
            return self._fake(self.parameter(onnx_name), self._tables[onnx_name])
        if onnx_name in self._names:  # a float initializer made a parameter
            return self.parameter(onnx_name)
        return torch.from_numpy(self.consts[onnx_name])

    def _params(self, node):
        scale = self.consts[node.input[1]]
        zero = self.consts[node.input[2]] if len(node.input) > 2 else np.zeros_like(scale, np.uint8)
        return scale, zero

    @staticmethod
    def _along(value, rank, node):
        if value.size == 1 or rank == 0:
            return value.reshape(())
        shape = [1] * rank
        shape[_attrs(node).get("axis", 1) % rank] = -1
        return value.reshape(shape)

    def _fake(self, x, node):
        scale, zero = self._params(node)
        info = _Range(*_limits(zero))
        if node.input[1] in self.scales:
            learnt = self.scales[node.input[1]]
            zero_f = torch.from_numpy(zero.astype(np.float32))
            if scale.size == 1:
                return torch._fake_quantize_learnable_per_tensor_affine(
                    x, learnt.reshape(1), zero_f.reshape(1), int(info.min), int(info.max), 1.0
                )
            return torch._fake_quantize_learnable_per_channel_affine(
                x, learnt, zero_f, _attrs(node).get("axis", 1) % x.dim(), int(info.min),
                int(info.max), 1.0,
            )  # fmt: skip
        if scale.size == 1:
            # A masked score (float32's lowest) overflows x / scale to -inf, which
            # torch's kernel makes NaN; onnxruntime saturates: clamp it first, a
            # step past the range (the same values and gradients either way).
            step, offset = float(scale.reshape(())), int(zero.reshape(()))
            low, high = (int(info.min) - offset - 1) * step, (int(info.max) - offset + 1) * step
            x = x.clamp(low, high)
            return torch.fake_quantize_per_tensor_affine(
                x, step, offset, int(info.min), int(info.max)
            )
        return torch.fake_quantize_per_channel_affine(
            x, torch.from_numpy(scale.astype(np.float32)),
            torch.from_numpy(zero.astype(np.int32)), _attrs(node).get("axis", 1) % x.dim(),
            int(info.min), int(info.max),
        )  # fmt: skip

    def forward(self, *inputs):
        env = {i.name: x for i, x in zip(self.graph.input, inputs)}
        held = {}  # QuantizeLinear outputs: the float tensor they quantize
        rescaled = set()  # float products of *Integer nodes, and their Cast and Mul
        for node in self.graph.node:
            op, a, ins = node.op_type, _attrs(node), node.input
            if op == "QuantizeLinear":
                held[node.output[0]] = env[ins[0]]
                continue
            if op == "DequantizeLinear":
                if ins[0] in self._names:
                    w = self.parameter(ins[0])
                    is_bias = self.consts[ins[0]].dtype == np.int32
                    env[node.output[0]] = w if is_bias else self._fake(w, node)
                elif ins[0] in held:
                    env[node.output[0]] = self._fake(held[ins[0]], node)
                else:  # rows of a table fake-quantized where it was read
                    env[node.output[0]] = env[ins[0]]
                continue
            if op == "DynamicQuantizeLinear":  # range from the tensor, as onnxruntime computes it
                env[node.output[0]] = _dynamic_fake(env[ins[0]])
                env[node.output[1]] = env[node.output[2]] = None
                continue
            if op in ("ConvInteger", "MatMulInteger"):  # already rescaled: Cast and Mul pass it
                w, scale, zero = self._dynamic[node.output[0]]
                if scale.size == 1:
                    weight = torch.fake_quantize_per_tensor_affine(
                        self.parameter(w), float(scale), int(zero), *_limits(zero)
                    )
                else:  # per column (quantize_dynamic's per_channel=True)
                    weight = torch.fake_quantize_per_channel_affine(
                        self.parameter(w), torch.from_numpy(scale.astype(np.float32)),
                        torch.from_numpy(zero.astype(np.int32)), self.parameter(w).dim() - 1,
                        *_limits(zero),
                    )  # fmt: skip
                float_op = "Conv" if op == "ConvInteger" else "MatMul"
                env[node.output[0]] = self._run(float_op, a, [env[ins[0]], weight])
                rescaled.add(node.output[0])
                continue
            if node.output[0] in self._weight_only:
                w, scale, axis = self._weight_only[node.output[0]]
                if axis is None:
                    weight = torch.fake_quantize_per_tensor_affine(
                        self.parameter(w), float(scale[0]), 0, -128, 127
                    )
                else:
                    weight = torch.fake_quantize_per_channel_affine(
                        self.parameter(w), torch.from_numpy(scale),
                        torch.zeros(scale.size, dtype=torch.int32), axis, -128, 127,
                    )  # fmt: skip
                env[node.output[0]] = weight
                continue
            if op in ("Cast", "Mul") and rescaled & set(ins):
                env[node.output[0]] = env[next(i for i in ins if i in rescaled)]
                if op == "Cast":  # the Mul by the scales ends the chain
                    rescaled.add(node.output[0])
                continue
            if op == "Mul" and any(env.get(i, 0) is None for i in ins):
                continue  # the activation's scale times the weight's: unread here
            x = [env[n] if n in env else self._const(n) for n in ins if n]
            env[node.output[0]] = self._run(op, a, x)
        return tuple(env[o.name] for o in self.graph.output)

    @staticmethod
    def _run(op, a, x):
        if op == "Reshape":  # a 0 copies the input's size there
            shape = [int(d) for d in x[1]]
            return x[0].reshape([x[0].shape[i] if d == 0 else d for i, d in enumerate(shape)])
        if op in _TRANSFORMER_OPS:
            return _TRANSFORMER_OPS[op](a, x)
        if op == "Conv":
            pads = a.get("pads", [0] * (2 * (x[0].dim() - 2)))
            conv = F.conv1d if x[0].dim() == 3 else F.conv2d
            return conv(
                x[0],
                x[1],
                x[2] if len(x) > 2 else None,
                a.get("strides", 1),
                pads[: len(pads) // 2],
                a.get("dilations", 1),
                a.get("group", 1),
            )
        if op == "Gemm":
            w = x[1].t() if a.get("transB", 0) else x[1]
            y = (x[0].t() if a.get("transA", 0) else x[0]) @ w
            return y + x[2] if len(x) > 2 else y
        if op == "ReduceMean":
            axes = a["axes"] if "axes" in a else [int(d) for d in x[1]]  # (an input from opset 18)
            return x[0].mean(tuple(axes), keepdim=bool(a.get("keepdims", 1)))
        simple = {
            "Relu": lambda: torch.relu(x[0]), "Add": lambda: x[0] + x[1],
            "Mul": lambda: x[0] * x[1], "MatMul": lambda: x[0] @ x[1],
            "Sigmoid": lambda: torch.sigmoid(x[0]),
            "Flatten": lambda: _flatten(x[0], a.get("axis", 1)),
            "GlobalAveragePool": lambda: x[0].mean((2, 3), keepdim=True),
            "MaxPool": lambda: F.max_pool2d(x[0], a["kernel_shape"], a.get("strides")),
            "AveragePool": lambda: F.avg_pool2d(x[0], a["kernel_shape"], a.get("strides")),
            "LeakyRelu": lambda: F.leaky_relu(x[0], a.get("alpha", 0.01)),
            "Concat": lambda: torch.cat(x, a["axis"]),
            "Unsqueeze": lambda: _unsqueeze(x[0], x[1]),
            "Squeeze": lambda: x[0].squeeze(tuple(int(d) for d in x[1].reshape(-1)))
            if len(x) > 1
            else x[0].squeeze(),
        }  # fmt: skip
        return simple[op]()


def _flatten(x, axis):
    return x.reshape(math.prod(x.shape[:axis]), -1)


def _unsqueeze(x, axes):
    rank = x.dim() + axes.numel()
    for axis in sorted(int(d) % rank for d in axes.reshape(-1)):
        x = x.unsqueeze(axis)
    return x


def _slice(a, x):
    data, starts, ends = x[0], x[1].tolist(), x[2].tolist()
    axes = x[3].tolist() if len(x) > 3 else list(range(len(starts)))
    steps = x[4].tolist() if len(x) > 4 else [1] * len(starts)
    index = [slice(None)] * data.dim()
    for axis, start, end, step in zip(axes, starts, ends, steps):
        index[axis] = slice(start, end, step)
    return data[tuple(index)]


def _gather(a, x):
    axis, data, index = a.get("axis", 0), x[0], x[1].long()
    picked = torch.index_select(data, axis, index.reshape(-1) % data.shape[axis])
    return picked.reshape(data.shape[:axis] + index.shape + data.shape[axis + 1 :])


def _layer_norm(a, x):
    axis = a.get("axis", -1) % x[0].dim()
    shape = x[0].shape[axis:]
    bias = x[2] if len(x) > 2 else None
    return F.layer_norm(x[0], shape, x[1].expand(shape), bias, a.get("epsilon", 1e-5))


def _reduce_sum(a, x):
    axes = tuple(int(i) for i in x[1]) if len(x) > 1 else tuple(range(x[0].dim()))
    return x[0].sum(axes, keepdim=bool(a.get("keepdims", 1)))


#: The other ops of the published QDQ transformer (torch's Whisper-style encoder).
_TRANSFORMER_OPS = {
    "Sub": lambda a, x: x[0] - x[1],
    "Div": lambda a, x: x[0] / x[1],
    "Erf": lambda a, x: torch.erf(x[0]),
    "Tanh": lambda a, x: torch.tanh(x[0]),
    "Softmax": lambda a, x: torch.softmax(x[0], a.get("axis", -1)),
    "Transpose": lambda a, x: x[0].permute(*a["perm"]),
    "Shape": lambda a, x: torch.tensor(
        x[0].shape[a.get("start", 0) : a.get("end")], dtype=torch.int64
    ),  # noqa: E501
    "Gather": _gather,
    "Slice": _slice,
    "LayerNormalization": _layer_norm,
    "ReduceSum": _reduce_sum,
    # BERT's attention mask and positions (integer and boolean tensors)
    "Where": lambda a, x: torch.where(x[0].bool(), x[1], x[2]),
    "Equal": lambda a, x: x[0] == x[1],
    "GreaterOrEqual": lambda a, x: x[0] >= x[1],
    "And": lambda a, x: x[0] & x[1],
    "IsNaN": lambda a, x: torch.isnan(x[0]),
    "Range": lambda a, x: torch.arange(x[0].item(), x[1].item(), x[2].item()),
    "Expand": lambda a, x: x[0] * torch.ones(tuple(int(d) for d in x[1]), dtype=x[0].dtype),
    "Cast": lambda a, x: x[0].to(_TORCH_TYPES[a["to"]]),
    "GatherElements": lambda a, x: torch.gather(x[0], a.get("axis", 0), x[1].long()),
    # T5's relative position buckets and RMS norms
    "Constant": lambda a, x: torch.from_numpy(numpy_helper.to_array(a["value"]).copy()),
    "ConstantOfShape": lambda a, x: torch.full(
        tuple(int(d) for d in x[0]), float(numpy_helper.to_array(a["value"]).reshape(-1)[0])
    ),
    "Abs": lambda a, x: x[0].abs(),
    "Neg": lambda a, x: -x[0],
    "Log": lambda a, x: torch.log(x[0]),
    "Sqrt": lambda a, x: torch.sqrt(x[0]),
    "Pow": lambda a, x: x[0] ** x[1],
    "Min": lambda a, x: torch.minimum(x[0], x[1]),
    "Max": lambda a, x: torch.maximum(x[0], x[1]),
    "Less": lambda a, x: x[0] < x[1],
    "GatherND": lambda a, x: x[0][tuple(x[1].long().unbind(-1))],  # (batch_dims 0)
    "Greater": lambda a, x: x[0] > x[1],
}
_TORCH_TYPES = {
    onnx.TensorProto.FLOAT: torch.float32, onnx.TensorProto.INT64: torch.int64,
    onnx.TensorProto.INT32: torch.int32, onnx.TensorProto.BOOL: torch.bool,
}  # fmt: skip


def _limits(zero):
    """The integer range of a zero point's type (4-bit types: ml_dtypes' int4/uint4)."""
    four_bit = {"int4": (-8, 7), "uint4": (0, 15)}
    if zero.dtype.name in four_bit:
        return four_bit[zero.dtype.name]
    info = np.iinfo(zero.dtype)
    return int(info.min), int(info.max)


class _Range:
    def __init__(self, low, high):
        self.min, self.max = low, high


def _dynamic_fake(x):
    """``DequantizeLinear(DynamicQuantizeLinear(x))`` as torch's fake quantization:
    uint8, the range ``[min(x, 0), max(x, 0)]``, onnxruntime's rounding of the zero point."""
    low = torch.clamp(x.detach().min(), max=0.0)
    high = torch.clamp(x.detach().max(), min=0.0)
    scale = float((high - low) / 255.0)
    if scale == 0.0:
        return x
    zero = int(np.clip(np.rint(0.0 - float(low) / np.float32(scale)), 0, 255))
    return torch.fake_quantize_per_tensor_affine(x, scale, zero, 0, 255)
