"""The normalisation pass: nodes onnxruntime's gradient builder refuses, rewritten.

:func:`normalize` runs once per model, before the train/eval variants
(:mod:`._variants`) are made from it.
"""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import onnx.version_converter
from onnx import TensorProto, helper, numpy_helper

from ..exceptions import OnnxModelError
from . import _activations
from ._checks import check_runnable
from ._declared_shapes import declarations_as_computed
from ._exporter_forms import (
    bfloat16_as_float32,
    detach_output_shapes,
    older_forms_rewritten,
    outputs_as_computed,
)
from ._lookup import _all_names, _infer, _unique
from ._onnx_utils import FLOAT_TYPES, np_dtype, topological
from ._sequences import sequences_as_tensors
from ._weights import lift_constant_weights
from .quantized import lift_quantized_weights, unread_integer_weights


def normalize(model: onnx.ModelProto, wrong_shapes: list | None = None) -> onnx.ModelProto:
    """Rewrite nodes onnxruntime's gradient builder refuses into equivalent ones.

    A bfloat16 graph computes in float32 (:func:`._exporter_forms.bfloat16_as_float32`:
    onnxruntime's CPU provider has no bfloat16 kernels for most ops). The
    model is then checked (:func:`._checks.check_runnable`): what
    onnxruntime could not load is refused in plain words. Weights and running
    statistics held in ``Constant`` nodes become initializers next
    (:func:`._weights.lift_constant_weights`), before any rewrite below
    takes them for constants; then forms older exporters write (unknown
    dimensions named ``?``, BatchNormalization with unread statistics
    outputs) are rewritten (:mod:`._exporter_forms`).

    - ``CastLike`` has no registered gradient: it becomes a ``Cast`` to the
      statically known type of its second input.
    - ``LayerNormalization`` with only its first output fails inside the
      builder: its optional mean and inverse-std outputs are named.
    - ``AveragePool`` over a tensor with a dynamic dimension: onnxruntime
      1.19.2's ``AveragePoolGrad`` kills the process (SIGFPE) or returns a
      gradient of the wrong shape; it becomes the equivalent depthwise
      ``Conv`` with constant weights where one exists (else the training
      agent refuses it, :mod:`ortbridge._engines.training_agent._limits`).
    - ``Dropout`` without its mask output: the gradient needs the mask.
    - Activations without a registered gradient (ELU, CELU, SELU, Softplus,
      Mish, HardSigmoid, HardSwish, PRelu) become standard ops
      (:mod:`._activations`).
    - ``ReverseSequence`` reads ``Max(sequence_lens, 1)``: the same result
      (a sequence of 0 or 1 element stays as it is), but onnxruntime 1.19.2
      leaves a batch entry of length 0 unwritten, uninitialised memory in the
      output and so in its gradient.
    - Quantized weights (an integer initializer read by ``DequantizeLinear``)
      become float weights under fake quantization
      (:func:`.quantized.lift_quantized_weights`).
    - A graph output that is a graph input (the input handed back) gets a
      name of its own, an ``Identity`` of the input: onnx-ad names the
      input's gradient after it and refuses the clash, and onnxruntime
      1.19.2's gradient builder fails on it or kills the process.
    - Nodes come after the nodes they read (onnxconverter-common's
      ``keep_io_types`` appends its input casts last; onnxruntime sorts a
      graph itself, the engines read it in order).
    - Unnamed nodes get a name.
    - An ai.onnx opset below 13 is converted to 13: the gradient builder
      writes nodes in the forms of recent opsets (a ``Gemm`` without ``C``).
    - Sequences of known length read back by constant position (dynamo's
      ``torch.split``: ``SplitToSequence`` + ``SequenceAt``) become tensors
      (:func:`._sequences.sequences_as_tensors`): the builder follows
      no weight into a sequence.
    - Declared shapes the graph contradicts (graph outputs', intermediate
      tensors', bodies' inputs and outputs) are declared as computed
      (:mod:`._declared_shapes`): no declaration constrains a gradient graph.
      ``wrong_shapes``, a list, gets what was replaced
      (:class:`._declared_shapes.WrongShape`).
    """
    bfloat16_as_float32(model)
    _producers_first(model)
    check_runnable(model)
    lift_constant_weights(model)
    older_forms_rewritten(model)
    model = _at_least_opset(model, MIN_OPSET)
    _warn_unread(model, lift_quantized_weights(model))
    model = sequences_as_tensors(model, loops=False)
    replaced = declarations_as_computed(model)
    if wrong_shapes is not None:
        wrong_shapes.extend(replaced)
    graph = model.graph
    _passed_inputs_copied(graph)
    declared = detach_output_shapes(graph)
    types, shapes = _infer(model)
    outputs_as_computed(graph, declared, shapes)
    taken = _all_names(graph)
    rewritten = []
    for node in graph.node:
        if node.domain == "org.pytorch.aten":
            raise OnnxModelError(
                f"node {node.name!r} ({node.op_type} of domain org.pytorch.aten) runs torch code "
                "through ORTModule's ATen executor, which ortbridge does not use: export the "
                "model in a process where ORTModule was never created"
            )
        if node.op_type == "AveragePool" and node.domain in ("", "ai.onnx"):
            rewritten.extend(_average_pool_as_conv(node, shapes, types, taken))
            continue
        if node.op_type == "ReverseSequence" and node.domain in ("", "ai.onnx"):
            rewritten.extend(_at_least_one_step(node, graph, taken))
            continue
        if node.domain in ("", "ai.onnx") and node.op_type in _activations.ALL_OPS:
            elem = types.get(node.input[0])
            if elem in FLOAT_TYPES and _activations.rewrites(node.op_type, elem):
                fresh = lambda base: _unique(base, taken)  # noqa: E731
                rewritten.extend(_activations.decompose(node, elem, fresh))
                continue
        rewritten.append(node)
    del graph.node[:]
    graph.node.extend(rewritten)
    for node in graph.node:
        if not node.name:  # errors and BatchNorm bookkeeping refer to nodes by name
            node.name = _unique(f"{node.op_type}_{node.output[0]}", taken)
        if node.op_type == "CastLike" and node.domain in ("", "ai.onnx"):
            target = types.get(node.input[1])
            if target is None:
                raise OnnxModelError(
                    f"node {node.name!r} (CastLike): the type of {node.input[1]!r} is unknown, "
                    "the node cannot be rewritten as a Cast for the gradient builder"
                )
            data = node.input[0]
            del node.input[:]
            node.input.append(data)
            del node.attribute[:]
            node.attribute.append(helper.make_attribute("to", target))
            node.op_type = "Cast"
        elif node.op_type == "Dropout" and node.domain in ("", "ai.onnx"):
            # DropoutGrad reads the mask: the builder fails when it is unnamed.
            if len(node.output) < 2:
                node.output.append(_unique(f"{node.output[0]}_mask", taken))
            elif not node.output[1]:
                node.output[1] = _unique(f"{node.output[0]}_mask", taken)
        elif node.op_type == "LayerNormalization" and node.domain in ("", "ai.onnx"):
            while len(node.output) < 3:
                node.output.append(_unique(f"{node.output[0]}_ln_stat", taken))
            for pos in (1, 2):
                if not node.output[pos]:
                    node.output[pos] = _unique(f"{node.output[0]}_ln_stat", taken)
    return model


