"""``mobius-fed plan``: the split of the layers that suits sites of unequal speed.

A ring moves at the pace of its slowest member, since every stream passes every group every
step. Given each site's compute speed (measured seconds of one block, or a declared
throughput) and its egress link, :func:`plan_split` simulates one ring step
(:mod:`mobius_fed.ops.step_sim`) for candidate splits and returns the one with the shortest
step, next to the even split's (docs/ring.md, "Sites of unequal speed").

The sites file (YAML), one entry per worker in ring order::

    sites:
      - name: hospital-a    # optional (default worker-<i>)
        block_ms: 4.0       # measured: one block forward on the home batch (ms)
        rate: 1gbit         # its egress (default: unshaped)
        delay: 5ms          # one-way delay to its successor (default 0)
      - name: lab-b
        tflops: 20          # declared: effective TFLOP/s of the site's device
        rate: 100mbit
"""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from mobius_fed.config import TrainConfig
from mobius_fed.engine.wire_stages import codecs
from mobius_fed.model.config import near_even_split, show_split
from mobius_fed.ops.step_sim import StepCosts, simulate_step
from mobius_fed.transport.link_tuning import parse_delay, parse_rate

BACKWARD_OVER_FORWARD = 2.0
"""FLOPs of a backward pass over its forward (input and weight gradients)."""
UNSHAPED_BPS = 1e12
"""A site's egress when its file names no rate: a link that never holds the ring."""
EXHAUSTIVE = 20_000
"""Splits tried one by one up to this many; beyond, a local search from the speed-share
split (moving one block at a time between two groups while the step gets shorter)."""


class PlanError(ValueError):
    """A sites file or a run the planner cannot use; the message names the problem."""


@dataclass(frozen=True)
class Site:
    """One site: its compute (``flops``: effective FLOP/s) and its egress link."""

    name: str
    flops: float
    rate_bps: float
    delay_s: float
    declared: str  # what the file said of its speed, e.g. "block 4.0 ms", "20 TFLOP/s"


def block_flops(cfg: TrainConfig) -> float:
    """FLOPs of one block forward on one micro-batch: its weights (2 per parameter and
    token) and the attention scores and mixing."""
    mc = cfg.model()
    d, inner = mc.d_model, mc.n_head * mc.head_dim
    tokens = cfg.batch_size // cfg.micro_batches * mc.seq_len
    per_token = 2 * (4 * d * inner + 2 * mc.mlp_ratio * d * d) + 4 * mc.seq_len * inner
    return float(per_token * tokens)


def head_flops(cfg: TrainConfig) -> float:
    """FLOPs of R and the loss, forward and backward, on one micro-batch."""
    mc = cfg.model()
    tokens = cfg.batch_size // cfg.micro_batches * mc.seq_len
    return (1 + BACKWARD_OVER_FORWARD) * 2 * mc.vocab_size * mc.d_model * tokens


def site_flops(cfg: TrainConfig, layers: int, step_compute_s: float) -> float:
    """A site's effective FLOP/s from its measured compute seconds per step (``status``'s
    ``step_compute_s``) while its group held ``layers`` blocks: the FLOPs the planner
    counts for that step (K·M applications both ways, M heads) over those seconds."""
    if step_compute_s <= 0 or layers < 1:
        raise PlanError(f"plan: a measured step needs compute > 0 s and ≥ 1 layer, got "
                        f"{step_compute_s} s and {layers}")  # fmt: skip
    K, M = cfg.K, cfg.micro_batches
    work = K * M * (1 + BACKWARD_OVER_FORWARD) * layers * block_flops(cfg) + M * head_flops(cfg)
    return work / step_compute_s


