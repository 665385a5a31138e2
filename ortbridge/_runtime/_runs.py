"""Running a session on torch tensors: DLPack hand-over, Dropout seeding.

Plain code over onnxruntime's private bindings (``onnxruntime.capi._pybind_state``,
present in the training build and in maintained onnxruntime alike): tensors
go in and come out without copies. :class:`InferenceGraph` is the plain
inference run a module uses in eval mode and under ``no_grad``.
"""

from __future__ import annotations

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


def to_ortvalues(tensors) -> object:
    """An ``OrtValueVector`` sharing the memory of ``tensors`` (contiguous)."""
    C = _capi()
    vector = C.OrtValueVector()
    vector.reserve(len(tensors))
    for t in tensors:
        if t.numel() == 0 or not t.is_contiguous():
            # onnxruntime reads only row-major strides, an empty tensor's included.
            t = t.contiguous() if t.numel() else t.new_empty(t.shape)
        if t.dtype == torch.bool:
            # torch exports bool as DLPack's kDLBool, which onnxruntime 1.19
            # refuses: hand it the same bytes as uint8, flagged bool.
            vector.push_back(to_dlpack(t.view(torch.uint8)), True)
        else:
            vector.push_back(to_dlpack(t), False)
    return vector


def from_ortvalues(vector) -> list[torch.Tensor]:
    """Tensors taking ownership of an ``OrtValueVector``'s values (no copy)."""
    tensors = vector.to_dlpacks(torch._C._from_dlpack)
    # DLPack has no bool: onnxruntime hands bool tensors over as uint8.
    for i in vector.bool_tensor_indices():
        tensors[i] = tensors[i].to(torch.bool)
    return tensors


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
        self._devices = [ort_device(device)] * len(self.output_names)
        self._run_options = _ort.runtime().RunOptions()

    def run(self, feeds: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        C = _capi()
        inputs = to_ortvalues([feeds[name] for name in self.input_names])
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
        return from_ortvalues(outputs)
