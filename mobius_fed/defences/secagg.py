"""Secure Aggregation of the shared E/R with pairwise masks (Bonawitz et al., CCS 2017).

Site s sends only round-to-nearest(Δ_s) + Σ_{j>s} PRG(k_sj, round, attempt) − Σ_{j<s} PRG(…)
(mod 2^b); the coordinator sums the P vectors and learns only Σ_s Δ_s. The attempt is the ring
incarnation, so a redone round never reuses its masks. The reference engine draws its own P
key pairs: the masks cancel exactly, so ring == reference stays exact. Protocol, keys and why
Flower's ``pseudo_rand_gen``/``quantize`` are not used: docs/privacy.md §4g.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import numpy as np
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from flwr.app import Array, ArrayRecord, ConfigRecord, Message
from flwr.supercore.differential_privacy import compute_clip_model_update

if TYPE_CHECKING:
    from mobius_fed.config import TrainConfig

MASKED = "secagg"  # a train reply's record: one array named ``masked``, nothing else
MASKED_ARRAY = "masked"
PUBLIC_KEY = "secagg-public-key"  # in a worker's query.state reply
KEYS, ATTEMPT = "secagg-keys", "secagg-attempt"  # in a train message's config
KEY_BYTES = 32


class SecAggError(ValueError):
    """A SecAgg message that cannot be used; the text names the site."""


@dataclass(frozen=True)
class Quantiser:
    """Fixed point in Z_{2^b}: x ∈ [−r, r] ↦ round(x·M/r), M = ⌊(2^(b−1) − 1)/P⌋, so the
    sum of P values never wraps. Error of one value ≤ r/(2M); of the mean, the same."""

    bits: int
    bound: float
    P: int

    def __post_init__(self) -> None:
        if not 16 <= self.bits <= 64:
            raise SecAggError(f"privacy.er_secagg_bits must be in [16, 64], got {self.bits}")
        if self.levels < 1:
            raise SecAggError(f"privacy.er_secagg_bits {self.bits} leaves no level for P={self.P}")

    @property
    def mask(self) -> np.unsignedinteger:
        """2^b − 1 in the wire dtype: arithmetic there wraps mod 2^32 or 2^64, a multiple."""
        return self.wire_dtype.type((1 << self.bits) - 1)

    @property
    def levels(self) -> int:
        return ((1 << (self.bits - 1)) - 1) // self.P

    @property
    def wire_dtype(self) -> np.dtype:
        return np.dtype(np.uint32 if self.bits <= 32 else np.uint64)

    @property
    def step(self) -> float:
        """The value of one level, r/M (the quantisation error is at most half of it)."""
        return self.bound / self.levels

    def quantise(self, x: np.ndarray) -> np.ndarray:
        """``x`` (float64) clipped to [−r, r] and rounded to the nearest level, in Z_{2^b}."""
        q = np.rint(np.clip(x, -self.bound, self.bound) * (self.levels / self.bound))
        return q.astype(np.int64).view(np.uint64).astype(self.wire_dtype) & self.mask

    def mean(self, total: np.ndarray) -> np.ndarray:
        """The mean (float64) of the P values whose sum mod 2^b is ``total``."""
        total = total.astype(np.uint64) & np.uint64((1 << self.bits) - 1)
        signed = total.view(np.int64).copy()
        if self.bits < 64:
            high = total >= np.uint64(1 << (self.bits - 1))
            signed[high] -= np.int64(1) << np.int64(self.bits)
        return signed.astype(np.float64) * self.step / self.P

    @classmethod
    def of(cls, cfg: TrainConfig) -> Quantiser:
        pc = cfg.privacy
        return cls(pc.er_secagg_bits, pc.er_secagg_range, cfg.P)


class SiteKeys:
    """One site's X25519 key pair (drawn fresh per process) and its pairwise agreements."""

    def __init__(self, secret: X25519PrivateKey | None = None) -> None:
        self.secret = secret or X25519PrivateKey.generate()
        self.public = self.secret.public_key().public_bytes_raw()
        self._shared: dict[bytes, bytes] = {}

    def shared(self, peer_public: bytes) -> bytes:
        """k_sj: HKDF-SHA256 of the X25519 agreement with site j (symmetric in s, j)."""
        if peer_public not in self._shared:
            peer = X25519PublicKey.from_public_bytes(peer_public)
            kdf = HKDF(hashes.SHA256(), KEY_BYTES, salt=None, info=b"mobius-fed secagg")
            self._shared[peer_public] = kdf.derive(self.secret.exchange(peer))
        return self._shared[peer_public]


