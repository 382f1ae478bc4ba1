"""Run the benchmarks: `python -m bench [NAME...]` (all of them when no name is given)."""

from __future__ import annotations

import importlib
import sys
import time

NAMES = [
    "create", "listing", "poll", "memory", "staging", "e2e", "validation", "slowloris", "engines",
    "containers", "arrays", "nemesis", "failover",
]  # fmt: skip


def main(argv: list[str]) -> int:
    names = argv or NAMES
    unknown = [n for n in names if n not in NAMES]
    if unknown:
        print(f"unknown benchmark(s) {unknown}; known: {' '.join(NAMES)}", file=sys.stderr)
        return 2
    for name in names:
        print(f"\n=== {name} ===", flush=True)
        started = time.monotonic()
        importlib.import_module(f"bench.{name}").main()
        print(f"({name}: {time.monotonic() - started:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
