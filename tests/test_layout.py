"""The README's module map matches the tree, and long modules say why they are long."""

from __future__ import annotations

import ast
import fnmatch
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ortbridge"
#: Lines past which a module's docstring must give its reason.
LONG = 430


def _modules() -> set[str]:
    return {
        str(p.relative_to(PACKAGE))
        for p in PACKAGE.rglob("*.py")
        if p.name != "__init__.py" or p.parent.name == "_engines"
    }


def _map_entries() -> list[str]:
    text = (ROOT / "README.rst").read_text()
    section = text.split("\nLayout\n------\n", 1)[1]
    return re.findall(r"``([\w/*.]+\.py|[\w/]+/)``", section)


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