def prg(shared: bytes, rnd: int, attempt: str, n: int, q: Quantiser) -> np.ndarray:
    """n uniform elements of Z_{2^b}: ChaCha20 under a key bound to (k_sj, round, attempt)."""
    key = hashlib.blake2b(f"{rnd}:{attempt}".encode(), key=shared, digest_size=32).digest()
    stream = Cipher(algorithms.ChaCha20(key, bytes(16)), mode=None).encryptor()
    width = q.wire_dtype.itemsize
    return np.frombuffer(stream.update(bytes(width * n)), dtype=q.wire_dtype) & q.mask


def pairwise_mask(
    site: int,
    keys: SiteKeys,
    public_keys: list[bytes],
    rnd: int,
    attempt: str,
    n: int,
    q: Quantiser,
) -> np.ndarray:
    """Σ_{j>s} PRG(k_sj) − Σ_{j<s} PRG(k_sj) mod 2^b."""
    total = np.zeros(n, dtype=q.wire_dtype)
    for j, pk in enumerate(public_keys):
        if j != site:
            m = prg(keys.shared(pk), rnd, attempt, n, q)
            total = total + m if j > site else total - m  # wraps mod 2^32 or 2^64
    return total & q.mask


def update_of(arrays: ArrayRecord, base: ArrayRecord, clip: float | None) -> np.ndarray:
    """Δ = arrays − base over all E/R arrays, flattened in float64; with ``clip``, first the
    update is clipped to L2 norm C by Flower's client-side fixed clipping."""
    if list(arrays.keys()) != list(base.keys()):
        raise SecAggError(f"E/R names {list(arrays.keys())} differ from {list(base.keys())}")
    mine, start = arrays.to_numpy_ndarrays(), base.to_numpy_ndarrays()
    if clip is not None:
        compute_clip_model_update(mine, start, clip)
    parts = [np.asarray(a, np.float64) - np.asarray(b, np.float64) for a, b in zip(mine, start)]
    return np.concatenate([p.ravel() for p in parts]) if parts else np.zeros(0)


@dataclass(frozen=True)
class Round:
    """What a site needs to mask one round: the relayed public keys and the attempt."""

    rnd: int
    attempt: str
    public_keys: list[bytes]

    def fill(self, config: ConfigRecord) -> None:
        config[KEYS], config[ATTEMPT] = list(self.public_keys), self.attempt

    @classmethod
    def of(cls, conf: Any, P: int) -> Round:
        try:
            keys = [bytes(k) for k in conf[KEYS]]
            attempt = str(conf[ATTEMPT])
        except KeyError as exc:
            raise SecAggError(f"privacy.er_secagg is on but the train order lacks {exc}") from None
        if len(keys) != P or any(len(k) != KEY_BYTES for k in keys):
            raise SecAggError(f"the train order carries {len(keys)} keys, expected P={P} of 32 B")
        return cls(int(conf["round"]), attempt, keys)


