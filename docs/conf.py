"""Sphinx configuration of the zinf_jax documentation.

Build (what .ci/run does)::

    .venv/bin/pip install -e ".[docs]"
    .venv/bin/sphinx-build -W --keep-going -n -b html docs docs/_build/html

The reference pages (API, configuration, DeepSpeed keys, CLI, errors, package map, notes) are
generated at build time by ``docs/_ext/zinf_docs.py`` from the code itself: nothing is written twice.
"""
from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "_ext"))
sys.path.insert(0, os.path.dirname(HERE))  # the package, when the docs are built from a source tree

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # autodoc imports the package; no accelerator is needed

import zinf_jax  # noqa: E402

project = "zinf_jax"
author = "The zinf_jax authors"
copyright = "2026, The zinf_jax authors"
release = version = zinf_jax.__version__  # read from the package metadata (pyproject.toml)

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "zinf_docs",
]

source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]
myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_format = "short"
autodoc_preserve_defaults = True
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

# Nitpicky for the package's own references (``-n``): a reference to a zinf_jax name that does not exist
# fails the build (zinf_docs resolves those that do). Third-party names are not checked (no intersphinx:
# the build must not need the network).
nitpick_ignore_regex = [
    (r"py:.*", r"(jax|jaxlib|flax|nnx|nn|optax|numpy|np|jnp|orbax|ocp|tensorstore|ts|safetensors|typing"
               r"|collections|concurrent|os|pathlib|threading|dataclasses|enum|abc|argparse|re|types)(\..*)?"),
    (r"py:.*", r"(Any|Callable|Iterable|Iterator|Mapping|Sequence|Path|PathLike|Mesh|PartitionSpec|NamedSharding"
               r"|Sharding|Array|ArrayLike|DTypeLike|ShapeDtypeStruct|Lowered|Module|State|Rngs|Variable|Filter"
               r"|GradientTransformation|PyTree|ndarray|dtype|Future|Executor|Lock|Event|Thread)"),
    (r"py:.*", r"(optional|callable|pytree|array|arrays|default|None|Ellipsis|.*\.\.\..*)"),
]

html_theme = "alabaster"
html_title = f"zinf_jax {release}"
html_static_path: list[str] = []
