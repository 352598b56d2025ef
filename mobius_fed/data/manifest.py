"""A prepared site's ``meta.json``: what it holds and which tokenizer made it (data §manifest)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from mobius_fed.data.errors import DataError


def write_json(path: Path, obj: object) -> None:
    """Write ``obj`` as JSON atomically (tmp file + fsync + rename)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(json.dumps(obj, indent=2) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_meta(directory: Path) -> dict[str, Any]:
    """``directory/meta.json`` as a dict ({} when absent); a DataError when unreadable."""
    path = Path(directory) / "meta.json"
    if not path.is_file():
        return {}
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise DataError(f"{path}: unreadable meta.json: {exc}") from exc
    if not isinstance(meta, dict):
        raise DataError(f"{path}: meta.json must hold a JSON object")
    return meta


def site_identity(directory: Path) -> tuple[str, int]:
    """(tokenizer identity, vocabulary size) a site's data was prepared with; ("", 0) when
    its meta.json does not say (shards made elsewhere). Workers report it at registration
    so the coordinator can refuse sites that disagree."""
    meta = read_meta(directory)
    tokenizer = meta.get("tokenizer") or meta.get("encoding") or ""
    vocab = meta.get("vocab_size")
    if not vocab and isinstance(meta.get("encoding"), str):
        from mobius_fed.data.vocab import BUILTIN_VOCAB

        vocab = BUILTIN_VOCAB.get(meta["encoding"], 0)
    return str(tokenizer), int(vocab or 0)
