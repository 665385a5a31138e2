"""The package tree shows the pipeline: the README's map matches it, folders stay small,
each stage says what goes in and what comes out, tests mirror it, long modules say why."""

from __future__ import annotations

import ast
import fnmatch
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ortbridge"
#: Lines past which a module's docstring must give its reason.
LONG = 430
#: The most modules a folder holds.
FOLDER = 15
#: The top level: the public modules and the torch-facing core, nothing else.
TOP = {
    "__init__.py", "__main__.py", "module.py", "losses.py", "adapters.py", "exceptions.py",
    "examples.py", "_gradcheck.py", "_call_checks.py", "_module_weights.py", "_bridge.py",
    "_function.py", "_torch_op.py", "_onnx_export.py", "_adapter_format.py",
}  # fmt: skip
#: The pipeline's stages: each package's docstring says what goes in and what comes out.
STAGES = [
    "_prepare", "_engines/training_agent", "_engines/onnxruntime",
    "_engines/onnxruntime/passes", "_runtime", "_cli",
]  # fmt: skip
#: The README's map abbreviates the optimiser's folder.
ABBREVIATED = {"passes/": "_engines/onnxruntime/passes/"}


def _modules() -> set[str]:
    return {
        str(p.relative_to(PACKAGE))
        for p in PACKAGE.rglob("*.py")
        if p.name != "__init__.py" or p.parent.name == "_engines"
    }


def _map_entries() -> list[str]:
    text = (ROOT / "README.rst").read_text()
    section = text.split("\nLayout\n------\n", 1)[1]
    entries = re.findall(r"``([\w/*.]+\.py|[\w/]+/)``", section)
    for short, full in ABBREVIATED.items():
        entries = [full + e[len(short) :] if e.startswith(short) else e for e in entries]
    return entries


def test_every_module_is_on_the_map_and_every_entry_exists():
    modules = _modules()
    covered = set()
    for entry in _map_entries():
        if entry.endswith("/"):
            found = {m for m in modules if m.startswith(entry)}
        else:
            found = set(fnmatch.filter(modules, entry))
        assert found, f"README's module map lists {entry}, which is not in the tree"
        covered |= found
    assert modules - covered == set(), "modules missing from README's module map"


def test_the_top_level_holds_the_public_modules_the_core_and_one_folder_per_stage():
    assert {p.name for p in PACKAGE.glob("*.py")} == TOP
    for folder in [p for p in PACKAGE.rglob("*") if p.is_dir() and p.name != "__pycache__"]:
        modules = [m for m in folder.glob("*.py") if m.name != "__init__.py"]
        assert len(modules) <= FOLDER, f"{folder.relative_to(ROOT)} holds {len(modules)} modules"
        init = folder / "__init__.py"
        assert init.is_file(), f"{folder.relative_to(ROOT)} is not a package"
        assert ast.get_docstring(ast.parse(init.read_text())), f"{init} says nothing"


def test_each_stage_says_what_goes_in_and_what_comes_out():
    for stage in STAGES:
        doc = ast.get_docstring(ast.parse((PACKAGE / stage / "__init__.py").read_text()))
        assert re.search(r"\bIn:", doc) and re.search(r"\bOut:", doc), stage


def test_tests_mirror_the_tree():
    folders = [p for p in (ROOT / "tests").iterdir() if p.is_dir() and any(p.glob("test_*.py"))]
    assert folders, "the tests sit in one flat folder"
    for folder in folders:
        package = [PACKAGE / folder.name, PACKAGE / f"_{folder.name}"]
        assert any(p.is_dir() for p in package), f"tests/{folder.name} mirrors no package"


def test_docstring_examples_and_gallery_import_public_modules_only():
    private = re.compile(r"(?:from|import)\s+ortbridge(?:\.\w+)*\._\w+|from ortbridge import _")
    for path in PACKAGE.rglob("*.py"):
        examples = "\n".join(
            line for line in path.read_text().splitlines() if line.lstrip().startswith(">>>")
        )
        assert not private.search(examples), f"{path.relative_to(ROOT)}'s example"
    for path in (ROOT / "docs" / "examples").glob("*.py"):
        assert not private.search(path.read_text()), f"{path.relative_to(ROOT)}"


def test_long_modules_say_why():
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        if text.count("\n") > LONG:
            doc = ast.get_docstring(ast.parse(text)) or ""
            assert re.search(r"\bone module\b|\bstays?\b", doc), (
                f"{path.relative_to(ROOT)} has {text.count(chr(10))} lines and no reason"
            )


def test_the_readmes_are_valid_restructuredtext():
    """GitHub and PyPI render them: a malformed table shows as raw text."""
    import io

    import pytest

    docutils_core = pytest.importorskip("docutils.core")
    for path in (ROOT / "README.rst", ROOT / "benchmarks" / "README.rst"):
        errors = io.StringIO()
        docutils_core.publish_doctree(
            path.read_text(),
            source_path=str(path),
            settings_overrides={"report_level": 3, "halt_level": 5, "warning_stream": errors},
        )
        assert not errors.getvalue(), f"{path.relative_to(ROOT)}:\n{errors.getvalue()}"
