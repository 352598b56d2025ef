"""Error type for every data problem (bad shards, missing files, tokenizer trouble)."""

from __future__ import annotations


class DataError(ValueError):
    """A data problem; the message names the problem and the path involved."""
