"""Tokenizers: tiktoken's ``gpt2`` and a byte-level encoding that needs no download."""

from __future__ import annotations

import functools
import os
import threading
from typing import cast

import tiktoken

from mobius_fed.data.errors import DataError

ENCODINGS = ("bytes", "gpt2")
EOT = "<|endoftext|>"
# tiktoken's r50k/gpt2 pre-tokenisation pattern.
_PAT_STR = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
# Upper bound on how long fetching uncached gpt2 files may take before we give up.
_GPT2_TIMEOUT_S = float(os.environ.get("MOBIUS_TIKTOKEN_TIMEOUT", "60"))


@functools.cache
def _bytes_encoding() -> tiktoken.Encoding:
    return tiktoken.Encoding(
        name="bytes",
        pat_str=_PAT_STR,
        mergeable_ranks={bytes([i]): i for i in range(256)},
        special_tokens={EOT: 256},
        explicit_n_vocab=257,
    )


def _gpt2_encoding() -> tiktoken.Encoding:
    cache = os.environ.get("TIKTOKEN_CACHE_DIR") or os.environ.get("DATA_GYM_CACHE_DIR")
    where = cache or "<tempdir>/data-gym-cache"
    hint = (
        f"could not load tiktoken encoding 'gpt2' (offline and not cached?); put its files in "
        f"TIKTOKEN_CACHE_DIR (now {where}) or use --encoding bytes"
    )
    result: dict[str, object] = {}

    def load() -> None:  # tiktoken's download has no timeout, so run it in a daemon thread
        try:
            result["enc"] = tiktoken.get_encoding("gpt2")
        except Exception as exc:
            result["err"] = exc

    worker = threading.Thread(target=load, daemon=True)
    worker.start()
    worker.join(_GPT2_TIMEOUT_S)
    if "enc" in result:
        return cast(tiktoken.Encoding, result["enc"])
    if "err" in result:
        raise DataError(f"{hint}: {result['err']}") from cast(Exception, result["err"])
    raise DataError(f"{hint}: timed out after {_GPT2_TIMEOUT_S:.0f} s")


def get_encoding(name: str) -> tiktoken.Encoding:
    """Return the named encoding; raises DataError for unknown names or unavailable files."""
    if name == "bytes":
        return _bytes_encoding()
    if name == "gpt2":
        return _gpt2_encoding()
    raise DataError(f"unknown encoding {name!r}; valid names: {', '.join(ENCODINGS)}")


def encode_document(enc: tiktoken.Encoding, text: str) -> list[int]:
    """Encode ``text`` (special tokens treated as plain text) followed by the EOT token."""
    return [*enc.encode_ordinary(text), enc.eot_token]