def hop_bytes(cfg: TrainConfig) -> tuple[int, int]:
    """(forward, backward) bytes of one remote hop of one micro-batch: the codec's payload
    (``wire_dtype`` where a direction has none) of what a slot carries (k-wide coordinates
    with the subspace on; a forward slot of mode ``tokens`` carries the token ids too)."""
    mc = cfg.model()
    shape = (cfg.batch_size // cfg.micro_batches, mc.seq_len, mc.subspace_rank or mc.d_model)
    tokens = cfg.subspace.on and cfg.subspace.mode == "tokens"
    fwd_shape = (*shape[:-1], shape[-1] + 1) if tokens else shape
    item = {"fp32": 4, "bf16": 2, "fp16": 2}[cfg.wire_dtype]
    fwd, bwd = codecs(cfg)
    out = [
        item * math.prod(sh) if c.lossless else c.payload_bytes(sh)
        for c, sh in ((fwd, fwd_shape), (bwd, shape))
    ]
    return out[0], out[1]


def read_sites(path: Path, cfg: TrainConfig) -> list[Site]:
    """The sites of a YAML file (see the module's docstring); errors name the site."""
    path = Path(path)
    if not path.is_file():
        raise PlanError(f"sites file not found: {path}")
    try:
        doc = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise PlanError(f"{path}: not valid YAML: {exc}") from None
    entries = doc.get("sites") if isinstance(doc, dict) else None
    if not isinstance(entries, list) or not entries:
        raise PlanError(f"{path}: expected a list under 'sites:', one entry per worker")
    return [_site(path, i, e, cfg) for i, e in enumerate(entries)]


def _site(path: Path, i: int, entry: Any, cfg: TrainConfig) -> Site:
    name = entry.get("name", f"worker-{i}") if isinstance(entry, dict) else f"worker-{i}"
    where = f"{path}: site {i} ({name})"
    if not isinstance(entry, dict):
        raise PlanError(f"{where}: expected a mapping, e.g. {{block_ms: 4.0, rate: 1gbit}}")
    unknown = set(entry) - {"name", "block_ms", "tflops", "rate", "delay"}
    if unknown:
        raise PlanError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}")
    if ("block_ms" in entry) == ("tflops" in entry):
        raise PlanError(f"{where}: give its speed as block_ms (measured) or tflops (declared)")
    try:
        if "block_ms" in entry:
            ms = float(entry["block_ms"])
            if ms <= 0:
                raise ValueError(f"block_ms must be > 0, got {ms}")
            batch = block_flops(cfg) * cfg.micro_batches  # the whole home batch
            flops, declared = batch / (ms / 1e3), f"block {ms:g} ms"
        else:
            tf = float(entry["tflops"])
            if tf <= 0:
                raise ValueError(f"tflops must be > 0, got {tf}")
            flops, declared = tf * 1e12, f"{tf:g} TFLOP/s"
        rate = float(parse_rate(str(entry["rate"]))) if "rate" in entry else UNSHAPED_BPS
        delay = parse_delay(str(entry.get("delay", "0ms")))
    except (TypeError, ValueError) as exc:
        raise PlanError(f"{where}: {exc}") from None
    return Site(str(name), flops, rate, delay, declared)


def site_costs(cfg: TrainConfig, sites: list[Site], split: tuple[int, ...]) -> list[StepCosts]:
    """Each worker's step costs: its group of ``split[i]`` blocks at its site's speed, the
    head at home, its egress link."""
    block, head = block_flops(cfg), head_flops(cfg)
    fwd_b, bwd_b = hop_bytes(cfg)
    return [
        StepCosts(
            fwd_s=n * block / site.flops,
            bwd_s=n * block * BACKWARD_OVER_FORWARD / site.flops,
            head_s=head / site.flops,
            home_s=0.0,
            fwd_bytes=fwd_b,
            bwd_bytes=bwd_b,
            rate_bps=site.rate_bps,
            delay_s=site.delay_s,
        )
        for n, site in zip(split, sites, strict=True)
    ]


