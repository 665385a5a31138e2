"""onnxruntime's failures in plain words: one translation for every call site.

onnxruntime reports a failure as its C++ text: a source path and line, a
function signature (pybind lambdas included), a status code, then the reason,
with the node named in one of half a dozen forms and types as mangled C++
names. :func:`translate` turns that into an ortbridge error naming the node
and op type of the user's graph (a gradient node ``<node>_Grad/<kernel>_k``
is traced back to the node it differentiates) and the reason alone.
"""

from __future__ import annotations

import re

import onnx

from ..exceptions import NotDifferentiableError, OnnxModelError, OrtBridgeError

_NODE_FORMS = (
    re.compile(r"node with name '([^']+)'"),
    re.compile(r"Name:'([^']+)'"),
    re.compile(r"[Nn]ode \(([^)\s]+)\)"),
    re.compile(r"In Node, \(\"([^\"]+)\""),
    re.compile(r"for node (\S+)"),
)
_STATUS = re.compile(r"\[ONNXRuntimeError\] : \d+ : (\w+) : ")
_SOURCE = re.compile(r"/?(?:[\w.-]+/)*[\w.-]+\.(?:cc|h|cpp|hpp):\d+ ")
_MANGLED = re.compile(r"N11onnxruntime17PrimitiveDataTypeI(\w)EE")
_CXX_TYPES = {"f": "float32", "d": "float64", "h": "uint8", "a": "int8", "l": "int64", "i": "int32"}
_PLAIN_STATUS = {
    "NOT_IMPLEMENTED": "no kernel",
    "INVALID_GRAPH": "an invalid graph",
    "INVALID_ARGUMENT": "an invalid argument",
    "FAIL": "a failure",
    "RUNTIME_EXCEPTION": "a runtime error",
}


#: The ``(in ...)`` tail :func:`plain` gives the runtime's line naming the node.
_RUNTIME_LINE = re.compile(r" \(in [^()]*(?:Non-zero status code|Name:)[^()]*\)$")


def plain(text: str) -> str:
    """``text`` without source paths, signatures and mangled names, on one line."""
    text = re.sub(r"\s+", " ", str(text)).strip()
    status = None
    for found in _STATUS.finditer(text):
        status = found
    if status is not None:
        text = text[status.end() :]
    if "Status Message: " in text:
        head, message = text.rsplit("Status Message: ", 1)
        text = f"{_drop_sources(message)} (in {_drop_sources(head).rstrip('. ')})"
    else:
        text = _drop_sources(text)
    text = _MANGLED.sub(lambda m: _CXX_TYPES.get(m.group(1), "this type"), text)
    return text.strip()


def status_of(text: str) -> str | None:
    """onnxruntime's status name (``NOT_IMPLEMENTED``, ...) in ``text``, if any."""
    found = _STATUS.search(str(text))
    return found.group(1) if found else None


def _drop_sources(text: str) -> str:
    """Remove ``file.cc:123 <signature>`` prefixes: the signature ends at its balanced ')'."""
    while True:
        found = _SOURCE.search(text)
        if found is None:
            return text
        rest = text[found.end() :]
        cut = _signature_end(rest)
        text = text[: found.start()] + rest[cut:].lstrip()


def _signature_end(text: str) -> int:
    depth, seen = 0, False
    for i, ch in enumerate(text):
        if ch in "(<":
            depth += 1
            seen = seen or ch == "("
        elif ch in ")>":
            depth = max(0, depth - 1)
            if depth == 0 and seen and ch == ")":
                end = i + 1
                while text.startswith(" const", end) or text.startswith(">", end):
                    end += 6 if text.startswith(" const", end) else 1
                return end
        elif ch == " " and depth == 0 and seen:
            return i
    return 0


