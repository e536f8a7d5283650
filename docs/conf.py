"""Sphinx configuration: ``python3 dev.py docs`` builds ``docs/_build/html``
with warnings as errors.  No extension reaches the network (no intersphinx),
so the build runs offline."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the package, also when it is not installed

from trio_redis_finalize import __version__  # noqa: E402

project = "trio_redis_finalize"
author = "trio_redis_finalize contributors"
copyright = "trio_redis_finalize contributors"
version = release = __version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
]

exclude_patterns = ["_build"]
root_doc = "index"
language = "en"

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_preserve_defaults = True
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "alabaster"
html_title = f"trio_redis_finalize {release}"
html_show_sourcelink = False


def _list_other_pages(app: object, docname: str, source: list[str]) -> None:
    """Put every other page of ``docs/`` (e.g. ``scaling_out.rst``) in the
    index's table of contents, before the API reference, so that a page added
    later needs no edit here (and none is left out of every toctree, which
    ``-W`` would turn into an error)."""
    if docname != "index":
        return
    listed = {line.strip() for line in source[0].splitlines() if line.startswith("   ")}
    here = Path(__file__).resolve().parent
    extra = sorted(p.stem for p in here.glob("*.rst") if p.stem not in listed | {"index"}
                   and not p.stem.startswith("_"))
    if extra:
        source[0] = source[0].replace("\n   api\n", "".join(f"\n   {n}" for n in extra) + "\n   api\n", 1)


def _readme_paths(app: object, relative_path: Path, parent_docname: str, content: list[str]) -> None:
    """The README, included by the index, names its images from the project's
    root (``docs/_static/...``, as a repository page shows them); here they are
    relative to ``docs/``."""
    if relative_path.name == "README.rst":
        content[0] = content[0].replace(".. image:: docs/_static/", ".. image:: _static/")


def setup(app: object) -> dict[str, object]:
    app.connect("source-read", _list_other_pages)  # type: ignore[attr-defined]
    app.connect("include-read", _readme_paths)  # type: ignore[attr-defined]
    return {"parallel_read_safe": True}
