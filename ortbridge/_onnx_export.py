"""An ONNX layer written back into the ONNX file of the torch model that holds it.

``torch.onnx.export(model, ...)`` meets each ONNX layer as the operator
``ortbridge::onnx_layer`` (:mod:`._torch_op`): its translation (``dynamo=True``)
or its symbolic (the TorchScript exporter, ``dynamo=False``) writes the
layer's own graph in its place, inlined: the layer's inputs are the
values torch computed, its float weights the exported model's initializers
(with their current, trained values), its other constants ``Constant``
nodes, every name prefixed with the layer's key. The graph is converted to
the exporter's opset where it was written for another.

The translation is registered with torch's exporter when the exporter's
core module is imported (an import hook: importing it costs over two
seconds, which no other use of ortbridge should pay), or at once where it
already is; the symbolic when a layer is first traced by ``torch.jit``.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import re
import sys
import warnings

import onnx
import torch
from onnx import helper, numpy_helper

from .exceptions import OnnxModelError

# Imported after the registry and the modules it imports in turn (which import
# each other): the translation is registered once this one has run.
_CORE = "torch.onnx._internal.exporter._core"


def install() -> None:
    """Register the translation now, or once torch's exporter registry is imported."""
    if _CORE in sys.modules:
        _register()
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())


def _register() -> None:
    try:
        from torch.onnx._internal.exporter._torchlib._torchlib_registry import onnx_impl

        onnx_impl(torch.ops.ortbridge.onnx_layer.default, no_compile=True)(onnx_layer)
    except Exception as exc:  # noqa: BLE001 - another torch: say so, keep torch importable
        warnings.warn(
            f"ortbridge could not register its ONNX layers with torch's ONNX exporter ({exc}): "
            "pass custom_translation_table={torch.ops.ortbridge.onnx_layer.default: "
            "ortbridge._onnx_export.onnx_layer} to torch.onnx.export",
            stacklevel=2,
        )


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds torch's exporter core module as the other finders do, and
    registers the translation once the module has run."""

    def find_spec(self, name, path=None, target=None):
        if name != _CORE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            run = spec.loader.exec_module

            def run_then_register(module):
                run(module)
                _register()

            spec.loader.exec_module = run_then_register
        return spec


def onnx_layer(key: str, mode: str, tensors):
    """The layer's graph, inlined into the graph torch's exporter is writing."""
    import onnx_ir as ir
    from torch.onnx._internal.exporter import _core

    from ._torch_op import _bridge

    bridge = _bridge(key)
    model, _ = bridge._variant(mode, for_gradient=False)
    tracer = _core.current_tracer
    model = _at_opset(model, tracer.opset.version, key)
    versions = {o.domain or "": o.version for o in model.opset_import}
    graph = ir.serde.deserialize_graph(model.graph)
    prefix = re.sub(r"\W", "_", key) + "/"
    for value, tensor in zip(list(graph.inputs), tensors):
        value.replace_all_uses_with(tensor)
    nodes = []
    for name, value in list(graph.initializers.items()):
        const = ir.Node(
            "",
            "Constant",
            [],
            attributes=[ir.AttrTensor("value", value.const_value)],
            num_outputs=1,
            name=prefix + name,
        )
        const.outputs[0].name = prefix + name
        value.replace_all_uses_with(const.outputs[0])
        nodes.append(const)
    outputs = list(graph.outputs)
    graph.outputs.clear()
    body = list(graph)
    graph.remove(body, safe=False)
    for node in body:
        node.name = prefix + (node.name or node.op_type)
        if node.domain not in ("", "ai.onnx"):
            node.version = versions.get(node.domain)
        for out in node.outputs:
            if out.name:
                out.name = prefix + out.name
    tracer.nodes.extend(nodes + body)
    return outputs


def _at_opset(model: onnx.ModelProto, version: int, key: str) -> onnx.ModelProto:
    current = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    if current == version:
        return model
    try:
        return onnx.version_converter.convert_version(model, version)
    except Exception as exc:  # noqa: BLE001 - onnx raises several kinds
        raise OnnxModelError(
            f"ONNX layer {key!r} is written for opset {current} and cannot be converted to "
            f"opset {version}, which the export writes: {exc}. Pass "
            f"opset_version={current} to torch.onnx.export"
        ) from exc


_SYMBOLIC = False
_ATTR_KINDS = {
    onnx.AttributeProto.INT: "i",
    onnx.AttributeProto.INTS: "i",
    onnx.AttributeProto.FLOAT: "f",
    onnx.AttributeProto.FLOATS: "f",
    onnx.AttributeProto.STRING: "s",
    onnx.AttributeProto.STRINGS: "s",
    onnx.AttributeProto.TENSOR: "t",
}


def register_symbolic() -> None:
    """Register the TorchScript exporter's symbolic (once; ``torch.jit`` is tracing)."""
    global _SYMBOLIC
    if not _SYMBOLIC:
        torch.onnx.register_custom_op_symbolic("ortbridge::onnx_layer", symbolic, 9)
        _SYMBOLIC = True


def symbolic(g, key, mode, tensors):
    """The layer's graph, node by node, in the TorchScript exporter's graph."""
    from torch.onnx import symbolic_helper

    try:
        from torch.onnx._internal.torchscript_exporter._globals import GLOBALS
    except ImportError:  # torch before 2.9
        from torch.onnx._globals import GLOBALS

    from ._torch_op import _bridge

    key = symbolic_helper._maybe_get_const(key, "s")
    mode = symbolic_helper._maybe_get_const(mode, "s")
    model, _ = _bridge(key)._variant(mode, for_gradient=False)
    model = _at_opset(model, GLOBALS.export_onnx_opset_version, key)
    env = dict(zip([i.name for i in model.graph.input], symbolic_helper._unpack_list(tensors)))
    for init in model.graph.initializer:
        value = torch.from_numpy(numpy_helper.to_array(init).copy())
        env[init.name] = g.op("Constant", value_t=value)
    for node in model.graph.node:
        attrs = {}
        for a in node.attribute:
            if a.type not in _ATTR_KINDS:
                raise OnnxModelError(
                    f"node {node.name!r} (op type {node.op_type}) of ONNX layer {key!r} has "
                    f"a graph attribute {a.name!r}, which the TorchScript exporter cannot "
                    "write: export with torch.onnx.export(..., dynamo=True)"
                )
            value = helper.get_attribute_value(a)
            if a.type == onnx.AttributeProto.TENSOR:
                value = torch.from_numpy(numpy_helper.to_array(value).copy())
            elif a.type == onnx.AttributeProto.STRING:
                value = value.decode()
            elif a.type == onnx.AttributeProto.STRINGS:
                value = [v.decode() for v in value]
            attrs[f"{a.name}_{_ATTR_KINDS[a.type]}"] = value
        domain = "" if node.domain in ("", "ai.onnx") else f"{node.domain}::"
        inputs = [env[name] if name else g.op("prim::Constant") for name in node.input]
        outs = g.op(f"{domain}{node.op_type}", *inputs, outputs=len(node.output), **attrs)
        env.update(zip(node.output, outs if isinstance(outs, (list, tuple)) else [outs]))
    return g.op("prim::ListConstruct", *[env[o.name] for o in model.graph.output])