def _passed_inputs_copied(graph: onnx.GraphProto) -> None:
    """Each graph output that is a graph input as an ``Identity`` of it."""
    inputs = {i.name for i in graph.input}
    taken = None
    for output in graph.output:
        if output.name in inputs:
            taken = taken if taken is not None else _all_names(graph)
            copy = _unique(f"{output.name}_passed", taken)
            graph.node.append(helper.make_node("Identity", [output.name], [copy], name=copy))
            output.name = copy


#: Lowest ai.onnx opset handed to the gradient builder.
MIN_OPSET = 13


def _at_least_opset(model: onnx.ModelProto, opset: int) -> onnx.ModelProto:
    current = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    if current is None or current >= opset:
        return model
    try:
        converted = onnx.version_converter.convert_version(model, opset)
    except Exception as exc:
        raise OnnxModelError(
            f"the model uses ai.onnx opset {current}; onnxruntime's gradient builder needs "
            f"{opset} or later and onnx could not convert it: {exc}"
        ) from exc
    converted.ir_version = max(converted.ir_version, 7)
    return converted


def _at_least_one_step(node, graph, taken) -> list[onnx.NodeProto]:
    """``node`` (ReverseSequence) reading ``Max(sequence_lens, 1)``."""
    one = _unique(f"{node.name or node.output[0]}/one", taken)
    lens = _unique(f"{node.input[1]}/at_least_one", taken)
    graph.initializer.append(numpy_helper.from_array(np.array(1, np.int64), one))
    clamp = helper.make_node("Max", [node.input[1], one], [lens], name=lens)
    node.input[1] = lens
    return [clamp, node]


