"""The suite as a first run meets it: ``python3 dev.py test`` runs the tests in
parallel unless told otherwise, and no property test has a per-example
deadline a loaded machine can break."""

from __future__ import annotations

import importlib.util
from types import ModuleType

import pytest
from _paths import ROOT
from hypothesis import HealthCheck, settings


def _dev() -> ModuleType:
    spec = importlib.util.spec_from_file_location("dev", ROOT / "dev.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_dev_test_runs_in_parallel_unless_told_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    dev = _dev()
    monkeypatch.delenv("TRF_TEST_WORKERS", raising=False)
    default = dev.test_workers([])
    assert default[0] == "-n" and int(default[1]) >= 4 and default[2:] == ["--dist", "worksteal"], default
    assert dev.test_workers(["-q", "tests/core/test_keys.py", "-k", "name"]) == default
    for chosen in (["-n", "0"], ["-n3"], ["--numprocesses=2"], ["-p", "no:xdist"], ["-pno:xdist"],
                   ["--pdb"], ["-q", "-p", "no:randomly", "-p", "no:xdist", "tests/core/test_keys.py"]):
        assert dev.test_workers(chosen) == [], chosen
    monkeypatch.setenv("TRF_TEST_WORKERS", "6")
    assert dev.test_workers([])[:2] == ["-n", "6"]


def test_property_tests_have_no_deadline() -> None:
    """tests/conftest.py's profile: an example a loaded machine made slow is
    not a failure (a Hypothesis deadline in test_backoff.py failed a first run)."""
    assert settings.default.deadline is None
    assert HealthCheck.too_slow in settings.default.suppress_health_check
