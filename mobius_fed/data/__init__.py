"""Data: tokenizers, modded-nanogpt shards, per-site preparation and batch loading."""

from mobius_fed.data.corpus import embedded_corpus
from mobius_fed.data.errors import DataError
from mobius_fed.data.loader import SiteData, batch_seed
from mobius_fed.data.prepare import prepare_sites, read_documents
from mobius_fed.data.shards import MAGIC, VERSION, read_shard, write_shard
from mobius_fed.data.tokenizers import ENCODINGS, encode_document, get_encoding

__all__ = [
    "ENCODINGS",
    "MAGIC",
    "VERSION",
    "DataError",
    "SiteData",
    "batch_seed",
    "embedded_corpus",
    "encode_document",
    "get_encoding",
    "prepare_sites",
    "read_documents",
    "read_shard",
    "write_shard",
]
