"""The README's quick start runs as written."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.rst"


def _quick_start(title: str = "Quick start") -> str:
    text = README.read_text()
    section = text.split(f"{title}\n{'-' * len(title)}\n", 1)[1]
    m = re.search(r"\.\. code-block:: python\n\n((?:    .*\n|\n)+)", section)
    assert m is not None, "no code block in the quick start"
    return "\n".join(line[4:] for line in m.group(1).splitlines())


def test_quick_start_runs_as_written(tmp_path: Path) -> None:
    script = tmp_path / "quick_start.py"
    script.write_text(_quick_start())
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[b'0', b'1', b'2']"


def test_asyncio_quick_start_runs_as_written(tmp_path: Path) -> None:
    code = _quick_start("Quick start with asyncio")
    assert 'backend="asyncio"' in code and "import asyncio" in code
    script = tmp_path / "quick_start_asyncio.py"
    script.write_text(code)
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[b'0', b'1', b'2']"
