"""Command line (placeholder until the CLI lands)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    print("trio-redis-finalize: CLI not written yet", file=sys.stderr)
    return 2
