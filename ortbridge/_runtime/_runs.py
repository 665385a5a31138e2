"""Running a session on torch tensors: the hand-over of memory, Dropout seeding.

Plain code over onnxruntime's private bindings (``onnxruntime.capi._pybind_state``,
present in the training build and in maintained onnxruntime alike): tensors
go in and come out without copies. Inputs are wrapped in place
(:func:`to_ortvalues`: the caller holds them until the run ends), outputs
come back over DLPack. :class:`InferenceGraph` is the plain
inference run a module uses in eval mode and under ``no_grad``.
"""

from __future__ import annotations

import numpy as np
import onnx
import torch
from torch.utils.dlpack import to_dlpack

from ..exceptions import OrtBridgeError
from . import _ort
from ._errors import translate
from ._sessions import _session
from ._threads import UNPINNED

_CAPI = None


# Ops drawing from onnxruntime's global generator at every run (Dropout's
# masks): a run reseeds it from torch's generator, so that torch's state
# (``torch.manual_seed``) decides the masks, in a new process too.
DRAWING_OPS = frozenset({"Dropout", "BitmaskDropout", "BiasDropout", "BitmaskBiasDropout"})


def draws(model: onnx.ModelProto) -> bool:
    """Whether a run of ``model`` draws from onnxruntime's generator."""
    return any(node.op_type in DRAWING_OPS for node in model.graph.node)


def torch_seed() -> torch.Tensor:
    """A seed for onnxruntime's generator from torch's (a CPU draw: no device sync)."""
    return torch.randint(2**31 - 1, ())


def _capi():
    """``onnxruntime.capi._pybind_state``, cached: it is needed on every call."""
    global _CAPI
    if _CAPI is None:
        _CAPI = _ort.capi()
    return _CAPI


def ort_device(device: torch.device):
    C = _capi()
    if device.type == "cuda":
        return C.OrtDevice(C.OrtDevice.cuda(), C.OrtDevice.default_memory(), device.index or 0)
    if device.type == "cpu":
        return C.OrtDevice(C.OrtDevice.cpu(), C.OrtDevice.default_memory(), 0)
    raise OrtBridgeError(f"onnxruntime cannot run on torch device {device}: use cpu or cuda")


#: The element types onnxruntime wraps from a pointer (as numpy names them).
_WRAPPED = {
    torch.float32: np.dtype(np.float32),
    torch.float64: np.dtype(np.float64),
    torch.float16: np.dtype(np.float16),
    torch.int64: np.dtype(np.int64),
    torch.int32: np.dtype(np.int32),
    torch.int16: np.dtype(np.int16),
    torch.int8: np.dtype(np.int8),
    torch.uint8: np.dtype(np.uint8),
    torch.bool: np.dtype(np.bool_),
}
_DEVICES: dict = {}


def to_ortvalues(tensors, device=None) -> tuple[object, list]:
    """An ``OrtValueVector`` over the memory of ``tensors``, and the tensors it reads.

    The values do not own that memory: the caller keeps the list returned
    alive until the run ends (a contiguous copy made here is in it). Wrapping
    a pointer costs less than a DLPack capsule's hand-over (90 tensors: about
    40 against 67 us); a graph output that is a graph input comes back over
    that input's memory, which :func:`fed_outputs` hands back as the fed
    tensor. ``device``: every tensor's ``OrtDevice`` where the caller knows it.
    Element types numpy has no name for (bfloat16) go over DLPack.
    """
    # Only the pointer and the shape are read: row-major strides are a must.
    held = [t if t.is_contiguous() else t.contiguous() for t in tensors]
    vector = _capi().OrtValueVector()
    try:
        types = [_WRAPPED[t.dtype] for t in held]
    except KeyError:
        vector.reserve(len(held))
        for t in held:
            t = t if t.numel() else t.new_empty(t.shape)  # an empty one's strides too
            if t.dtype == torch.bool:
                # torch exports bool as DLPack's kDLBool, which onnxruntime 1.19
                # refuses: hand it the same bytes as uint8, flagged bool.
                vector.push_back(to_dlpack(t.view(torch.uint8)), True)
            else:
                vector.push_back(to_dlpack(t), False)
        return vector, held
    if device is None:
        devices = [_DEVICES.get(t.device) or _device_of(t.device) for t in held]
    else:
        devices = [device] * len(held)
    shapes, pointers = [t.shape for t in held], [t.data_ptr() for t in held]
    wrapped = held
    if 0 in pointers:  # an empty tensor has none: one of its own, never read
        wrapped = list(held)
        for i, t in enumerate(held):
            if not pointers[i]:
                wrapped[i] = t.new_empty(1)
                pointers[i] = wrapped[i].data_ptr()
        held += wrapped  # held past the positions of the tensors fed
    vector.push_back_batch(wrapped, pointers, types, shapes, devices)
    return vector, held


def _device_of(device: torch.device):
    found = _DEVICES[device] = ort_device(device)
    return found


def fed_outputs(input_names, output_names) -> list[tuple[int, int]]:
    """(output position, input position) of each output that is an input by name."""
    position = {name: i for i, name in enumerate(input_names)}
    return [(o, position[n]) for o, n in enumerate(output_names) if n in position]


def from_ortvalues(vector) -> list[torch.Tensor]:
    """Tensors taking ownership of an ``OrtValueVector``'s values (no copy)."""
    tensors = vector.to_dlpacks(torch._C._from_dlpack)
    # DLPack has no bool: onnxruntime hands bool tensors over as uint8.
    for i in vector.bool_tensor_indices():
        tensors[i] = tensors[i].to(torch.bool)
    return tensors


def _with_fed(outputs: list, fed_outputs, held) -> list:
    """``outputs`` with each one that is a graph input replaced by the tensor fed
    (a view of it: the run's value wraps that memory without owning it)."""
    for o, i in fed_outputs:
        outputs[o] = held[i].detach()
    return outputs


class SessionHolder:
    """A graph run by one session: :attr:`sessions` and :attr:`pinnings` as the engines have."""

    session = None
    pinning = None

    @property
    def sessions(self) -> list:
        """The onnxruntime sessions this graph runs."""
        return [self.session]

    @property
    def pinnings(self) -> list:
        """The pinning of each session's workers (None: left to the system)."""
        return [self.pinning]


class InferenceGraph(SessionHolder):
    """A plain inference session over a graph whose weights are inputs."""

    def __init__(
        self, model: onnx.ModelProto, device, session_options=None, providers=None, seeded=False
    ):
        self.session, self.pinning = _session(model, device, session_options, providers)
        self._model = model  # names the node of a run-time failure
        # A train-mode graph with Dropout: masks from a seed torch's generator draws.
        self.seeded = seeded and draws(model)
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.output_names = [o.name for o in self.session.get_outputs()]
        self._fed_outputs = fed_outputs(self.input_names, self.output_names)
        self._device = ort_device(device)
        self._devices = [self._device] * len(self.output_names)
        self._run_options = _ort.runtime().RunOptions()

    def run(self, feeds: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        C = _capi()
        inputs, held = to_ortvalues([feeds[name] for name in self.input_names], self._device)
        outputs = C.OrtValueVector()
        if self.seeded:
            C.set_seed(int(torch_seed()))
        try:
            with self.pinning or UNPINNED:
                self.session._sess.run_with_ortvaluevector(
                    self._run_options,
                    self.input_names,
                    inputs,
                    self.output_names,
                    outputs,
                    self._devices,
                )
        except Exception as exc:
            raise translate(exc, "run the graph", self._model) from exc
        return _with_fed(from_ortvalues(outputs), self._fed_outputs, held)
