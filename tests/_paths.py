"""Where the tests and the project live, for tests in any folder of ``tests/``."""

from pathlib import Path

TESTS = Path(__file__).resolve().parent
"""``tests/``: the helper processes (``_*_proc.py``) and ``data/``."""
ROOT = TESTS.parent
"""The project: ``README.rst``, ``docs/``, ``benchmarks/``."""
