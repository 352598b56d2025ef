"""Tokenizers: byte-level, every tiktoken encoding, and Hugging Face ``tokenizer.json``.

Each is used through the same small interface (tiktoken's): ``encode_ordinary``,
``encode_ordinary_batch``, ``decode``, ``eot_token``, ``n_vocab`` (data §tokenizers).
"""

from __future__ import annotations

import functools
import os
import threading
from pathlib import Path
from typing import Any, Protocol, cast

import tiktoken

from mobius_fed.data.errors import DataError
from mobius_fed.data.vocab import BUILTIN_VOCAB, TIKTOKEN_VOCAB, check_encoding_name, hf_file

ENCODINGS = tuple(BUILTIN_VOCAB)
EOT = "<|endoftext|>"
# End-of-text tokens tried, in order, in a Hugging Face tokenizer.json.
HF_EOT_NAMES = (EOT, "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>", "[SEP]")
# tiktoken's r50k/gpt2 pre-tokenisation pattern.
_PAT_STR = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
# Upper bound on how long fetching uncached tiktoken files may take before we give up.
_TIKTOKEN_TIMEOUT_S = float(os.environ.get("MOBIUS_TIKTOKEN_TIMEOUT", "60"))


class Tokenizer(Protocol):
    """What prepare, export and generation need of a tokenizer."""

    @property
    def name(self) -> str: ...

    @property
    def eot_token(self) -> int: ...

    @property
    def n_vocab(self) -> int: ...

    def encode_ordinary(self, text: str) -> list[int]: ...

    def encode_ordinary_batch(self, text: list[str], *, num_threads: int = ...) -> Any: ...

    def decode(self, tokens: list[int]) -> str: ...


@functools.cache
def _bytes_encoding() -> tiktoken.Encoding:
    return tiktoken.Encoding(
        name="bytes",
        pat_str=_PAT_STR,
        mergeable_ranks={bytes([i]): i for i in range(256)},
        special_tokens={EOT: 256},
        explicit_n_vocab=257,
    )


@functools.cache
def _tiktoken_encoding(name: str) -> tiktoken.Encoding:
    cache = os.environ.get("TIKTOKEN_CACHE_DIR") or os.environ.get("DATA_GYM_CACHE_DIR")
    where = cache or "<tempdir>/data-gym-cache"
    hint = (
        f"could not load tiktoken encoding {name!r} (offline and not cached?); put its files "
        f"in TIKTOKEN_CACHE_DIR (now {where}) or use --encoding bytes"
    )
    result: dict[str, object] = {}

    def load() -> None:  # tiktoken's download has no timeout, so run it in a daemon thread
        try:
            result["enc"] = tiktoken.get_encoding(name)
        except Exception as exc:
            result["err"] = exc

    worker = threading.Thread(target=load, daemon=True)
    worker.start()
    worker.join(_TIKTOKEN_TIMEOUT_S)
    if "enc" in result:
        return cast(tiktoken.Encoding, result["enc"])
    if "err" in result:
        raise DataError(f"{hint}: {result['err']}") from cast(Exception, result["err"])
    raise DataError(f"{hint}: timed out after {_TIKTOKEN_TIMEOUT_S:.0f} s")


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` behind tiktoken's interface (the ``hf`` extra)."""

    def __init__(self, path: Path) -> None:
        try:
            from tokenizers import Tokenizer as _Tok
        except ImportError as exc:
            raise DataError(
                f"{path}: a tokenizer.json needs the tokenizers package "
                "(pip install 'mobius-fed[hf]')"
            ) from exc
        if not path.is_file():
            raise DataError(f"{path}: tokenizer.json not found")
        try:
            self._tok = _Tok.from_file(str(path))
        except Exception as exc:
            raise DataError(f"{path}: cannot load tokenizer.json: {exc}") from exc
        self.name = f"hf:{path}"
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self.n_vocab = max(vocab.values()) + 1
        eot = next((vocab[t] for t in HF_EOT_NAMES if t in vocab), None)
        if eot is None:
            raise DataError(
                f"{path}: tokenizer.json has no end-of-text token (looked for "
                f"{', '.join(HF_EOT_NAMES)}); add one to separate documents"
            )
        self.eot_token = int(eot)

    def encode_ordinary(self, text: str) -> list[int]:
        """Token ids of ``text``; special tokens are plain text and none are added."""
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def encode_ordinary_batch(self, text: list[str], *, num_threads: int = 1) -> list[list[int]]:
        """Token ids of each text (the library parallelises the batch itself)."""
        return [list(e.ids) for e in self._tok.encode_batch(text, add_special_tokens=False)]

    def decode(self, tokens: list[int]) -> str:
        return str(self._tok.decode(list(tokens), skip_special_tokens=False))


@functools.cache
def _hf_tokenizer(path: Path, mtime_ns: int) -> HFTokenizer:
    return HFTokenizer(path)


def get_encoding(name: str) -> Tokenizer:
    """Return the named encoding; raises DataError for unknown names or unavailable files."""
    check_encoding_name(name)
    if name == "bytes":
        return _bytes_encoding()
    if name in TIKTOKEN_VOCAB:
        return _tiktoken_encoding(name)
    return _hf_tokenizer(*hf_file(name))


def encode_document(enc: Tokenizer, text: str) -> list[int]:
    """Encode ``text`` (special tokens treated as plain text) followed by the EOT token."""
    return [*enc.encode_ordinary(text), enc.eot_token]
