"""Data: tokenizers, modded-nanogpt shards, per-site preparation and batch loading.

Names are imported on first use, so ``mobius_fed.data.vocab`` (used by the config) and a
prepare worker process load neither torch nor the tokenizers they do not need.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "embedded_corpus": "corpus",
    "DataError": "errors",
    "SiteData": "loader",
    "TokenStream": "shards",
    "batch_seed": "loader",
    "prepare_sites": "prepare",
    "prepare_site": "prepare",
    "read_documents": "sources",
    "MAGIC": "shards",
    "VERSION": "shards",
    "ShardWriter": "shards",
    "read_shard": "shards",
    "write_shard": "shards",
    "ENCODINGS": "tokenizers",
    "encode_document": "tokenizers",
    "get_encoding": "tokenizers",
    "encoding_vocab": "vocab",
    "encoding_identity": "vocab",
    "site_identity": "manifest",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'mobius_fed.data' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"mobius_fed.data.{_WHERE[name]}"), name)
    globals()[name] = value
    return value
