"""Encoding names and their vocabulary sizes, without loading a tokenizer (torch-free).

An encoding is named by one of:

- ``bytes``: byte-level, 257 ids, no download;
- a tiktoken encoding (``gpt2``, ``r50k_base``, ``p50k_base``, ``cl100k_base``,
  ``o200k_base``, …), whose files come from tiktoken's cache;
- ``hf:<path>`` (or a path ending in ``.json``): a Hugging Face ``tokenizer.json``.

The model's vocabulary follows :func:`encoding_vocab` (data §tokenizers).
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

from mobius_fed.data.errors import DataError

# n_vocab of tiktoken's encodings (largest id + 1), so configs resolve offline.
TIKTOKEN_VOCAB = {
    "gpt2": 50257,
    "r50k_base": 50257,
    "p50k_base": 50281,
    "p50k_edit": 50284,
    "cl100k_base": 100277,
    "o200k_base": 200019,
    "o200k_harmony": 201088,
}
BUILTIN_VOCAB = {"bytes": 257, **TIKTOKEN_VOCAB}
HF_PREFIX = "hf:"


def hf_path(name: str) -> Path | None:
    """The tokenizer.json a name points at, or None for bytes/tiktoken names."""
    if name.startswith(HF_PREFIX):
        return Path(name[len(HF_PREFIX) :]).expanduser()
    if name.endswith(".json"):
        return Path(name).expanduser()
    return None


def check_encoding_name(name: str) -> str:
    """``name`` if it names an encoding this framework can load; else DataError listing them."""
    if name in BUILTIN_VOCAB or hf_path(name) is not None:
        return name
    raise DataError(
        f"unknown encoding {name!r}; valid names: {', '.join(BUILTIN_VOCAB)}, "
        "or hf:<path to tokenizer.json>"
    )


@functools.lru_cache(maxsize=32)
def _hf_summary(path: Path, mtime_ns: int) -> tuple[int, str]:
    try:
        raw = path.read_bytes()
        doc = json.loads(raw)
    except (OSError, ValueError) as exc:
        raise DataError(f"{path}: cannot read tokenizer.json: {exc}") from exc
    model = doc.get("model") if isinstance(doc, dict) else None
    vocab = model.get("vocab") if isinstance(model, dict) else None
    ids: list[int] = []
    if isinstance(vocab, dict):
        ids = [int(v) for v in vocab.values()]
    elif isinstance(vocab, list):  # Unigram: [[piece, score], ...], ids are positions
        ids = [len(vocab) - 1] if vocab else []
    ids += [int(t["id"]) for t in doc.get("added_tokens") or () if isinstance(t, dict)]
    if not ids:
        raise DataError(f"{path}: tokenizer.json has no vocabulary (model.vocab is empty)")
    return max(ids) + 1, "hf:" + hashlib.sha256(raw).hexdigest()[:16]


def hf_file(name: str) -> tuple[Path, int]:
    """The resolved tokenizer.json of an ``hf:`` name and its mtime (the caches' key)."""
    path = hf_path(name)
    assert path is not None
    if not path.is_file():
        raise DataError(f"{path}: tokenizer.json not found (encoding {name!r})")
    return path.resolve(), path.stat().st_mtime_ns


def encoding_vocab(name: str) -> int:
    """Number of token ids of the encoding (largest id + 1)."""
    check_encoding_name(name)
    return BUILTIN_VOCAB[name] if name in BUILTIN_VOCAB else _hf_summary(*hf_file(name))[0]


def encoding_identity(name: str) -> str:
    """What two sites must agree on: the name for bytes/tiktoken, ``hf:<sha256 prefix>`` of
    the tokenizer.json's bytes for a Hugging Face tokenizer (paths may differ per host)."""
    check_encoding_name(name)
    return name if name in BUILTIN_VOCAB else _hf_summary(*hf_file(name))[1]
