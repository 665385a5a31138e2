"""Sphinx configuration of ortbridge's documentation.

Build from the repository root (the gallery's examples run during the build)::

    python -m sphinx -W --keep-going -b html docs docs/_build/html
"""

from __future__ import annotations

import os
import re
import sys

import ortbridge

# The gallery's sort key lives next to this file (_gallery_order.py).
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

project = "ortbridge"
author = "the ortbridge developers"
copyright = "the ortbridge developers"
release = ortbridge.__version__
version = ".".join(release.split(".")[:2])

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",
    "numpydoc",
    "sphinx_gallery.gen_gallery",
]

exclude_patterns = ["_build", "examples"]
templates_path: list[str] = []
html_static_path: list[str] = []
html_theme = "furo"
html_title = f"ortbridge {release}"

# API reference: numpydoc renders the docstrings; members are listed by the
# autodoc directives of api.rst, not by numpydoc's autosummary tables.
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
# Names the signatures spell as written: numpy's array-like (not its expanded
# Union), and names imported for type checkers only.
autodoc_type_aliases = {
    "ArrayLike": "numpy.typing.ArrayLike",
    "OnnxModule": "ortbridge.OnnxModule",
    "onnxruntime.SessionOptions": "onnxruntime.SessionOptions",
}
autodoc_default_options = {"exclude-members": "__init__"}
numpydoc_show_class_members = False
numpydoc_show_inherited_class_members = False
numpydoc_class_members_toctree = False
numpydoc_validation_checks: set[str] = set()
numpydoc_xref_param_type = False

# Every cross-reference must resolve, except to packages this site does not
# document (no intersphinx: the build works offline).
nitpicky = True
nitpick_ignore_regex = [
    (r"py:.*", r"(onnx|numpy|torch|os|pathlib|collections|sklearn|onnxruntime)(\..*)?"),
]
nitpick_ignore = [
    # gradcheck's report types are defined in a private module; the report is
    # documented as ortbridge.GradcheckReport, its entries in its docstring.
    ("py:class", "ortbridge._gradcheck.GradcheckReport"),
    ("py:class", "ortbridge._gradcheck.GradcheckEntry"),
]

sphinx_gallery_conf = {
    "examples_dirs": "examples",
    "gallery_dirs": "auto_examples",
    "filename_pattern": r"/plot_",
    "within_subsection_order": "_gallery_order.ExampleOrder",
    "download_all_examples": False,
    "remove_config_comments": True,
    "show_memory": False,
    "min_reported_time": 1,
    # A figure per example, drawn with matplotlib's non-interactive backend.
    "image_scrapers": ("matplotlib",),
    "matplotlib_animations": False,
}


def _alias_names(app, what, name, obj, options, signature, return_annotation):
    """Sphinx 9 writes an alias inside a union (``ArrayLike | None``) as
    ``TypeAliasForwardRef('numpy.typing.ArrayLike')``: keep the name alone."""

    def plain(text):
        return text and re.sub(r"TypeAliasForwardRef\('([^']*)'\)", r"\1", text)

    return plain(signature), plain(return_annotation)


def setup(app):
    app.connect("autodoc-process-signature", _alias_names)
