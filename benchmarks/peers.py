"""Ring or DiLoCo? The arms of issue 44 on the same sites, their traffic and memory, and a
projection of wall-clock at WAN link speeds (docs/ring-or-diloco.md).

``train``: quality per token in the reference engine (one process; ring == reference is
tested, so these are the losses a ring of real workers would report). Every arm sees the
same S sites (embedded corpus, cut into S parts), the same tokens per site per step and the
same model preset. Per arm and seed: the held-out Eq. 8 loss over all S sites at the end
and each site's own held-out loss; printed: mean ± the 95 % t-interval over seeds. Bytes a
site *sends* per step are *computed* from the shapes (not measured): the ring's hops at the
codec's exact payload (``compression.step_bytes``), each site's F_i and E/R once per H or
``sync_every`` steps. Parameters and training state per site are *computed* too
(:func:`state_bytes`: fp32 weights, gradients and AdamW's two moments; activations left out).

``project``: wall-clock per 1 B tokens for the ring (hidden states every step) and DiLoCo
(weights every H steps) for gpt2-small and a ~1B model, from a stated compute assumption
(6·N FLOPs per token at an effective GPU throughput) and ``wan.py``'s step model; and the
model size above which a site of a given GPU memory cannot hold the whole model.

``figure``: the figure of docs/ring-or-diloco.md from the JSON of the other two.

``race``: the ring and DiLoCo as real processes on shaped links, measured end to end
(``race.py``).

    python benchmarks/peers.py train --sites 4 \
        --json benchmarks/results/peers/peers-cpu-tiny-4sites.json
    python benchmarks/peers.py train --sites 8 \
        --json benchmarks/results/peers/peers-cpu-tiny-8sites.json
    python benchmarks/peers.py project --json benchmarks/results/peers/projection.json
    python benchmarks/peers.py figure --out docs/ring-or-diloco.png
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))  # the sibling benchmarks below
import race

RESULTS = Path(__file__).parent / "results" / "peers"
CODEC = "fwd=int8,bwd=int4,rounding=stochastic"
BYTES_PER_PARAM = 16
"""Training state per parameter with AdamW: fp32 weights, fp32 gradients and the two fp32
moments (also what bf16 autocast over fp32 master weights holds, as this project's CUDA path
does). Activations come on top."""


# --------------------------------------------------------------------------- arms
@dataclass(frozen=True)
class Arm:
    name: str
    train: dict[str, Any] = field(default_factory=dict)  # TrainConfig fields beyond the common
    strategy: str = "fedavg"
    kind: str = "federated"  # federated | alone (never averaged) | pooled (one model, all data)
    keys: bool = False  # needs privacy.noise_key_dir (site keys)


def ring_groups(S: int, n_layer: int) -> int:
    """P of the ring arms on S sites: S when an even split of ``n_layer`` allows, else the
    largest divisor of S that divides ``n_layer`` (R = S / P rings, synced every step)."""
    return max(p for p in range(1, S + 1) if S % p == 0 and n_layer % p == 0)


def arms(S: int, n_layer: int = 12) -> list[Arm]:
    P = ring_groups(S, n_layer)
    R = S // P
    ring = dict(workers=S, rings=R)  # R > 1: the rings' F_i averaged every step (FedAvg)
    tag = f"P={P}" if R == 1 else f"{R} rings of P={P}, H=1"
    wire = {"wire": CODEC}
    # the private preset keys its defences by the site within one ring: one ring of all S
    private = dict(workers=S, privacy={"preset": "states-only"})
    split = None
    if n_layer % S:
        from mobius_fed.model.config import near_even_split

        split = list(near_even_split(n_layer, S))
        private["layers_per_group"] = split

    def diloco(H: int) -> Arm:
        train = dict(workers=S, rings=S, sync_every=H, ring_sync_every=H, ring_outer="diloco")
        return Arm(f"DiLoCo H={H} (P=1, R={S})", train, "diloco")

    out = [
        Arm(f"cyclic ring ({tag})", ring),
        Arm(f"cyclic ring ({tag}), codec {CODEC}", {**ring, **wire}),
    ]
    ptag = f"P={S}" + (f", split {','.join(map(str, split))}" if split else "")
    if split:
        out.append(Arm(f"cyclic ring ({ptag})", dict(workers=S, layers_per_group=split)))
    out += [
        Arm(f"cyclic ring ({ptag}), private preset states-only", private, keys=True),
        Arm(f"ordered ring ({tag})", {**ring, "order": "ordered"}),
        *(diloco(H) for H in (1, 10, 50, 100)),
        Arm(f"FedAvg every step (P=1, R={S})", dict(workers=S, rings=S)),
        Arm(
            f"FedAvg every 100 steps (P=1, R={S})",
            dict(workers=S, rings=S, sync_every=100, ring_sync_every=100),
        ),
    ]
    rr = [p for p in range(2, P) if S % p == 0 and n_layer % p == 0 and p < P]
    if rr or (R == 1 and S % 2 == 0 and S > 2):
        p = rr[-1] if rr else S // 2
        out.append(Arm(f"rings of rings (R={S // p}, P={p}, H=1)", dict(workers=S, rings=S // p)))
    out.append(Arm("each site alone (P=1)", dict(workers=1, sync_every=0), kind="alone"))
    out.append(Arm(f"pooled data, one model (P=1, batch ×{S})", dict(workers=1), kind="pooled"))
    return out


# ------------------------------------------------------------------ shapes and bytes
def block_params(d: int) -> int:
    """Parameters of one block: qkv 3d², output d², MLP 8d², two RMSNorm weights (heads of
    total width d, MLP ratio 4, no biases: this project's block)."""
    return 12 * d * d + 2 * d


def model_params(n_layer: int, d: int, vocab: int) -> int:
    """The whole model: n_layer blocks and the tied embedding/head (vocab × d)."""
    return n_layer * block_params(d) + vocab * d


def site_params(n_layer: int, d: int, vocab: int, P: int) -> int:
    """What one ring site holds: its group of n_layer / P blocks and its E/R."""
    return -(-n_layer // P) * block_params(d) + vocab * d


def state_bytes(params: int) -> int:
    """Training state of ``params`` parameters with AdamW (:data:`BYTES_PER_PARAM`)."""
    return BYTES_PER_PARAM * params


def max_whole_model(memory_bytes: float) -> float:
    """The largest parameter count whose AdamW training state fits in ``memory_bytes``
    (activations not counted, so the true limit is lower)."""
    return memory_bytes / BYTES_PER_PARAM


def _torch_params(module) -> int:
    return sum(p.numel() for p in module.parameters())


def arm_bytes(cfg, kind: str) -> dict[str, float]:
    """Bytes one site sends per step (computed from the shapes): ``hops`` of the ring (the
    codec's payload), ``groups`` (F_i once per H when rings > 1) and ``er`` (E/R once per
    ``sync_every``), each in fp32 unless a codec says otherwise."""
    from compression import step_bytes

    from mobius_fed.model import build_group, build_replica

    if kind != "federated":
        return {"hops": 0.0, "groups": 0.0, "er": 0.0}
    mc = cfg.model()
    one = cfg.model_copy(update={"workers": cfg.P, "rings": 1})
    hops = step_bytes(one)[0] / cfg.P if cfg.P > 1 else 0.0
    group = _torch_params(build_group(mc, 0, 0)) * 4
    er = sum(t.numel() for t in build_replica(mc, 0).shared_state_dict().values()) * 4
    return {
        "hops": float(hops),
        "groups": group / cfg.ring_sync_every if cfg.rings > 1 else 0.0,
        "er": er / cfg.sync_every if cfg.sync_every else 0.0,
    }


def arm_params(cfg, kind: str) -> int:
    """Parameters site 0 trains (its group, or all groups with P = 1, and its replica with any
    private layers); the pooled model holds them all."""
    from mobius_fed.defences.site_layers import build_site_replica
    from mobius_fed.model import build_group

    del kind
    mc = cfg.model()
    return _torch_params(build_group(mc, 0, 0)) + _torch_params(build_site_replica(cfg, 0))


# ---------------------------------------------------------------------------- train
class PooledSites:
    """All sites' training data as one site: each step's batch takes batch_size / S windows
    from every site (the windows each site would draw), so the pooled model sees the same
    tokens as the S sites together."""

    def __init__(self, sites) -> None:
        self.sites = list(sites)

    def batch(self, split, *, seed: int, step: int, batch_size: int):
        import torch

        each = batch_size // len(self.sites)
        parts = [s.batch(split, seed=seed, step=step, batch_size=each) for s in self.sites]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def run_arm(arm: Arm, common: dict, sites: list[Path], seed: int, keys: Path) -> dict:
    """One arm and seed: held-out Eq. 8 over every site, each site's held-out loss."""
    from mobius_fed.config import TrainConfig
    from mobius_fed.data import SiteData
    from mobius_fed.engine import ReferenceEngine
    from mobius_fed.engine.federated import train_with_strategy
    from mobius_fed.engine.rings import make_engine
    from mobius_fed.strategies import RingPlan, RoundPlan, make_strategy
    from mobius_fed.transport.wire_config import WireConfig

    train = dict(arm.train)
    if "wire" in train:
        train["wire"] = WireConfig.parse_flag(train["wire"])
    if arm.keys:
        train["privacy"] = {**train["privacy"], "noise_key_dir": str(keys)}
    S = len(sites)
    if arm.kind == "pooled":
        train["batch_size"] = common["batch_size"] * S
    cfg = TrainConfig(**{**common, **train}, seed=seed)
    seq = cfg.model().seq_len
    data = [SiteData(d, seq) for d in sites]
    if arm.kind in ("alone", "pooled"):
        engines = []
        if arm.kind == "alone":
            for d in data:
                engine = ReferenceEngine(cfg, [d])
                for _ in range(cfg.steps):
                    engine.train_step()
                engines.append(engine)
        else:
            engine = ReferenceEngine(cfg, [PooledSites(data)])  # type: ignore[list-item]
            for _ in range(cfg.steps):
                engine.train_step()
            engine.cfg = cfg.model_copy(update={"batch_size": common["batch_size"]})
            engines = [engine] * S
        losses = []
        for engine, d in zip(engines, data):
            engine.sites = [d]  # each site's own held-out windows, as every arm reads them
            losses.append(engine.evaluate().loss)
        return {"eval": sum(losses) / S, "sites": losses, "cfg": cfg}
    engine = make_engine(cfg, data)
    strategy = make_strategy(arm.strategy, cfg.workers, RoundPlan.of(cfg), rings=RingPlan.of(cfg))
    ev = train_with_strategy(engine, strategy).evals[-1]
    return {"eval": ev.loss, "sites": list(ev.origin_losses), "cfg": cfg}


def site_keys(directory: Path, sites: int) -> None:
    """Site keys as ``write_site_keys`` lays them out, but derived from the site's index
    (public: a benchmark's noise must be the same on every run; a deployment's keys are
    secret and random)."""
    import hashlib

    from mobius_fed.defences.stages import write_site_keys

    for path in write_site_keys(directory, sites):
        path.write_bytes(hashlib.sha256(f"peers-benchmark:{path.name}".encode()).digest())


def interval(xs: list[float]) -> dict[str, float]:
    from mobius_fed.stats import ci95

    m, h = ci95(xs)
    return {"mean": m, "ci95": h}


def train(args: argparse.Namespace) -> dict:
    import torch

    from mobius_fed.data import embedded_corpus, prepare_sites
    from mobius_fed.model.config import PRESETS

    logging.getLogger("flwr").setLevel(logging.WARNING)
    torch.set_num_threads(1)
    common = dict(
        preset=args.preset,
        steps=args.steps,
        batch_size=args.batch_size,
        optimizer="adamw",
        eval_every=0,
        eval_batches=4,
    )
    rows = []
    selected = arms(args.sites, PRESETS[args.preset]["n_layer"])
    if args.arms:
        chosen = args.arms
        selected = [
            a
            for a in selected
            if any(a.name == k[1:] if k.startswith("=") else k in a.name for k in chosen)
        ]
    with tempfile.TemporaryDirectory() as tmp:
        sites = prepare_sites(None, Path(tmp) / "sites", args.sites, text=embedded_corpus())
        keys = Path(tmp) / "keys"
        site_keys(keys, args.sites)
        print("| arm | held-out Eq. 8 | sites (mean ± 95 % CI) | B/site/step | params/site |")
        for arm in selected:
            t0 = time.perf_counter()
            runs = [run_arm(arm, common, sites, s, keys) for s in args.seeds]
            cfg = runs[0]["cfg"]
            traffic = arm_bytes(cfg, arm.kind)
            params = arm_params(cfg, arm.kind)
            per_site = [[r["sites"][i] for r in runs] for i in range(args.sites)]
            rows.append(
                {
                    "arm": arm.name,
                    "kind": arm.kind,
                    "P": cfg.P,
                    "rings": cfg.rings,
                    "eval": interval([r["eval"] for r in runs]),
                    "eval_losses": [r["eval"] for r in runs],
                    "site_losses": per_site,  # [site][seed]
                    "sites": [interval(xs) for xs in per_site],
                    "bytes_per_site_step": sum(traffic.values()),
                    "bytes_parts": traffic,
                    "params_per_site": params,
                    "state_bytes_per_site": state_bytes(params),
                    "seconds": time.perf_counter() - t0,
                }
            )
            print(row_text(rows[-1]), flush=True)
    doc = {
        "args": {k: str(v) for k, v in vars(args).items() if k != "func"},
        "seeds": args.seeds,
        "tokens_per_site_step": args.batch_size * PRESETS[args.preset]["seq_len"],
        "rows": rows,
    }
    if args.json:
        if args.append and args.json.exists():  # add these arms to an earlier run's rows
            old = json.loads(args.json.read_text())
            if old["seeds"] != doc["seeds"] or old["args"]["steps"] != doc["args"]["steps"]:
                raise SystemExit(f"{args.json}: other seeds or steps; not appended")
            names = {r["arm"] for r in rows}
            doc["rows"] = [r for r in old["rows"] if r["arm"] not in names] + rows
            order = [a.name for a in arms(args.sites, PRESETS[args.preset]["n_layer"])]
            doc["rows"].sort(key=lambda r: order.index(r["arm"]) if r["arm"] in order else 99)
            doc["args"]["arms"] = "all of " + ", ".join(r["arm"] for r in doc["rows"])
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
    return doc


def row_text(r: dict) -> str:
    sites = ", ".join(f"{s['mean']:.2f} ± {s['ci95']:.2f}" for s in r["sites"])
    return (
        f"| {r['arm']} | {r['eval']['mean']:.3f} ± {r['eval']['ci95']:.3f} | {sites} | "
        f"{fmt_bytes(r['bytes_per_site_step'])} | {r['params_per_site']:,} |"
    )


def table_text(doc: dict) -> str:
    """The markdown table of a ``train`` JSON: Eq. 8 with its interval, the paired Δ against
    the first arm (the cyclic ring; seed by seed, so the seeds' common swing cancels), each
    site's mean held-out loss (the widest of their intervals beside them), bytes and state."""
    rows = doc["rows"]
    base = rows[0]["eval_losses"]
    lines = [
        f"| arm | held-out Eq. 8 | Δ vs {short_name(rows[0]['arm'])}, paired | each site's "
        "held-out loss (widest ±) | bytes / site / step (computed) | parameters / site | "
        "AdamW state / site (computed) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        d = interval([a - b for a, b in zip(r["eval_losses"], base)])
        delta = "—" if r is rows[0] else f"{d['mean']:+.3f} ± {d['ci95']:.3f}"
        sites = ", ".join(f"{s['mean']:.2f}" for s in r["sites"])
        widest = max(s["ci95"] for s in r["sites"])
        parts = r["bytes_parts"]
        traffic = fmt_bytes(r["bytes_per_site_step"])
        if parts["hops"] and (parts["er"] or parts["groups"]):
            syncs = fmt_bytes(parts["er"] + parts["groups"])
            traffic += f" ({fmt_bytes(parts['hops'])} hops + {syncs} syncs)"
        if r["kind"] == "pooled":
            traffic = "0 (the raw data itself is pooled)"
        lines.append(
            f"| {r['arm']} | {r['eval']['mean']:.3f} ± {r['eval']['ci95']:.3f} | {delta} | "
            f"{sites} (± ≤ {widest:.2f}) | {traffic} | {r['params_per_site']:,} | "
            f"{fmt_bytes(r['state_bytes_per_site'])} |"
        )
    return "\n".join(lines)


def fmt_bytes(b: float) -> str:
    if b == 0:
        return "0"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if b >= scale:
            return f"{b / scale:.3g} {unit}"
    return f"{b:.0f} B"


# -------------------------------------------------------------------------- project
@dataclass(frozen=True)
class Shape:
    name: str
    n_layer: int
    d: int
    vocab: int = 50304
    seq: int = 1024

    @property
    def params(self) -> int:
        return model_params(self.n_layer, self.d, self.vocab)


SHAPES = (
    Shape("gpt2-small", 12, 768),  # the gpt2-small preset: 124M
    Shape("1B", 18, 2048),  # 18 blocks of width 2048 and the GPT-2 vocabulary: 1.01B
)
CODEC_RATIO = {"fp32": 1.0, "codec": (66 + 34) / (2 * 4 * 64), "tokens d/4": 0.049153645833333336}
"""Hop bytes over fp32: int8 forward (64 values + a bf16 scale per group of 64: 66 B) and
int4 backward (34 B) against 256 B of fp32 each way (as ``compression.step_bytes`` gives
for ``--wire fwd=int8,bwd=int4``). ``tokens d/4``: tokens mode with rank d / 4 and the same
codec at gpt2-small (its hops' payload over fp32 states, ``race.sent_bytes``; tested)."""
INT4_RATIO = 4.25 / 32
"""E/R in int4 (a bf16 scale per group of 64: 4.25 bits a value) over fp32."""


def ring_step_bytes(shape: Shape, P: int, batch: int, ratio: float, rank_div: int = 1) -> float:
    """Hop bytes one ring site sends per step: 2·P hidden states or gradients (L = 1) of
    batch × seq × d (÷ ``rank_div`` with a subspace), times the codec's ratio to fp32."""
    return 2 * P * batch * shape.seq * (shape.d // rank_div) * 4 * ratio


def project_arm(
    shape: Shape,
    arm: str,
    *,
    sites: int,
    batch: int,
    flops: float,
    rate_bps: float,
    rtt_s: float = 0.0,
    H: int = 1,
    er_every: int = 1,
    er_ratio: float = 1.0,
    ratio: float = 1.0,
    rank_div: int = 1,
    down_ratio: float = 1.0,
) -> dict[str, float]:
    """Seconds per step and per 1 B tokens (over all sites together) of one arm.

    Compute per site and step is 6·N·(batch·seq) FLOPs at ``flops`` FLOP/s for both: the ring
    splits every origin's tokens over its P = ``sites`` groups, DiLoCo trains the whole model
    on its own tokens. The ring's step is ``wan.project``'s: its hops overlap compute
    (max(compute, transfer) + K·RTT, K = P), then its E/R are averaged once per ``er_every``
    steps (blocking: up to the coordinator at ``er_ratio`` of fp32, then the average back
    down at ``down_ratio`` of fp32: 1 for fp32, ``INT4_RATIO`` for ``--sync-down-codec
    int4``). DiLoCo's sync blocks too: compute + (weights up at ``er_ratio``, then down at
    ``down_ratio``, of fp32)/H + RTT/H; the way down comes once per sync (an evaluating
    round's train message leaves out the model its evaluate brought). The way down was left out
    before the race measured it (``race.py``: DiLoCo H = 10 ran at 1.00× the projection with
    it, about half without)."""
    from wan import project

    tokens_site = batch * shape.seq
    compute = 6 * shape.params * tokens_site / flops
    er = shape.vocab * shape.d * 4 * er_ratio
    if arm == "ring":
        hops = ring_step_bytes(shape, sites, batch, ratio, rank_div)
        step = project(compute, hops, rate_bps, rtt_s, sites)["step_s"]
        er_down = shape.vocab * shape.d * 4 * down_ratio  # the synced E/R, down codec's size
        step += (8 * (er + er_down) / rate_bps + rtt_s) / er_every
        sent = hops + er / er_every
    elif arm == "diloco":
        sent = 4 * shape.params * er_ratio / H
        both = er_ratio + down_ratio  # up, then down: a blocking sync round crosses the link twice
        step = compute + (both * 8 * 4 * shape.params / rate_bps + rtt_s) / H
    else:
        raise ValueError(f"arm {arm!r}: ring or diloco")
    steps = 1e9 / (sites * tokens_site)
    return {
        "compute_s": compute,
        "step_s": step,
        "bytes_per_site_step": sent,
        "hours_per_1B": steps * step / 3600,
        "compute_hours_per_1B": steps * compute / 3600,
    }


H200_TFLOPS = round(6 * 123_586_560 * 173_106 / 1e12)
"""128: the effective FLOP/s of gpt2-small trained whole on one H200 with TF32 matmuls,
173,106 tokens/s measured (docs/wan.md §6, ``benchmarks/gpu.py --batch 8 --tf32``), at 6·N
FLOPs per token."""

ER10 = {"er_every": 10, "er_ratio": INT4_RATIO}
PROJECT_ARMS = (
    ("ring fp32", "ring", {}),
    ("ring codec int8/int4", "ring", {"ratio": CODEC_RATIO["codec"]}),
    ("ring states-only", "ring", {"ratio": CODEC_RATIO["codec"], "rank_div": 4}),
    ("ring codec, E/R every 100 steps", "ring", {"ratio": CODEC_RATIO["codec"], "er_every": 100}),
    ("ring codec, E/R every 10 int4", "ring", {"ratio": CODEC_RATIO["codec"], **ER10}),
    (
        "ring tokens d/4 + codec, E/R every 10 int4",
        "ring",
        {"ratio": CODEC_RATIO["tokens d/4"], **ER10},
    ),
    (
        "ring tokens d/4 + codec, E/R every 10 int4 both ways",
        "ring",
        {"ratio": CODEC_RATIO["tokens d/4"], **ER10, "down_ratio": INT4_RATIO},
    ),
    ("DiLoCo H=1", "diloco", {"H": 1}),
    ("DiLoCo H=50", "diloco", {"H": 50}),
    ("DiLoCo H=100", "diloco", {"H": 100}),
    (
        "DiLoCo H=100, int4 both ways",
        "diloco",
        {"H": 100, "er_ratio": INT4_RATIO, "down_ratio": INT4_RATIO},
    ),
)
RATES = (("0.1 Gbit/s", 1e8), ("1 Gbit/s", 1e9))
UNMEASURED: dict[str, str] = {  # every other projected arm's quality is measured
    "ring tokens d/4 + codec, E/R every 10 int4 both ways": " (quality: one paired look)",
    "DiLoCo H=100, int4 both ways": " (quality not measured)",
}
GPUS = (("24 GB", 24 * 2**30), ("80 GB", 80 * 2**30))


SWEEP_WIDTHS = (512, 768, 1024, 1536, 2048, 2560, 3072, 4096, 5120, 6144, 8192)


def family(d: int, d_per_layer: float) -> Shape:
    """The shape of width ``d`` in the family n_layer = d / ``d_per_layer`` (at least 1)."""
    return Shape(f"d={d}", max(1, round(d / d_per_layer)), d)


def crossover(points: list[tuple[float, float, float]]) -> float | None:
    """The first model size (parameters) at which ``a`` ≤ ``b`` of (params, a, b) points in
    increasing size, interpolated linearly in log size between the two points around it;
    None if ``a`` stays above."""
    prev = None
    for n, a, b in points:
        if a <= b:
            if prev is None:
                return n
            n0, a0, b0 = prev
            f = (a0 - b0) / ((a0 - b0) - (a - b))
            return math.exp(math.log(n0) + f * (math.log(n) - math.log(n0)))
        prev = (n, a, b)
    return None


def projection(args: argparse.Namespace) -> dict:
    def one(shape: Shape, arm: str, rate: float, kw: dict) -> dict:
        return project_arm(
            shape,
            arm,
            sites=args.sites,
            batch=args.batch,
            flops=args.tflops * 1e12,
            rate_bps=rate,
            rtt_s=args.rtt_ms / 1000,
            **kw,
        )

    rows, sweep = [], []
    for shape in SHAPES:
        for name, arm, kw in PROJECT_ARMS:
            for rate_name, rate in RATES:
                p = one(shape, arm, rate, kw)
                rows.append({"model": shape.name, "arm": name, "rate": rate_name, **p})
    for d in SWEEP_WIDTHS:
        shape = family(d, args.d_per_layer)
        for name, arm, kw in PROJECT_ARMS:
            for rate_name, rate in RATES:
                p = one(shape, arm, rate, kw)
                sweep.append(
                    {"d": d, "n_layer": shape.n_layer, "params": shape.params, "arm": name,
                     "rate": rate_name, **p}
                )  # fmt: skip
    cross = {}
    for rate_name, _ in RATES:
        hours = {(r["arm"], r["d"]): r for r in sweep if r["rate"] == rate_name}
        for ring in (
            "ring codec int8/int4",
            "ring codec, E/R every 100 steps",
            "ring codec, E/R every 10 int4",
            "ring tokens d/4 + codec, E/R every 10 int4",
        ):
            pts = [
                (hours[(ring, d)]["params"], hours[(ring, d)]["hours_per_1B"],
                 hours[("DiLoCo H=100", d)]["hours_per_1B"])
                for d in SWEEP_WIDTHS
            ]  # fmt: skip
            cross[f"{ring} vs DiLoCo H=100, {rate_name}"] = crossover(pts)
    limits = {
        gpu: {
            "whole_model_params": max_whole_model(mem),
            "ring_model_params_P": {str(P): ring_limit(mem, P, args.d_per_layer) for P in (4, 8)},
        }
        for gpu, mem in GPUS
    }
    memory = {
        s.name: {
            "params": s.params,
            "whole_model_state_bytes": state_bytes(s.params),
            "ring_site_state_bytes": {
                str(P): state_bytes(site_params(s.n_layer, s.d, s.vocab, P)) for P in (4, 8)
            },
        }
        for s in SHAPES
    }
    doc = {
        "assumptions": {
            "flops_per_token": "6·N (forward and backward)",
            "effective_tflops_per_site": args.tflops,
            "sites": args.sites,
            "batch_per_site": args.batch,
            "seq": SHAPES[0].seq,
            "rtt_ms": args.rtt_ms,
            "sweep_family": f"n_layer = d / {args.d_per_layer:g}, vocabulary 50304, seq 1024",
            "d_per_layer": args.d_per_layer,
            "bytes_per_param_training": BYTES_PER_PARAM,
        },
        "rows": rows,
        "sweep": sweep,
        "crossover_params": cross,
        "limits": limits,
        "memory": memory,
    }
    print(projection_text(doc))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
    return doc


def ring_limit(memory_bytes: float, P: int, d_per_layer: float, vocab: int = 50304) -> float:
    """The largest model (parameters) whose ring site (n_layer / P blocks and its E/R) fits
    in ``memory_bytes`` of AdamW state, over the family of shapes with n_layer = d /
    ``d_per_layer`` (depth taken as continuous) and a ``vocab``-wide tied embedding; found by
    bisection on the width d."""

    def shape(d: float) -> tuple[float, float]:  # (site parameters, model parameters)
        blocks = d / d_per_layer * (12 * d * d + 2 * d)
        return blocks / P + vocab * d, blocks + vocab * d

    lo, hi = 8.0, 1e6
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if BYTES_PER_PARAM * shape(mid)[0] <= memory_bytes else (lo, mid)
    return shape(lo)[1]


def projection_text(doc: dict) -> str:
    a = doc["assumptions"]
    lines = [
        f"{a['sites']} sites, batch {a['batch_per_site']} × {a['seq']} tokens per site and "
        f"step, {a['flops_per_token']} FLOPs per token at {a['effective_tflops_per_site']} "
        f"TFLOP/s per site, RTT {a['rtt_ms']} ms",
        "",
        "| model | arm | MB sent / site / step | "
        + " | ".join(f"h per 1B tokens at {r}" for r, _ in RATES)
        + " | compute-only h |",
        "|---|---|---|" + "---|" * (len(RATES) + 1),
    ]
    by = {(r["model"], r["arm"], r["rate"]): r for r in doc["rows"]}
    for shape in SHAPES:
        for name, _, _ in PROJECT_ARMS:
            first = by[(shape.name, name, RATES[0][0])]
            cells = [f"{by[(shape.name, name, r)]['hours_per_1B']:.1f}" for r, _ in RATES]
            lines.append(
                f"| {shape.name} ({shape.params / 1e6:,.0f}M) | {name} | "
                f"{first['bytes_per_site_step'] / 1e6:,.1f} | " + " | ".join(cells) + " | "
                f"{first['compute_hours_per_1B']:.2f} |"
            )
    lines.append("")
    for what, n in doc["crossover_params"].items():
        at = "never in the sweep" if n is None else f"from {n / 1e9:.2f}B parameters"
        lines.append(f"{what}: the ring is faster {at}")
    lines.append("")
    for gpu, lim in doc["limits"].items():
        ring = ", ".join(f"P = {P}: {v / 1e9:.1f}B" for P, v in lim["ring_model_params_P"].items())
        lines.append(
            f"{gpu}: whole model with AdamW up to {lim['whole_model_params'] / 1e9:.2f}B "
            f"parameters; a ring site up to ({ring})"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------- figure
def figure(args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tables = [json.loads(Path(p).read_text()) for p in args.tables]
    proj = json.loads(Path(args.projection).read_text())
    fig, axes = plt.subplots(1, 3, figsize=(17, 6.2), gridspec_kw={"width_ratios": [1.3, 1, 0.8]})
    ax = axes[0]
    names: list[str] = []
    for t in tables:
        for r in t["rows"]:
            short = short_name(r["arm"])
            if short not in names:
                names.append(short)
    colors = ["tab:blue", "tab:orange"]
    for k, t in enumerate(tables):
        S = len(t["rows"][0]["sites"])
        base = t["rows"][0]["eval_losses"]
        for r in t["rows"]:
            y = names.index(short_name(r["arm"])) + (k - 0.5) * 0.3
            d = interval([a - b for a, b in zip(r["eval_losses"], base)])
            h = 0.0 if r is t["rows"][0] else d["ci95"]
            ax.errorbar(d["mean"], y, xerr=h, fmt="o", color=colors[k], capsize=3,
                        label=f"{S} sites: {short_name(r['arm'])} at "
                              f"{r['eval']['mean']:.2f} ± {r['eval']['ci95']:.2f}"
                        if r is t["rows"][0] else None)  # fmt: skip
    ax.axvline(0, color="grey", linewidth=0.8)
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("held-out Eq. 8 minus the cyclic ring's,\npaired by seed (95 % t-interval)")
    ax.set_title(
        "Quality per token (cpu-tiny, 100 steps, seeds 0-2)\nleft of 0: better than the ring"
    )
    ax.legend(loc="lower right", fontsize=7)
    ax.grid(axis="x", alpha=0.3)

    ax = axes[1]
    a = proj["assumptions"]
    colors2 = dict(
        zip([n for n, _, _ in PROJECT_ARMS], plt.rcParams["axes.prop_cycle"].by_key()["color"])
    )
    for name, _, _ in PROJECT_ARMS:
        for (rate, _), style in zip(RATES, ("--", "-")):
            pts = [r for r in proj["sweep"] if r["arm"] == name and r["rate"] == rate]
            ax.plot([r["params"] / 1e9 for r in pts], [r["hours_per_1B"] for r in pts],
                    linestyle=style, color=colors2[name],
                    label=(name + UNMEASURED.get(name, "")) if style == "-" else None)  # fmt: skip
    pts = [r for r in proj["sweep"] if r["arm"] == PROJECT_ARMS[0][0] and r["rate"] == RATES[0][0]]
    ax.plot([r["params"] / 1e9 for r in pts], [r["compute_hours_per_1B"] for r in pts],
            color="black", linewidth=2, label="compute alone")  # fmt: skip
    for gpu, lim in proj["limits"].items():
        ax.axvline(lim["whole_model_params"] / 1e9, color="grey", linewidth=0.8)
        ax.text(lim["whole_model_params"] / 1e9 * 1.05, 0.15, f"whole model > {gpu}",
                rotation=90, fontsize=7)  # fmt: skip
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(f"model parameters (billions; {a['sweep_family']})")
    ax.set_ylabel("projected hours per 1B tokens, 4 sites")
    ax.set_title(
        f"Wall-clock: 1 Gbit/s solid, 0.1 Gbit/s dashed\n"
        f"({a['effective_tflops_per_site']:g} TFLOP/s per site, 6·N FLOPs per token)",
        fontsize=10,
    )
    ax.legend(fontsize=7, loc="upper left")
    ax.grid(alpha=0.3)

    ax = axes[2]
    shapes = [
        family(d, proj["assumptions"].get("d_per_layer", 128)) for d in range(256, 16384, 128)
    ]
    xs = [sh.params / 1e9 for sh in shapes]
    ax.plot(xs, [state_bytes(sh.params) / 2**30 for sh in shapes],
            label="whole model (DiLoCo, FedAvg)")  # fmt: skip
    for P in (4, 8):
        site = [(sh.params - sh.vocab * sh.d) / P + sh.vocab * sh.d for sh in shapes]
        ax.plot(xs, [state_bytes(int(n)) / 2**30 for n in site],
                linestyle="--", label=f"ring site: 1/{P} of the blocks + E/R")  # fmt: skip
    for gpu, mem in GPUS:
        ax.axhline(mem / 2**30, color="grey", linewidth=0.8)
        ax.text(xs[0], mem / 2**30 * 1.08, f"{gpu} GPU", fontsize=8)
    for s in SHAPES:
        ax.axvline(s.params / 1e9, color="black", linewidth=0.5, linestyle=":")
        ax.text(s.params / 1e9, 0.2, s.name, rotation=90, fontsize=7)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("model parameters (billions)")
    ax.set_ylabel("AdamW training state per site, GiB (16 B/param; activations extra)")
    ax.set_title("Who can hold the model")
    ax.legend(fontsize=7, loc="upper left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


def short_name(arm: str) -> str:
    """An arm's name without the site count, so that 4 and 8 sites share a row."""
    import re

    arm = arm.replace(f", codec {CODEC}", ", codec int8/int4")
    arm = re.sub(r"\(P=\d+, R=\d+\)", "(P=1)", arm)
    arm = re.sub(r"\((\d+ rings of )?P=\d+(, H=1)?\)", "", arm)
    arm = re.sub(r"\(P=\d+, split [\d,]+\)", "(one ring, uneven split)", arm)
    arm = re.sub(r"\(R=\d+, P=\d+, H=1\)", "(P=2)", arm)
    arm = re.sub(r"\(P=1, batch ×\d+\)", "(P=1)", arm)
    arm = re.sub(r"\(P=\d+\), private", "private", arm)
    return re.sub(r"\s+", " ", arm).replace(" ,", ",").strip()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="part", required=True)
    tr = sub.add_parser("train", help="quality per token of every arm (reference engine)")
    tr.add_argument("--sites", type=int, default=4)
    tr.add_argument("--preset", default="cpu-tiny")
    tr.add_argument("--steps", type=int, default=100)
    tr.add_argument("--batch-size", type=int, default=4)
    tr.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    tr.add_argument(
        "--arms", nargs="+", help="only arms whose name contains one of these (=NAME: exactly)"
    )
    tr.add_argument("--json", type=Path, help="write the rows here")
    tr.add_argument("--append", action="store_true", help="add the rows to --json's")
    pj = sub.add_parser("project", help="wall-clock per 1B tokens and memory limits")
    pj.add_argument("--sites", type=int, default=4)
    pj.add_argument("--batch", type=int, default=8, help="sequences per site and step")
    pj.add_argument("--tflops", type=float, default=H200_TFLOPS, help="effective TFLOP/s per site")
    pj.add_argument("--rtt-ms", type=float, default=0.0)
    pj.add_argument("--d-per-layer", type=float, default=128.0, help="width / depth of the family")
    pj.add_argument("--json", type=Path)
    tb = sub.add_parser("table", help="the markdown table of train JSON files")
    tb.add_argument("files", type=Path, nargs="+")
    fg = sub.add_parser("figure", help="the figure of docs/ring-or-diloco.md")
    tables = [RESULTS / f"peers-cpu-tiny-{S}sites.json" for S in (4, 8)]
    fg.add_argument("--tables", nargs="+", default=tables)
    fg.add_argument("--projection", type=Path, default=RESULTS / "projection.json")
    fg.add_argument("--out", type=Path, default=Path("docs/ring-or-diloco.png"))
    race.add_parser(sub)
    args = ap.parse_args(argv)
    if args.part == "race":
        return race.main(args)
    if args.part == "train":
        train(args)
    elif args.part == "table":
        for f in args.files:
            print(table_text(json.loads(f.read_text())) + "\n")
    elif args.part == "project":
        projection(args)
    else:
        figure(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