def step_seconds(cfg: TrainConfig, sites: list[Site], split: tuple[int, ...]) -> float:
    """The simulated seconds of one training step with ``split``."""
    costs = site_costs(cfg, sites, split)
    try:
        return float(simulate_step(cfg.order, cfg.P, cfg.loops, cfg.micro_batches, costs)["step_s"])
    except ValueError as exc:
        raise PlanError(f"plan: {exc}") from None


@dataclass(frozen=True)
class Plan:
    """The planned split and the even one, with their simulated steps."""

    sites: list[Site]
    even: tuple[int, ...]
    even_step_s: float
    split: tuple[int, ...]
    step_s: float
    tokens_per_step: int

    @property
    def even_tokens_s(self) -> float:
        return self.tokens_per_step / self.even_step_s

    @property
    def tokens_s(self) -> float:
        return self.tokens_per_step / self.step_s

    @property
    def speedup(self) -> float:
        return self.even_step_s / self.step_s

    def as_dict(self) -> dict[str, Any]:
        return {
            "sites": [asdict(s) for s in self.sites],
            "even": {
                "split": show_split(self.even),
                "step_s": self.even_step_s,
                "tokens_s": self.even_tokens_s,
            },
            "planned": {"split": show_split(self.split), "step_s": self.step_s},
            "tokens_s": self.tokens_s,
            "speedup": self.speedup,
        }


def plan_split(cfg: TrainConfig, sites: list[Site]) -> Plan:
    """The split of ``cfg``'s layers over ``sites`` (one per worker) with the shortest
    simulated step; ties go to the split nearest the even one."""
    P, n_layer = cfg.P, cfg.model().n_layer
    if len(sites) != P:
        more = "more groups than sites" if len(sites) < P else "more sites than groups"
        raise PlanError(f"plan: P={P} workers but {len(sites)} sites ({more}): one site each")
    if n_layer < P:
        raise PlanError(f"plan: n_layer={n_layer} is fewer than P={P} sites: a group needs a layer")
    even = near_even_split(n_layer, P)
    cache: dict[tuple[int, ...], float] = {}

    def cost(split: tuple[int, ...]) -> tuple[float, int]:
        if split not in cache:
            cache[split] = step_seconds(cfg, sites, split)
        return round(cache[split], 12), sum(abs(a - b) for a, b in zip(split, even))

    if math.comb(n_layer - 1, P - 1) <= EXHAUSTIVE:
        best = min(_compositions(n_layer, P), key=cost)
    else:
        best = _local_search(_by_speed(n_layer, sites), cost)
    return Plan(sites, even, cost(even)[0], best, cost(best)[0], cfg.tokens_per_step)


def _compositions(n: int, parts: int):
    """Every split of n into ``parts`` positive counts."""
    for cuts in itertools.combinations(range(1, n), parts - 1):
        bounds = (0, *cuts, n)
        yield tuple(b - a for a, b in itertools.pairwise(bounds))


def _by_speed(n: int, sites: list[Site]) -> tuple[int, ...]:
    """Blocks in proportion to each site's speed, at least one each (largest remainders)."""
    total = sum(s.flops for s in sites)
    free = n - len(sites)
    shares = [free * s.flops / total for s in sites]
    counts = [1 + math.floor(x) for x in shares]
    order = sorted(range(len(sites)), key=lambda i: shares[i] - math.floor(shares[i]))
    for i in reversed(order[len(order) - (n - sum(counts)) :]):
        counts[i] += 1
    return tuple(counts)


def _local_search(start: tuple[int, ...], cost) -> tuple[int, ...]:
    """Move one block from one group to another while that shortens the step."""
    best = start
    while True:
        moves = [
            tuple(n - (k == i) + (k == j) for k, n in enumerate(best))
            for i, j in itertools.permutations(range(len(best)), 2)
            if best[i] > 1
        ]
        candidate = min(moves, key=cost, default=best)
        if cost(candidate) >= cost(best):
            return best
        best = candidate
