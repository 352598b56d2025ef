"""Per-site training data: memory-mapped shards and deterministic random batches."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Literal

import torch

from mobius_fed.data.errors import DataError
from mobius_fed.data.manifest import read_meta
from mobius_fed.data.shards import TokenStream, read_shard
from mobius_fed.data.vocab import encoding_identity

Split = Literal["train", "val"]
SPLITS: tuple[Split, ...] = ("train", "val")


_SITE_DIR = re.compile(r"site-(\d+)")


def batch_seed(seed: int, split: str, step: int, site: int | None = None) -> int:
    """Stable 63-bit generator seed derived from (seed, site, split, step) only.

    ``site=None`` gives the seed every site shared before batches were made per-site
    (every origin drew the same window offsets); it is kept to reproduce those runs.
    """
    text = f"{seed}:{split}:{step}" if site is None else f"{seed}:site{site}:{split}:{step}"
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class SiteData:
    """One site's ``train_*.bin`` / ``val_*.bin`` shards, sampled in windows of ``seq_len``.

    ``site`` (the site's index) enters every batch seed, so two sites never draw the same
    window offsets. By default it is read from ``meta.json`` (``prepare`` writes it) or
    from a ``site-<i>`` directory name; setting ``self.site = None`` restores the old
    batches shared by all sites.
    """

    def __init__(
        self,
        directory: Path,
        seq_len: int,
        encoding: str | None = None,
        *,
        site: int | None = None,
    ) -> None:
        self.directory = Path(directory)
        self.seq_len = int(seq_len)
        if self.seq_len < 1:
            raise DataError(f"{self.directory}: seq_len must be >= 1 (got {seq_len})")
        if not self.directory.is_dir():
            raise DataError(f"{self.directory}: data directory not found")
        self.meta: dict[str, object] = read_meta(self.directory)
        if encoding is not None and not self._same_encoding(encoding):
            raise DataError(
                f"{self.directory}: encoding mismatch: meta.json says "
                f"{self.meta['encoding']!r}, expected {encoding!r}"
            )
        self.site: int | None = self._site_index() if site is None else int(site)
        self._tokens: dict[str, TokenStream] = {s: self._load(s) for s in SPLITS}

    def _same_encoding(self, encoding: str) -> bool:
        """meta.json's encoding is ``encoding``, or the same tokenizer file elsewhere."""
        have = self.meta.get("encoding")
        if have is None or have == encoding:
            return True
        if "tokenizer" not in self.meta:
            return False
        try:
            return encoding_identity(encoding) == self.meta["tokenizer"]
        except DataError:
            return False

    def _site_index(self) -> int | None:
        value = self.meta.get("site")
        if value is not None:
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise DataError(
                    f"{self.directory / 'meta.json'}: 'site' must be a non-negative integer "
                    f"(got {value!r})"
                )
            return value
        match = _SITE_DIR.fullmatch(self.directory.resolve().name)
        return int(match.group(1)) if match else None

    def _load(self, split: str) -> TokenStream:
        files = sorted(self.directory.glob(f"{split}_*.bin"))
        if not files:
            raise DataError(f"{self.directory}: no {split}_*.bin shards")
        tokens = TokenStream([read_shard(f) for f in files])
        if len(tokens) < self.seq_len + 1:
            raise DataError(
                f"{self.directory}: {split} split has {len(tokens)} tokens, "
                f"need at least seq_len+1 = {self.seq_len + 1}"
            )
        return tokens

    def num_tokens(self, split: Split) -> int:
        """Number of tokens in ``split``."""
        return len(self._split(split))

    def max_token(self) -> int:
        """Largest token id in either split (for vocabulary-size checks)."""
        return max(t.max() for t in self._tokens.values())

    def _split(self, split: str) -> TokenStream:
        if split not in self._tokens:
            raise DataError(f"{self.directory}: unknown split {split!r}; valid: {SPLITS}")
        return self._tokens[split]

    def batch(
        self, split: Split, *, seed: int, step: int, batch_size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (x, y), int64 ``[batch_size, seq_len]``; y is x shifted by one token.

        Depends only on (seed, site, split, step), so a resumed run sees the same batches
        and every site samples independently of the others.
        """
        tokens = self._split(split)
        gen = torch.Generator().manual_seed(batch_seed(seed, split, step, self.site))
        high = len(tokens) - self.seq_len  # offsets in [0, n - seq_len - 1]
        offsets = torch.randint(0, high, (batch_size,), generator=gen).numpy()
        windows = torch.from_numpy(tokens.windows(offsets, self.seq_len + 1))
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
