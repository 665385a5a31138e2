"""Declared shapes checked against what the graph computes: the computed ones win.

A file declares shapes it does not need to run: its graph outputs', the
``value_info`` of intermediate tensors, the inputs and outputs of Loop, Scan
and If bodies. onnxruntime trusts what the nodes compute when it runs the
graph (it warns and merges a declaration it contradicts), so a wrong one
goes unnoticed until a gradient graph is built on it: the seed of an
output's gradient gets the declared shape (an old torch exporter's CNN+LSTM
declares its (N, T, C) output as (N, C), and its backward then refused the
gradient torch passed), and a wrong intermediate declaration spreads to
what onnx's shape inference derives from it.

:func:`declarations_as_computed` (run by :func:`._normalize.normalize` on
ortbridge's own copy) settles each declaration from what the graph computes:

1. onnx's shape inference from the graph's inputs and initializers alone
   (every declaration but the graph inputs' removed first). A rank it
   computes, a size it computes where the declaration has another, an axis it
   ties to a named axis of an input: these replace the declaration.
2. Where inference cannot tell (it loses track of a size behind ``Shape``
   arithmetic, or computes another size than declared: it can be the one
   that is wrong, as it was for an STFT's frequency bins), the main graph's
   shapes are inferred again with the inputs' unknown axes of a stand-in size,
   and what that does not confirm is run once in onnxruntime on stand-in
   inputs (:data:`STAND_IN_SIZES`, in a child process: :func:`_observed`): a
   declared size the run does not give becomes the inferred one if the run
   gives that, else unknown.
3. A body's inputs are checked against the tensors the node binds them to
   (a Loop's carried values, a Scan's states and slices); the shapes inside
   bodies, which no run shows, against inference only (a contradicted size
   becomes unknown, one inference cannot tell stays).

An unknown axis constrains nothing: a declaration is only ever replaced by
what is known to be computed, or loosened. What was replaced is returned, for
``python -m ortbridge inspect`` to show.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import os
import pickle
import select
import signal
import time
import warnings

import numpy as np
import onnx

from ._load import tensor_spec
from ._onnx_utils import attr, np_dtype

#: Sizes given to the graph inputs' unknown axes for the run of step 2: the
#: second where the first fails (a patch embedding leaves nothing of 3 pixels).
#: Not 1 or 2, sizes a wrongly static declaration often has.
STAND_IN_SIZES = (3, 32)


@dataclasses.dataclass(frozen=True)
class WrongShape:
    """A declaration the graph contradicts, and what it was replaced by.

    Shapes are tuples of sizes, axis names, or None for an unknown size.
    """

    name: str
    #: ``graph output``, ``value_info``, or where in a body (``input of Loop
    #: 'loop_1' body``).
    where: str
    declared: tuple
    computed: tuple


def declarations_as_computed(model: onnx.ModelProto) -> list[WrongShape]:
    """Replace, in ``model`` (ortbridge's own copy), the declared shapes the graph
    contradicts (see the module's docstring); the replacements made."""
    scopes = _scopes(model.graph)
    entries = [
        (index, where, value)
        for index, scope in enumerate(scopes)
        for where, value in _declarations(scope)
        if _has_shape(value)
    ]
    if not entries:
        return []
    found = []
    stripped = onnx.ModelProto()
    stripped.CopyFrom(model)
    stripped_scopes = _scopes(stripped.graph)
    for scope in stripped_scopes:
        graph = scope.graph
        # An entry naming an initializer or an input would hide its shape from
        # inference once cleared: such entries go.
        given = {i.name for i in graph.initializer} | {i.name for i in graph.input}
        kept = [value for value in graph.value_info if value.name not in given]
        if len(kept) < len(graph.value_info):
            del graph.value_info[:]
            graph.value_info.extend(kept)
        for where, value in _declarations(scope):
            if not where.startswith("input") and _has_shape(value):
                value.type.tensor_type.ClearField("shape")
    # Bodies' inputs stay declared (onnx infers a body from them, not from the
    # node's inputs); one the node's input contradicts is replaced, and the
    # graph inferred again (a body in that body is then checked against it).
    for _ in range(len(scopes)):
        known = _inferred(stripped, len(scopes))
        replaced = _body_inputs_as_bound(scopes, stripped_scopes, known)
        found.extend(replaced)
        if not replaced:
            break
    named = {
        d.dim_param
        for value in model.graph.input
        for d in value.type.tensor_type.shape.dim
        if d.HasField("dim_param")
    }
    produced = {out for node in model.graph.node for out in node.output}
    unsettled = {}
    for index, where, value in entries:
        if where.startswith("input"):
            continue
        declared, computed = _dims(value), known[index].get(value.name)
        if (
            index == 0
            and value.name in produced
            and value.type.tensor_type.elem_type
            and _unsettled(declared, computed, named)
        ):
            unsettled.setdefault(value.name, declared)
    observed = {}
    if unsettled:
        # Inference on inputs of stand-in sizes first: what it computes as
        # declared needs no run (YOLOv8's box sizes, after Shape arithmetic).
        at_size = _inferred_at(stripped, STAND_IN_SIZES[0])
        for name, declared in unsettled.items():
            shape = at_size.get(name)
            if shape is not None and len(shape) == len(declared):
                if all(not isinstance(d, int) or d == c for d, c in zip(declared, shape)):
                    observed[name] = shape
        run = [name for name in unsettled if name not in observed]
        if run:
            observed.update(_observed(stripped, run))
    for index, where, value in entries:
        if where.startswith("input"):
            continue
        declared = _dims(value)
        seen = observed.get(value.name) if index == 0 else None
        new = _settled(declared, known[index].get(value.name), seen, named)
        if new is not None:
            _declare(value, new)
            found.append(WrongShape(value.name, _label(scopes[index], where), declared, new))
    return found


@dataclasses.dataclass
class _Scope:
    graph: onnx.GraphProto
    #: Index of the enclosing scope (None for the main graph) and the node holding the body.
    parent: int | None = None
    owner: onnx.NodeProto | None = None


def _scopes(graph: onnx.GraphProto) -> list[_Scope]:
    """The main graph and every body, breadth first (the same order for a copy)."""
    scopes = [_Scope(graph)]
    for index, scope in enumerate(scopes):  # grows while read
        for node in scope.graph.node:
            for a in node.attribute:
                bodies = [a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)
                scopes.extend(_Scope(body, index, node) for body in bodies)
    return scopes


def _declarations(scope: _Scope):
    """(where, value) of the shapes ``scope`` declares besides the main graph's inputs."""
    for value in scope.graph.output:
        yield "output", value
    for value in scope.graph.value_info:
        yield "value_info", value
    if scope.owner is not None:
        for position, value in enumerate(scope.graph.input):
            yield f"input {position}", value


def _label(scope: _Scope, where: str) -> str:
    if scope.owner is None:
        return "graph output" if where == "output" else where
    owner = scope.owner
    kind = where.split()[0]
    return f"{kind} of {owner.op_type} {owner.name or owner.output[0]!r} body"


def _has_shape(value: onnx.ValueInfoProto) -> bool:
    return value.type.HasField("tensor_type") and value.type.tensor_type.HasField("shape")


def _dims(value: onnx.ValueInfoProto) -> tuple:
    return tensor_spec(value).shape or ()


def _declare(value: onnx.ValueInfoProto, dims: tuple) -> None:
    shape = value.type.tensor_type.shape
    del shape.dim[:]
    for size in dims:
        dim = shape.dim.add()
        if isinstance(size, int):
            dim.dim_value = size
        elif size is not None:
            dim.dim_param = size


def _inferred(model: onnx.ModelProto, n_scopes: int) -> list[dict]:
    """Per scope, the shapes onnx infers (sizes, names of axes; None where unknown,
    as for the names inference makes up): ``{}`` everywhere if it fails."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:  # a graph inference cannot handle still runs
        return [{} for _ in range(n_scopes)]
    known = []
    for scope in _scopes(inferred.graph):
        shapes = {init.name: tuple(init.dims) for init in scope.graph.initializer}
        values = [*scope.graph.input, *scope.graph.output, *scope.graph.value_info]
        for value in values:
            if _has_shape(value) and value.name not in shapes:
                shapes[value.name] = tuple(
                    None if isinstance(d, str) and d.startswith("unk__") else d
                    for d in _dims(value)
                )
        known.append(shapes)
    return known


def _inferred_at(model: onnx.ModelProto, size: int) -> dict:
    """The main graph's shapes onnx infers where the inputs' unknown axes have ``size``."""
    sized = onnx.ModelProto()
    sized.CopyFrom(model)
    for value in sized.graph.input:
        if _has_shape(value):
            for dim in value.type.tensor_type.shape.dim:
                if not dim.HasField("dim_value"):
                    dim.dim_value = size
    try:
        inferred = onnx.shape_inference.infer_shapes(sized, data_prop=True)
    except Exception:
        return {}
    graph = inferred.graph
    return {v.name: _dims(v) for v in [*graph.output, *graph.value_info] if _has_shape(v)}


def _lookup(scopes, known, index: int, name: str):
    """The inferred shape of ``name`` as scope ``index`` sees it (its own, or an
    enclosing scope's)."""
    while index is not None:
        if name in known[index]:
            return known[index][name]
        index = scopes[index].parent
    return None


def _body_inputs_as_bound(scopes, stripped_scopes, known) -> list[WrongShape]:
    """Loop and Scan body inputs declared against the shape of what the node binds
    to them, replaced in both copies; the replacements."""
    found = []
    for index, scope in enumerate(scopes):
        owner = scope.owner
        if owner is None or owner.domain not in ("", "ai.onnx"):
            continue
        for position, value in enumerate(scope.graph.input):
            if not _has_shape(value):
                continue
            bound = _bound(owner, position, lambda n, i=scope.parent: _lookup(scopes, known, i, n))
            declared = _dims(value)
            if bound is None:
                continue
            new = (
                bound
                if len(bound) != len(declared)
                else _settled(declared, bound, None, set(), strict=True)
            )
            if new is not None and new != declared:
                new = tuple(new)
                _declare(value, new)
                _declare(stripped_scopes[index].graph.input[position], new)
                found.append(WrongShape(value.name, _label(scope, "input"), declared, new))
    return found


def _bound(owner: onnx.NodeProto, position: int, shape_of):
    """The shape the node ``owner`` gives its body's input ``position`` (None if unknown)."""
    if owner.op_type == "Loop":
        # body: iteration number, condition, carried values; node: M, condition, carried values
        if position < 2 or position >= len(owner.input) or not owner.input[position]:
            return None
        return shape_of(owner.input[position])
    n_scan = attr(owner, "num_scan_inputs")
    if owner.op_type == "Scan" and n_scan is not None and position < len(owner.input):
        n_state = len(owner.input) - n_scan
        outer = shape_of(owner.input[position])
        if outer is None or position < n_state:
            return outer
        axes = attr(owner, "scan_input_axes") or [0] * n_scan
        axis = axes[position - n_state]
        axis = axis + len(outer) if axis < 0 else axis
        return outer[:axis] + outer[axis + 1 :] if 0 <= axis < len(outer) else None
    return None


def _unknown_rank(declared: tuple, computed) -> bool:
    # onnx infers rank 0 for an STFT it cannot size: that is not a rank.
    return computed is None or (len(computed) == 0 and len(declared) > 0)


def _unsettled(declared: tuple, computed, named: set) -> bool:
    """Whether inference alone leaves ``declared`` unchecked: unknown where it
    declares a size, or another size than declared (step 2 of the module)."""
    if _unknown_rank(declared, computed):
        return True
    if len(computed) != len(declared):
        return False
    return any(
        isinstance(d, int) and c != d and not (isinstance(c, str) and c in named)
        for d, c in zip(declared, computed)
    )


def _settled(declared: tuple, computed, observed, named: set, strict: bool = False):
    """The shape to declare in place of ``declared``, or None to keep it.

    ``computed``: inferred; ``observed``: what the run gave on stand-in inputs
    (None: no run); ``named``: the names of the graph inputs' axes.
    ``strict``: ``computed`` is known to be right (a body input's binding).
    """
    if _unknown_rank(declared, computed):
        if observed is None:
            return None
        if len(observed) != len(declared):
            return (None,) * len(observed)
        computed = (None,) * len(declared)
    elif len(computed) != len(declared):
        return tuple(computed)
    new = []
    for size, inferred, seen in zip(declared, computed, observed or [None] * len(declared)):
        if not isinstance(size, int) or inferred == size:
            new.append(size)
        elif isinstance(inferred, str) and (inferred in named or strict):
            new.append(inferred)  # it follows an input's axis
        elif observed is not None:
            new.append(size if seen == size else (inferred if inferred == seen else None))
        elif isinstance(inferred, int):
            new.append(inferred if strict else None)  # two sizes, no run to tell: unknown
        else:
            new.append(size)  # inference cannot tell, nor a run: kept
    new = tuple(new)
    return None if new == declared else new


def _observed(model: onnx.ModelProto, names: list[str]) -> dict[str, tuple]:
    """The shapes of tensors ``names`` when ``model`` (declarations stripped) runs in
    onnxruntime on stand-in inputs; ``{}`` where it cannot run.

    The run happens in a forked child process: on sizes the model was not
    made for, onnxruntime's kernels can kill the process (PP-OCRv4's
    recogniser, given an image 32 pixels high, divides by zero: SIGFPE). A
    child killed so is followed by one trying the next size. Where the
    platform cannot fork, nothing is run.
    """
    init_names = {init.name for init in model.graph.initializer}
    inputs = [value for value in model.graph.input if value.name not in init_names]
    if not hasattr(os, "fork") or not all(_has_shape(value) for value in inputs):
        return {}
    feeds = [_stand_in_feeds(inputs, size) for size in STAND_IN_SIZES]
    if any(f is None for f in feeds):
        return {}
    from .._runtime import _ort  # onnxruntime imported on first use, before the fork

    ort = _ort.runtime()
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    del probe.graph.output[:]
    probe.graph.output.extend(onnx.helper.make_empty_tensor_value_info(n) for n in names)
    data = probe.SerializeToString()
    while feeds:
        tried, shapes = _in_child(
            lambda started, feeds=feeds: _run(ort, data, names, feeds, started)
        )
        if shapes is not None:
            return {name: shape for name, shape in zip(names, shapes) if shape is not None}
        if tried == 0 or tried > len(feeds):  # no session, or ended by the timeout
            break
        feeds = feeds[tried:]  # the run of size ``tried`` killed the child
    return {}


#: Seconds the run of :func:`_observed` may take before its process is ended.
RUN_TIMEOUT = 120


def _stand_in_feeds(inputs, size: int) -> dict | None:
    rng = np.random.default_rng(0)
    feeds = {}
    for value in inputs:
        shape = [d if isinstance(d, int) and d >= 0 else size for d in _dims(value)]
        try:
            dtype = np_dtype(value.type.tensor_type.elem_type)
        except (KeyError, TypeError, ValueError):
            return None
        if dtype.kind == "f":
            feeds[value.name] = (0.5 * rng.standard_normal(shape)).astype(dtype)
        elif dtype.kind in "biu":  # ones: a valid index, a divisor, a mask that keeps
            feeds[value.name] = np.ones(shape, dtype=dtype)
        else:
            return None
    return feeds


def _run(ort, data: bytes, names: list[str], feeds: list[dict], started) -> list | None:
    """The shapes of ``names`` on the first of ``feeds`` the model runs on, or None;
    ``started()`` is called before each run."""
    options = ort.SessionOptions()
    options.log_severity_level = 4  # a failed run is an answer here, not an error
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    session = ort.InferenceSession(data, options, providers=["CPUExecutionProvider"])
    for feed in feeds:
        started()
        try:
            values = session.run(names, feed)
        except Exception:
            continue
        return [tuple(np.shape(v)) if isinstance(v, np.ndarray) else None for v in values]
    return None


def _in_child(work) -> tuple[int, object]:
    """``work(started)`` computed in a forked child: how many times the child
    called ``started`` (the number of runs it began; more than that if ended
    by :data:`RUN_TIMEOUT`), and the result (None if the child failed or was
    killed)."""
    read, write = os.pipe()
    with warnings.catch_warnings():
        # Python 3.12 warns that a fork of a threaded process may deadlock the
        # child: the child only runs onnxruntime, and is ended if it hangs.
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # the child: report, and leave without the parent's exit handlers
        code = 1
        try:
            os.close(read)
            # Quiet: a kernel killing the child is an answer, not a crash to report.
            faulthandler.disable()
            quiet = os.open(os.devnull, os.O_WRONLY)
            os.dup2(quiet, 1)
            os.dup2(quiet, 2)
            result = work(lambda: os.write(write, b"."))
            payload = memoryview(b"=" + pickle.dumps(result))
            while payload:
                payload = payload[os.write(write, payload) :]
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    received = bytearray()
    deadline = time.monotonic() + RUN_TIMEOUT
    timed_out = False
    with os.fdopen(read, "rb", buffering=0) as pipe:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([pipe], [], [], left)[0]:
                os.kill(pid, signal.SIGKILL)
                timed_out = True
                break
            chunk = os.read(pipe.fileno(), 1 << 16)
            if not chunk:
                break
            received += chunk
    _, status = os.waitpid(pid, 0)
    progress, _, payload = bytes(received).partition(b"=")
    if timed_out:
        return len(STAND_IN_SIZES) + 1, None
    if status != 0 or not payload:
        return len(progress), None
    return len(progress), pickle.loads(payload)
