"""Write the reference pages generated from the code (docs/reference/, and the variable
table of docs/configuration.md); with --check, only say which are out of step (exit 1).

    python scripts/gen_reference.py            # after changing a flag, setting, model or metric
    python scripts/gen_reference.py --check    # CI: fail when a page is stale
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's mobius_fed, whichever is installed

from mobius_fed.cli.reference.help import same_layout  # noqa: E402
from mobius_fed.cli.reference.pages import stale, write  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare only; exit 1 if stale")
    args = parser.parse_args()
    if not same_layout():
        print(
            "docs/reference/cli/ left alone: argparse lays help out differently on Python "
            f"{sys.version_info[0]}.{sys.version_info[1]}; use Python 3.11 or 3.12 for it",
            file=sys.stderr,
        )
    if args.check:
        out = stale(ROOT)
        for path in out:
            print(f"docs/{path} is out of step with the code: python scripts/gen_reference.py")
        return 1 if out else 0
    for path in write(ROOT):
        print(f"wrote docs/{path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
