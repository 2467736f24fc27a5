"""Sphinx configuration of the disttensor documentation.

Build it from the repository root with::

    sphinx-build -W -b html docs docs/_build/html

The pages are Markdown (MyST); the API reference comes from the numpydoc
docstrings. The figure of the concepts page is drawn by ``gen_figures.py``
(matplotlib, Agg backend) at the start of every build, into ``docs/_generated/``.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # the packages, when they are not installed
sys.path.insert(0, HERE)

import gen_figures  # noqa: E402

import disttensor  # noqa: E402

gen_figures.main(os.path.join(HERE, "_generated"))

project = "disttensor"
author = "the disttensor developers"
copyright = "the disttensor developers"  # noqa: A001
version = release = disttensor.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.intersphinx",
    "numpydoc",
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]
templates_path: list[str] = []
html_static_path: list[str] = []
html_theme = "alabaster"
html_theme_options = {"description": "Distributed N-D arrays and CNN layers over MPI"}
html_title = "disttensor"

# MyST: heading anchors so that Markdown links like [x](page.md#a-heading) resolve,
# and the colon fences used for admonitions.
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence", "dollarmath"]

# autodoc / autosummary: the reference pages list every name explicitly.
autosummary_generate = False
autodoc_default_options = {"member-order": "bysource"}
autodoc_typehints = "none"  # the numpydoc Parameters sections carry the types
# disttensor_nn.torch needs PyTorch (an optional extra): without it, its pages are built
# from its docstrings with torch mocked
autodoc_mock_imports: list[str] = [] if importlib.util.find_spec("torch") else ["torch"]

# numpydoc: parse the docstrings, no per-class member tables (the reference pages
# list the members), no validation at build time.
numpydoc_show_class_members = False
numpydoc_class_members_toctree = False
numpydoc_xref_param_type = False
numpydoc_attributes_as_param_list = True

intersphinx_mapping = {
    "python": ("https://docs.python.org/3", None),
    "numpy": ("https://numpy.org/doc/stable", None),
}
# The build must work offline (CI machines without network): intersphinx then only
# warns, so it stays off unless asked for.
if not os.environ.get("DISTTENSOR_DOCS_INTERSPHINX"):
    extensions.remove("sphinx.ext.intersphinx")

nitpicky = False

# Docstrings write shapes as in NumPy's documentation, "(N, C, *S)": a star before a
# one-letter name means "any number of dimensions", not reStructuredText emphasis.
_SHAPE_STAR = re.compile(r"(?<=[\s(,\[])\*(?=[A-Z][a-z]?\b)")


def _escape_shape_stars(app, what, name, obj, options, lines):
    for i, line in enumerate(lines):
        parts = line.split("``")
        parts[::2] = [_SHAPE_STAR.sub(r"\\*", p) for p in parts[::2]]  # outside literals
        lines[i] = "``".join(parts)


def setup(app):
    app.connect("autodoc-process-docstring", _escape_shape_stars, priority=400)