def culprit(text: str, model: onnx.ModelProto | None):
    """``(node name, op type, gradient kernel or None)`` of the node ``text`` names, or None.

    A gradient node ``<node>_Grad/<Kernel>_k`` (the training build's naming)
    is traced back to ``<node>``, the node of ``model`` whose name is its
    longest prefix (the builder renames nodes it replaces by extending names).
    """
    text = str(text)
    nodes = {n.name: n for n in model.graph.node} if model is not None else {}
    for form in _NODE_FORMS:
        for found in form.finditer(text):
            name = found.group(1).rstrip("'.,")
            kernel = None
            if "_Grad/" in name:
                name, tail = name.split("_Grad/", 1)
                kernel = re.sub(r"_\d+$", "", tail.rsplit("/", 1)[-1])
            node = nodes.get(name)
            if node is None:
                prefixes = [n for n in nodes if n and name.startswith(n)]
                node = nodes[max(prefixes, key=len)] if prefixes else None
            if node is not None:
                return node.name, node.op_type, kernel
            if model is None or kernel:
                return name, None, kernel
    return None


def _at_node(found) -> str:
    """`` at node 'name' (op type T)`` for what :func:`culprit` found, or ""."""
    if found is None:
        return ""
    node, op_type, _ = found
    return f" at node {node!r}" + (f" (op type {op_type})" if op_type else "")


def translate(
    exc: BaseException,
    doing: str,
    model: onnx.ModelProto | None = None,
    *,
    refuse: str | None = None,
) -> OrtBridgeError:
    """An ortbridge error saying what onnxruntime could not do, where, and why.

    ``doing``: "build the gradient graph", "run the backward pass", ...
    ``refuse``: the engine's name when the failure means it cannot
    differentiate the graph (a :class:`NotDifferentiableError` naming the
    node, and pointing to the other engine).
    """
    text = str(exc)
    reason = plain(text)
    found = culprit(text, model)
    where = _at_node(found)
    node = op_type = None
    if found is not None:
        node, op_type, kernel = found
        if kernel:
            where += f", in its gradient kernel {kernel}"
        # The runtime's own line ("Non-zero status code returned while
        # running Gather node. Name: ...") says again what ``where`` says.
        reason = _RUNTIME_LINE.sub("", reason)
    status = status_of(text)
    asked = _ALLOCATION.search(text)
    if asked:
        size = int(asked.group(1))
        reason = f"out of memory: the node asked for {size} bytes ({size / 2**30:.3g} GiB)"
    elif status in _PLAIN_STATUS and status != "FAIL":
        reason = f"{_PLAIN_STATUS[status]}: {reason}"
    if refuse is None:
        return OrtBridgeError(f"onnxruntime could not {doing}{where}: {reason}")
    other = "onnxruntime" if refuse == "training-agent" else "training-agent"
    return NotDifferentiableError(
        f"the {refuse} engine cannot train this graph{where}: onnxruntime could not {doing}: "
        f"{reason}",
        node=node,
        op_type=op_type,
        hint=f'. backend="{other}" (or "auto") may train it, or freeze what lies before it',
    )


_ALLOCATION = re.compile(r"Failed to allocate memory for requested buffer of size (\d+)")
_UNREGISTERED = re.compile(r"([\w.]+):(\w+)\(-?\d+\) is not a registered function/op")


def load_error(exc: BaseException, model: onnx.ModelProto | None, what: str) -> OnnxModelError:
    """An :class:`OnnxModelError` saying why onnxruntime could not load ``what``."""
    text = str(exc)
    unregistered = _UNREGISTERED.search(text)
    if unregistered:
        domain, op_type = unregistered.groups()
        return OnnxModelError(
            f"onnxruntime cannot load {what}: it has no operator {op_type!r} in domain "
            f"{domain!r}. Custom operators need their library: "
            "options.register_custom_ops_library(path), then session_options=options"
        )
    where = _at_node(culprit(text, model))
    return OnnxModelError(f"onnxruntime cannot load {what}{where}: {plain(text)}")
