"""A user's model checked before onnxruntime sees it, so that mistakes come out in plain words.

onnxruntime reports a model it cannot load with its C++ text, and some
models it loads are empty shells that fail later with an unrelated Python
error. What can be told from the file alone is checked here: that it holds
a graph with outputs, that every output is computed, that its weights are
where onnxruntime can read them, that its versions and operators are ones
the installed onnxruntime knows.
"""

from __future__ import annotations

import onnx
from onnx import defs

from .._runtime._limits import fit_to_runtime
from ..exceptions import OnnxModelError

#: Domains onnxruntime registers kernels for, beside the ONNX standard ones.
_STANDARD_DOMAINS = ("", "ai.onnx")


def check_loaded(model: onnx.ModelProto, where: str) -> onnx.ModelProto:
    """Refuse what is not a model at all (an empty file, bytes of something else)."""
    if not model.graph.node and not model.graph.output and not model.graph.input:
        raise OnnxModelError(f"{where} is not a valid ONNX model: it holds no graph")
    external = [
        init.name
        for init in model.graph.initializer
        if init.data_location == onnx.TensorProto.EXTERNAL
    ]
    if external:
        files = sorted(
            {
                e.value
                for init in model.graph.initializer
                for e in init.external_data
                if e.key == "location"
            }
        )
        raise OnnxModelError(
            f"{where} keeps the data of {len(external)} initializer(s) ({external[:3]}...) in "
            f"external file(s) {files}, which cannot be found from it: pass the path of the "
            ".onnx file (the data is read from beside it) or a model loaded with "
            "onnx.load(path)"
        )
    return model


def check_runnable(model: onnx.ModelProto) -> None:
    """Refuse, naming what is wrong, a model the installed onnxruntime cannot load.

    ``model`` is ortbridge's own copy: an IR version newer than onnxruntime
    reads is lowered in it when its opsets are ones onnxruntime runs (the IR
    version numbers the file format; onnxruntime checks the content itself).
    """
    graph = model.graph
    if not graph.output:
        raise OnnxModelError(f"graph {graph.name!r} has no outputs: there is nothing to compute")
    produced = {i.name for i in graph.input} | {i.name for i in graph.initializer}
    produced |= {out for node in graph.node for out in node.output}
    missing = [o.name for o in graph.output if o.name not in produced]
    if missing:
        raise OnnxModelError(
            f"graph output(s) {missing} are computed by no node and are neither inputs nor "
            "initializers of the graph"
        )
    fit_to_runtime(model)
    opsets = {o.domain or "": o.version for o in model.opset_import}
    opset = opsets.get("", opsets.get("ai.onnx"))
    functions = {(f.domain, f.name) for f in model.functions}
    for node in graph.node:
        if node.domain not in _STANDARD_DOMAINS or (node.domain, node.op_type) in functions:
            continue
        if opset is not None and not _known(node.op_type, opset):
            raise OnnxModelError(
                f"node {node.name or node.output[0]!r} has op type {node.op_type!r}, which is no "
                f"ONNX operator at opset {opset}: check the spelling, or the opset the model "
                "imports"
            )


#: Kernels onnxruntime registers in the ONNX domain that ONNX does not define
#: (its transformer optimizer writes them there).
_ONNXRUNTIME_IN_ONNX_DOMAIN = frozenset({"SimplifiedLayerNormalization"})


def _known(op_type: str, opset: int) -> bool:
    if op_type in _ONNXRUNTIME_IN_ONNX_DOMAIN:
        return True
    try:
        defs.get_schema(op_type, opset, "")
    except defs.SchemaError:
        return False
    return True
