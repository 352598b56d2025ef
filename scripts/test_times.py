"""Where the test suite's time goes: the slowest tests with their CPU share.

    TEST_TIMES=/tmp/times.jsonl python -m pytest -q
    python scripts/test_times.py /tmp/times.jsonl [--top 30] [--markdown]

Reads the JSON lines tests/timing_plugin.py writes (one per test: node id, xdist worker,
wall seconds, CPU seconds of the test's process tree) and prints the ``--top`` slowest by
wall time with their CPU time and CPU share (CPU ÷ wall: 1.0 keeps one core busy, 0.1
mostly waits), then each xdist worker's busy wall and the whole run's CPU. Exits 1 naming
each test over 30 s whose ``slow`` marker gives no reason.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("file", type=Path, help="the JSON lines of TEST_TIMES")
    parser.add_argument("--top", type=int, default=30, help="how many tests to list")
    parser.add_argument("--markdown", action="store_true", help="a Markdown table")
    args = parser.parse_args(argv)
    rows = [json.loads(line) for line in args.file.read_text().splitlines() if line.strip()]
    if not rows:
        parser.error(f"{args.file}: no test lines")
    rows.sort(key=lambda r: r["wall"], reverse=True)
    if args.markdown:
        print("| test | wall s | CPU s | CPU share |")
        print("|---|---:|---:|---:|")
    for r in rows[: args.top]:
        share = r["cpu"] / r["wall"] if r["wall"] > 0 else 0.0
        name = r["test"].removeprefix("tests/")
        if args.markdown:
            print(f"| `{name}` | {r['wall']:.1f} | {r['cpu']:.1f} | {share:.2f} |")
        else:
            print(f"{r['wall']:7.1f} s wall {r['cpu']:7.1f} s CPU {share:5.2f}  {name}")
    busy: dict[str, float] = defaultdict(float)
    for r in rows:
        busy[r["worker"]] += r["wall"]
    wall, cpu = sum(r["wall"] for r in rows), sum(r["cpu"] for r in rows)
    over30 = [r for r in rows if r["wall"] > 30]
    print(
        f"\n{len(rows)} tests; {wall:.0f} s of test wall time, {cpu:.0f} s CPU "
        f"(share {cpu / wall:.2f}); {len(over30)} over 30 s; per worker: "
        + ", ".join(f"{w} {s:.0f} s" for w, s in sorted(busy.items()))
    )
    unexplained = [r["test"] for r in over30 if not r.get("reason")]
    for name in unexplained:  # docs/testing.md: a test over 30 s says why in its marker
        print(f"over 30 s without slow(reason=...): {name}")
    return 1 if unexplained else 0


if __name__ == "__main__":
    raise SystemExit(main())
