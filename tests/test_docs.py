"""The Sphinx site builds with warnings as errors, offline and quickly, and its
API reference covers every public name."""

from __future__ import annotations

import html
import re
import runpy
import subprocess
import sys
import time
from pathlib import Path

import pytest

import trio_redis_finalize

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("html")
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-E", "-q", "-b", "html",
         "-d", str(out / ".doctrees"), str(DOCS), str(out)],
        capture_output=True, text=True, timeout=90, cwd=ROOT,
    )
    took = time.monotonic() - start
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stderr.strip() == "", proc.stderr  # -q: only warnings would print, and -W fails them
    assert took < 60, f"the docs build took {took:.0f} s"
    return out


def text(site: Path, page: str) -> str:
    raw = (site / f"{page}.html").read_text()
    raw = re.sub(r"<script.*?</script>|<style.*?</style>", "", raw, flags=re.S)
    return html.unescape(re.sub(r"<[^>]+>", "", raw))


def test_build_needs_no_network() -> None:
    """No intersphinx (or any extension that fetches): the build runs offline."""
    conf = runpy.run_path(str(DOCS / "conf.py"))
    assert set(conf["extensions"]) <= {"sphinx.ext.autodoc", "sphinx.ext.napoleon"}
    assert not conf.get("intersphinx_mapping")


def test_api_reference_documents_every_public_name(site: Path) -> None:
    api = text(site, "api")
    for name in trio_redis_finalize.__all__:
        assert f"trio_redis_finalize.{name}" in api, name
    for name in ("trio_redis_finalize.prometheus.register",
                 "trio_redis_finalize.otel.instrument_handler",
                 "trio_redis_finalize.pytest_plugin.consume_until",
                 "trio_redis_finalize.testing.RedisServer"):
        assert name in api, name
    # docstrings, not only names: a sentence of open_consumer's and of Delivery's
    assert "lets in-flight handlers finish within" in api
    assert "an idempotency key" in api


def test_every_page_is_in_the_table_of_contents(site: Path) -> None:
    index = (site / "index.html").read_text()
    pages = [p.stem for p in DOCS.glob("*.rst") if p.stem != "index" and not p.stem.startswith("_")]
    assert {"getting_started", "guide", "crash_costs", "api", "changelog"} <= set(pages)
    for page in pages:
        assert f'href="{page}.html"' in index, page


def test_pages_carry_the_readme_sections_and_the_changelog(site: Path) -> None:
    readme = (ROOT / "README.rst").read_text()
    titles = re.findall(r"^(\S[^\n]*)\n-{3,}$", readme, flags=re.M)
    assert "Comparison with other libraries" in titles and "Testing your own code" in titles
    built = " ".join(text(site, p.stem) for p in DOCS.glob("*.rst"))
    for title in titles:
        assert title in built, f"README section {title!r} is on no page"
    assert "0.1.0" in text(site, "changelog")
