"""Data: tokenizers, modded-nanogpt shards, per-site preparation and batch loading.

Names are imported on first use, so ``mobius_fed.data.vocab`` (used by the config) and a
prepare worker process load neither torch nor the tokenizers they do not need.
"""

from __future__ import annotations

import importlib
from typing import Any

_NAMES = {  # module → the names it defines
    "corpus": ("embedded_corpus",),
    "errors": ("DataError",),
    "loader": ("SiteData", "batch_seed"),
    "manifest": ("site_identity",),
    "prepare": ("prepare_sites", "prepare_site"),
    "shards": ("MAGIC", "VERSION", "ShardWriter", "TokenStream", "read_shard", "write_shard"),
    "sources": ("read_documents",),
    "tokenizers": ("ENCODINGS", "encode_document", "get_encoding"),
    "vocab": ("encoding_vocab", "encoding_identity"),
}
_WHERE = {name: module for module, names in _NAMES.items() for name in names}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'mobius_fed.data' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"mobius_fed.data.{_WHERE[name]}"), name)
    globals()[name] = value
    return value