def _average_pool_as_conv(node, shapes, types, taken) -> list[onnx.NodeProto]:
    shape = shapes.get(node.input[0])
    if shape is not None and all(d is not None for d in shape):
        return [node]  # static shapes: onnxruntime's own gradient works
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    pads = list(attrs.get("pads", []))
    auto_pad = attrs.get("auto_pad", b"NOTSET")
    auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else auto_pad
    exact = (
        shape is not None
        and len(shape) >= 3
        and shape[1] is not None
        and auto_pad == "NOTSET"
        and not attrs.get("ceil_mode", 0)
        and (not any(pads) or attrs.get("count_include_pad", 0))
    )
    if not exact:
        # The training agent refuses it (``average-pool-dynamic`` of its
        # builder limits); the onnxruntime engine differentiates it as it is.
        return [node]
    kernel = list(attrs["kernel_shape"])
    channels = shape[1]
    elem = types.get(node.input[0], TensorProto.FLOAT)
    weight = np.full([channels, 1, *kernel], 1.0 / float(np.prod(kernel)), dtype=np_dtype(elem))
    weight_name = _unique(f"{node.name or 'avgpool'}_weight", taken)
    conv_attrs = {"group": channels, "kernel_shape": kernel}
    for key in ("strides", "pads", "dilations"):
        if key in attrs:
            conv_attrs[key] = list(attrs[key])
    return [
        helper.make_node(
            "Constant", [], [weight_name], value=numpy_helper.from_array(weight, weight_name)
        ),
        helper.make_node(
            "Conv", [node.input[0], weight_name], [node.output[0]], node.name, **conv_attrs
        ),
    ]


def _producers_first(model: onnx.ModelProto) -> None:
    """The main graph's nodes in an order where producers come first, in place."""
    ordered = topological(model.graph)
    if [tuple(n.output) for n in ordered] != [tuple(n.output) for n in model.graph.node]:
        copies = [onnx.NodeProto() for _ in ordered]
        for copy, node in zip(copies, ordered):
            copy.CopyFrom(node)
        del model.graph.node[:]
        model.graph.node.extend(copies)


def _warn_unread(model: onnx.ModelProto, lifted) -> None:
    """Name the quantized weights no form read (they stay frozen, unlike the
    rest): never a weight frozen without a word."""
    unread = unread_integer_weights(model, set(lifted))
    if unread:
        name, node = next(iter(unread.items()))
        warnings.warn(
            f"{len(unread)} quantized weights stay frozen as the file holds them: their "
            f"form is not one ortbridge reads as a quantized weight ({sorted(unread)[:5]}; "
            f"{name!r} is read by node {node.name!r}, op type {node.op_type}); the other "
            "weights train (python -m ortbridge inspect lists what trains)",
            stacklevel=4,
        )