class SiteMasker:
    """A site's side: its key pair, and the masked reply of each round."""

    def __init__(self, cfg: TrainConfig, site: int, keys: SiteKeys | None = None) -> None:
        self.site, self.q, self.keys = site, Quantiser.of(cfg), keys or SiteKeys()
        self.clip = cfg.privacy.er_clip if cfg.privacy.er_noise > 0 else None
        self.used: set[tuple[int, str]] = set()  # (round, attempt) masked by this key pair

    def masked(self, arrays: ArrayRecord, base: ArrayRecord, order: Round) -> ArrayRecord:
        """The record a site sends instead of its E/R arrays. A (round, attempt) is masked
        once per key pair: sending a second update under the same masks would give away
        the difference of the two, so a repeat is refused."""
        if order.public_keys[self.site] != self.keys.public:
            raise SecAggError(f"site {self.site}: the relayed public key is not this site's")
        if (order.rnd, order.attempt) in self.used:
            raise SecAggError(
                f"site {self.site}: round {order.rnd} attempt {order.attempt!r} "
                "was masked once already; refusing to reuse its masks"
            )
        self.used.add((order.rnd, order.attempt))
        x = self.q.quantise(update_of(arrays, base, self.clip))
        m = pairwise_mask(
            self.site, self.keys, order.public_keys, order.rnd, order.attempt, x.size, self.q
        )
        y = (x + m) & self.q.mask
        return ArrayRecord({MASKED_ARRAY: Array(y)})


def check_masked(site: int, content: Any, n: int, q: Quantiser) -> np.ndarray:
    """The masked vector of site ``site``'s train reply: exactly one array of n elements in
    the wire dtype, and no E/R arrays in the clear. SecAggError names the site."""
    who = f"site {site}"
    if "arrays" in content:
        raise SecAggError(f"{who} sent its E/R arrays in the clear with privacy.er_secagg on")
    if MASKED not in content:
        raise SecAggError(f"{who} sent no masked E/R update ({MASKED!r} record missing)")
    record = content[MASKED]
    if list(record.keys()) != [MASKED_ARRAY]:
        raise SecAggError(
            f"{who}: the masked record holds {list(record.keys())}, expected [{MASKED_ARRAY!r}]"
        )
    arr = record[MASKED_ARRAY]
    if arr.dtype != str(q.wire_dtype) or tuple(arr.shape) != (n,):
        raise SecAggError(
            f"{who}: masked update is {arr.dtype}{list(arr.shape)}, expected {q.wire_dtype}[{n}]"
        )
    return arr.numpy()


@dataclass
class SecAgg:
    """The coordinator's side: relays the public keys and unmasks only the sum."""

    q: Quantiser
    public_keys: list[bytes] = field(default_factory=list)
    attempt: str = ""

    @classmethod
    def of(cls, cfg: TrainConfig) -> SecAgg | None:
        return cls(Quantiser.of(cfg)) if cfg.privacy.er_secagg else None

    def relay(self, public_keys: list[bytes], attempt: str) -> None:
        """The keys of this ring incarnation (site order) and its attempt label."""
        if len(public_keys) != self.q.P:
            raise SecAggError(f"{len(public_keys)} public keys for P={self.q.P} sites")
        self.public_keys, self.attempt = list(public_keys), attempt

    def fill(self, config: ConfigRecord, rnd: int) -> None:
        if not self.attempt:
            raise SecAggError(f"SecAgg: no public keys relayed before round {rnd}")
        Round(rnd, self.attempt, self.public_keys).fill(config)

    def unmask(self, replies: list[Message], start: ArrayRecord, sites: list[int]) -> ArrayRecord:
        """start + (Σ_s Δ_s)/P from the masked replies of ``sites`` (all P, once each)."""
        if sorted(sites) != list(range(self.q.P)):
            raise SecAggError(f"SecAgg needs every site's reply once, got sites {sorted(sites)}")
        weights = {float(cast(float, r.content["metrics"]["num-examples"])) for r in replies}
        if len(weights) != 1:
            raise SecAggError(f"SecAgg averages with equal weights; num-examples were {weights}")
        base = start.to_numpy_ndarrays()
        n = sum(a.size for a in base)
        total = np.zeros(n, dtype=self.q.wire_dtype)  # wraps mod 2^32 or 2^64
        for site, reply in zip(sites, replies, strict=True):
            total = total + check_masked(site, reply.content, n, self.q)
        delta, out, at = self.q.mean(total), {}, 0
        for name, a in zip(start.keys(), base, strict=True):
            d = delta[at : at + a.size].reshape(a.shape)
            out[name] = Array(np.asarray((np.asarray(a, np.float64) + d).astype(a.dtype)))
            at += a.size
        return ArrayRecord(out)
