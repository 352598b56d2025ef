"""What every generated page shares."""

from __future__ import annotations

REGENERATE = "python scripts/gen_reference.py"
NOTE = f"Generated from the code by `{REGENERATE}`; do not edit by hand."


def cell(text: str) -> str:
    """``text`` as one Markdown table cell (pipes escaped, on one line)."""
    return " ".join(text.split()).replace("|", "\\|")
