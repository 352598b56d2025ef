"""The race (issue 54 item 2): the ring and DiLoCo as real coordinator and worker processes,
one network namespace per site (``mobius-fed testbed``, docker/compose.yaml), over links
shaped so that each arm's traffic costs what it would cost a GPU site.

A CPU site stands in for a GPU site by its link. For each arm A:

    c_gpu      = tokens per site and step / GPU_TOKENS_S       (gpt2-small, one GPU, measured)
    c_cpu(A)   = A's measured compute per worker and step here (a short unshaped calibration)
    k(A)       = c_cpu(A) / c_gpu                              (time on this machine per GPU second)
    B_gpu(A)   = bytes one site sends per step if A trained gpt2-small (exact payloads, amortised:
                 hops every step, E/R once per sync_every, F_i once per ring_sync_every)
    B_cpu(A)   = the same for the preset raced here
    rate(A)    = R × B_cpu(A) / (k(A) × B_gpu(A))              (R: 1 Gbit/s or 0.1 Gbit/s)
    delay(A)   = k(A) × RTT / 2                                (one way)

so what A sends per step takes the same multiple of its compute here as it would for
gpt2-small at rate R. The projection beside each measurement is ``peers.py``'s step model
at gpt2-small, times k(A): the ring max(compute, hops) + P·RTT, plus its E/R round
(up, then down, + RTT) once per ``sync_every``; DiLoCo compute plus its sync (up, then
down, + RTT) once per H. The formula's inputs, the factors and both tokens/s are printed and kept.

Per arm and seed: Eq. 8 (held-out, every 100 steps) against wall-clock and tokens, the time
to reach DiLoCo H = 100's final Eq. 8 (same seed; linear between evaluations), tokens/s
measured (first to last step, the start-up left out) and projected. Runs are kept one JSON
each under ``benchmarks/results/race/<tag>/runs/`` (a run already there is not run again).

    python benchmarks/peers.py race                    # 3 seeds, 1000 steps, 1 Gbit/s-matched
    python benchmarks/peers.py race --quick            # one seed, 300 steps
    python benchmarks/peers.py race --rate 100mbit     # the 0.1 Gbit/s-matched links
    python benchmarks/peers.py race --report           # the table and figure from kept runs

Root only (namespaces, ``tc``, ``iptables``). Pinned: one torch thread per worker.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

REPO = Path(__file__).resolve().parents[1]
COMPOSE = REPO / "docker" / "compose.yaml"
RESULTS = Path(__file__).parent / "results" / "race"
GPU_TOKENS_S = 173_106.0
"""gpt2-small trained whole on one GPU (H200, TF32 matmuls, batch 8 × 1024): tokens/s
measured with ``benchmarks/gpu.py --batch 8 --tf32`` (docs/wan.md §6); the only GPU figure
this project has measured. An H100 is somewhat slower: a slower GPU makes every link
relatively faster, which helps the ring more than DiLoCo."""
NO_AUDITS = {"MOBIUS_AUDIT__RATE": "0"}
"""Every arm runs without audits by recomputation: the race compares the two methods, and
an audit's upload (the frames a site received over its window, plus its group's state)
rides in the train reply the barrier waits for. At DiLoCo's P = 1 that is every tensor its
home and its blocks passed each other for the whole audited round (at cpu-tiny, H = 100,
about 15 MB: 90 to 230 s of the matched link per audit, one or two in each 1000-step DiLoCo
run kept before this), and nothing the projection counts. What audits cost a ring is
measured on its own (docs/audits.md)."""
NO_COMMITMENTS = {"MOBIUS_AUDIT__COMMITMENTS": "false"}
"""An arm without the signed frame commitments (docs/security.md "Commitments"): a site's
train reply carries one entry of about 100 bytes per ring frame it sent or received, a size
fixed by the frame count, not the model. At cpu-tiny, P = 4, M = 1 that is 15 kB a site
and round of 10 steps beside 148 kB of hops and 5.4 kB of E/R, and the matched link
stretches its time as much as any byte's (the arm's keepalive scale, 640–1,550×) while at
gpt2-small it would be 1.5 kB a step beside 14 MB of hops. The arm with them is kept."""


CODEC = {"MOBIUS_WIRE__FWD": "int8", "MOBIUS_WIRE__BWD": "int4"}
CODEC["MOBIUS_WIRE__ROUNDING"] = "stochastic"
ER = {"MOBIUS_SYNC_EVERY": "10", "MOBIUS_SYNC__CODEC": "int4", **NO_AUDITS}
"""The ring's E/R setting: every 10 steps, int4 with error feedback (issue 54 item 1's best
within +0.02 Eq. 8 of every-step fp32 at cpu-small, docs/ring-or-diloco.md)."""
SITES = 4
MICRO = {"MOBIUS_MICRO_BATCHES": "2"}
RANK_DIV = 4
"""Tokens mode's rank is d / 4 at both scales: at cpu-tiny's width 32, d / 8 (rank 4) cost
+0.23 Eq. 8 against the codec ring after 1000 steps and d / 4 +0.04 (seed 0,
``mobius-fed local --preset cpu-tiny --steps 1000 --batch-size 8 --optimizer adamw
--sync-every 10 --sync-codec int4 --subspace-mode tokens --subspace-writes full
--subspace-rank 4|8 --wire fwd=int8,bwd=int4,rounding=stochastic``)."""
DOWN = {"MOBIUS_SYNC__DOWN_CODEC": "int4"}
"""The E/R's way down in int4 too: the payload of the synced E/R's change since the last
broadcast (the coordinator keeps what the sites hold; docs/er-sync.md). A blocking sync
round crosses the link twice, up then down, and each way is counted (:func:`sent_bytes`)."""
EVAL_EVERY = 100


@dataclass(frozen=True)
class RaceArm:
    name: str
    env: dict[str, str] = field(default_factory=dict)  # the coordinator's MOBIUS_* settings
    kind: str = "ring"  # ring | diloco (calibrated once for every H)

    def train_config(self, preset: str, batch: int):
        """The TrainConfig of this arm at ``preset`` (what the coordinator builds from env)."""
        from mobius_fed.config import TrainConfig

        e = self.env
        kw: dict[str, Any] = dict(preset=preset, workers=SITES, batch_size=batch)
        kw["rings"] = int(e.get("MOBIUS_RINGS", "1"))
        kw["sync_every"] = int(e.get("MOBIUS_SYNC_EVERY", "1"))
        kw["ring_sync_every"] = int(e.get("MOBIUS_RING_SYNC_EVERY", "1"))
        kw["micro_batches"] = int(e.get("MOBIUS_MICRO_BATCHES", "1"))
        kw["ring_codec"] = e.get("MOBIUS_RING_CODEC", "none")
        kw["ring_down_codec"] = e.get("MOBIUS_RING_DOWN_CODEC", "fp32")
        if "MOBIUS_SYNC__CODEC" in e:
            kw["sync"] = {"codec": e["MOBIUS_SYNC__CODEC"]}
        if "MOBIUS_SYNC__DOWN_CODEC" in e:
            kw["sync"] = {**kw.get("sync", {}), "down_codec": e["MOBIUS_SYNC__DOWN_CODEC"]}
        if "MOBIUS_WIRE__FWD" in e:
            kw["wire"] = {"fwd": e["MOBIUS_WIRE__FWD"], "bwd": e["MOBIUS_WIRE__BWD"]}
        if "MOBIUS_SUBSPACE__MODE" in e:
            from mobius_fed.model.config import PRESETS

            d = PRESETS[preset]["d_model"]
            kw["subspace"] = {
                "rank": d // RANK_DIV,
                "mode": e["MOBIUS_SUBSPACE__MODE"],
                "writes": "full",
            }
        return TrainConfig(**kw)


def arms() -> list[RaceArm]:
    def diloco(H: int) -> RaceArm:
        env = {"MOBIUS_RINGS": str(SITES), "MOBIUS_SYNC_EVERY": str(H)}
        env |= {"MOBIUS_RING_SYNC_EVERY": str(H), "MOBIUS_RING_OUTER": "diloco"}
        env |= NO_AUDITS
        return RaceArm(f"DiLoCo H={H}", {**env, "MOBIUS_STRATEGY": "diloco"}, "diloco")

    def whole_int4(H: int) -> RaceArm:
        env = {**diloco(H).env, "MOBIUS_RING_CODEC": "int4", "MOBIUS_RING_DOWN_CODEC": "int4"}
        env |= {"MOBIUS_SYNC__CODEC": "int4", **DOWN}
        return RaceArm(f"DiLoCo H={H}, whole model int4 both ways", env, "diloco")

    tokens = {"MOBIUS_SUBSPACE__MODE": "tokens", "MOBIUS_SUBSPACE__WRITES": "full"}
    return [
        RaceArm(
            f"ring tokens (d/{RANK_DIV}), codec, E/R 10 int4",
            {**CODEC, **ER, **tokens},
            "ring-tokens",
        ),
        RaceArm(
            f"ring tokens (d/{RANK_DIV}), codec, E/R 10 int4 both ways",
            {**CODEC, **ER, **DOWN, **tokens},
            "ring-tokens",
        ),
        RaceArm(
            f"ring tokens (d/{RANK_DIV}), codec, E/R 10 int4 both ways, commitments off",
            {**CODEC, **ER, **DOWN, **tokens, **NO_COMMITMENTS},
            "ring-tokens",
        ),
        RaceArm("ring codec, E/R 10 int4", {**CODEC, **ER}, "ring-codec"),
        RaceArm("ring codec, E/R 10 int4 both ways", {**CODEC, **ER, **DOWN}, "ring-codec"),
        # two micro-batches per stream: a worker computes one while the other travels
        RaceArm(
            f"ring tokens (d/{RANK_DIV}), codec, E/R 10 int4, M=2",
            {**CODEC, **ER, **tokens, **MICRO},
            "ring-tokens-m2",
        ),
        RaceArm("ring codec, E/R 10 int4, M=2", {**CODEC, **ER, **MICRO}, "ring-codec-m2"),
        diloco(10),
        diloco(50),  # the H that won the peers table at 4 sites (docs/ring-or-diloco.md)
        diloco(100),
        # DiLoCo compressed: its groups' pseudo-gradients in int4 (the E/R in fp32)
        RaceArm(
            "DiLoCo H=100, int4 groups", {**diloco(100).env, "MOBIUS_RING_CODEC": "int4"}, "diloco"
        ),
        # and the synced groups back down as int4 payloads of their change (the E/R, under
        # P = 1 a handful of tensors beside the blocks, in fp32)
        RaceArm(
            "DiLoCo H=100, int4 both ways",
            {**diloco(100).env, "MOBIUS_RING_CODEC": "int4", "MOBIUS_RING_DOWN_CODEC": "int4"},
            "diloco",
        ),
        # DiLoCo at its strongest here: the whole model, groups and E/R, int4 both ways,
        # each site keeping its residuals; at H = 100, and at H = 10 and 50, whose syncs
        # cost a tenth and a half as much as fp32 H = 100's in bytes per step
        *(whole_int4(H) for H in (100, 10, 50)),
    ]


# ------------------------------------------------------------------ bytes and scaling
def sent_bytes(cfg) -> dict[str, float]:
    """Bytes one site's link carries per step (exact payloads, amortised): the ring hops it
    sends; its E/R up (the sync codec's payload) and down (the synced E/R in fp32, or the
    down codec's payload) once per sync_every; its F_i up (the ring codec's payload, or
    fp32) and down (the synced F_i in fp32, or the ring down codec's payload) once per
    ring_sync_every (the one fp32 broadcast a run starts with left out). Each sync's way
    down comes once, with the evaluate message on an evaluating round and otherwise with
    the train message."""
    from compression import step_bytes

    from mobius_fed.model import build_replica
    from mobius_fed.model.config import near_even_split
    from mobius_fed.transport.compress import Codec

    mc = cfg.model()
    hops = step_bytes(cfg.model_copy(update={"workers": cfg.P, "rings": 1}))[0] / cfg.P
    shapes = [tuple(t.shape) for t in build_replica(mc, 0).shared_state_dict().values()]

    def payload(codec: str, shape: tuple[int, ...]) -> int:
        return Codec(codec).payload_bytes(shape) if codec != "none" else 4 * math.prod(shape)

    d = mc.d_model
    blocks = max(near_even_split(mc.n_layer, cfg.P)) if cfg.P > 1 else mc.n_layer
    block = [(3 * d, d), (d, d), (4 * d, d), (d, 4 * d), (d,), (d,)]  # peers.block_params
    groups = cfg.rings > 1
    down, ring_down = (
        c.replace("fp32", "none") for c in (cfg.sync.down_codec, cfg.ring_down_codec)
    )
    codecs = (cfg.ring_codec, ring_down)
    group = {c: blocks * sum(payload(c, s) for s in block) for c in codecs}
    return {
        "hops": float(hops if cfg.P > 1 else 0.0),
        "er": sum(payload(cfg.sync.codec, s) for s in shapes) / cfg.sync_every,
        "groups": group[cfg.ring_codec] / cfg.ring_sync_every if groups else 0.0,
        "er_down": sum(payload(down, s) for s in shapes) / cfg.sync_every,
        "groups_down": group[ring_down] / cfg.ring_sync_every if groups else 0.0,
    }


def step_model(cfg, compute_s: float, rate_bps: float, rtt_s: float) -> float:
    """Seconds per step by peers.py's model (the bytes of :func:`sent_bytes`): a blocking
    sync sends its update up, then receives the synced model down."""
    b = sent_bytes(cfg)
    if cfg.P > 1:  # a ring: hops overlap compute, K = P one-way delays a step, E/R blocks
        step = max(compute_s, 8 * b["hops"] / rate_bps) + cfg.P * rtt_s
        return step + 8 * (b["er"] + b["er_down"]) / rate_bps + rtt_s / cfg.sync_every
    sync = 8 * (b["er"] + b["groups"] + b["er_down"] + b["groups_down"]) / rate_bps
    return compute_s + sync + rtt_s / cfg.ring_sync_every


@dataclass(frozen=True)
class Link:
    """One arm's emulated link and the numbers it was derived from."""

    compute_cpu_s: float
    compute_gpu_s: float
    bytes_cpu: float
    bytes_gpu: float
    rate_bps: float
    delay_s: float
    projected_step_s: float
    keepalive_scale: float = 1.0

    @property
    def k(self) -> float:
        return self.compute_cpu_s / self.compute_gpu_s


def scale_link(arm: RaceArm, args, compute_cpu_s: float) -> Link:
    """The link that makes ``arm``'s traffic cost here what gpt2-small's would at args.rate;
    refused when the shaper cannot make it (below 8 kbit/s, or a delay over 10 s)."""
    from mobius_fed.transport.link_tuning import parse_rate
    from mobius_fed.transport.tls import MAX_KEEPALIVE_SCALE

    rate_gpu = float(parse_rate(args.rate))
    gpu = arm.train_config("gpt2-small", 8)
    cpu = arm.train_config(args.preset, args.batch)
    c_gpu = gpu.batch_size * gpu.model().seq_len / GPU_TOKENS_S
    k = compute_cpu_s / c_gpu
    b_gpu, b_cpu = sum(sent_bytes(gpu).values()), sum(sent_bytes(cpu).values())
    rate = rate_gpu * b_cpu / (k * b_gpu)
    delay = k * args.rtt_ms / 2000
    if rate < 8_000:
        raise SystemExit(
            f"{arm.name}: the matched link would be {rate:.0f} bit/s, below the shaper's "
            "8 kbit/s (tc tbf as the testbed sets it): race a larger preset or batch"
        )
    if delay > 10:
        raise SystemExit(f"{arm.name}: one-way delay {delay:.1f} s over the delay line's 10 s")
    projected = k * step_model(gpu, c_gpu, rate_gpu, args.rtt_ms / 1000)
    scale = min(MAX_KEEPALIVE_SCALE, max(1.0, rate_gpu / rate))
    return Link(compute_cpu_s, c_gpu, b_cpu, b_gpu, rate, delay, projected, scale)


# ------------------------------------------------------------------ one run in the testbed
def coordinator_env(arm: RaceArm, args, steps: int, seed: int) -> dict[str, str]:
    env = {
        "MOBIUS_PRESET": args.preset,
        "MOBIUS_STEPS": str(steps),
        "MOBIUS_BATCH_SIZE": str(args.batch),
        "MOBIUS_SEED": str(seed),
        "MOBIUS_OPTIMIZER": "adamw",
        "MOBIUS_EVAL_EVERY": str(EVAL_EVERY if steps >= EVAL_EVERY else steps),
        "MOBIUS_EVAL_BATCHES": "4",
        "MOBIUS_CHECKPOINT_EVERY": "0",
        "MOBIUS_LINGER": "0",
        "MOBIUS_RUN_ID": "race",
        "MOBIUS_RESUME": "false",
        "MOBIUS_HEARTBEAT_TIMEOUT": "120",
    }
    if arm.env.get("MOBIUS_SUBSPACE__MODE"):
        from mobius_fed.model.config import PRESETS

        env["MOBIUS_SUBSPACE__RANK"] = str(PRESETS[args.preset]["d_model"] // RANK_DIV)
    return {**env, **arm.env}


TICKS = os.sysconf("SC_CLK_TCK")
FOREIGN_LIMIT = 0.25
"""Cores of CPU that processes outside a run may use during it before the run is redone."""


def machine_cpu() -> float:
    """Busy CPU seconds of the whole machine so far (``/proc/stat``, idle and iowait out)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / TICKS


def own_cpu() -> float:
    """CPU seconds of this process and its reaped children (a torn-down testbed's services:
    ``ip netns exec`` execs into them, and the supervisor waits for each)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def wait_for_quiet(limit: float = 1.0, patience_s: float = 900.0) -> float:
    """Wait (up to ``patience_s``) until the 1-minute load average is under ``limit``: a run
    beside another CPU-heavy job would time that job, not the arm. The load at the start."""
    deadline = time.monotonic() + patience_s
    while (load := os.getloadavg()[0]) >= limit and time.monotonic() < deadline:
        time.sleep(10)
    return load


def run_testbed(arm: RaceArm, args, steps: int, seed: int, link: Link | None) -> dict:
    """One run of ``arm``: the coordinator's per-round metrics, read after it exits."""
    from mobius_fed.testbed import Testbed
    from mobius_fed.testbed.wan import WanShape

    wan = {}
    if link is not None:
        shape = WanShape(int(link.rate_bps), link.delay_s)
        wan = {f"worker-{i}": shape for i in range(SITES)}  # the coordinator: a data centre
    env = {"coordinator": coordinator_env(arm, args, steps, seed)}
    if link is not None:  # the link's queues hold keepalive_scale × the GPU site's time
        scale = {"MOBIUS_KEEPALIVE_SCALE": f"{link.keepalive_scale:.6g}"}
        env = {svc: {**env.get(svc, {}), **scale} for svc in ["coordinator", *wan]}
    load = wait_for_quiet()
    t0, machine0, own0 = time.monotonic(), machine_cpu(), own_cpu()
    with (
        tempfile.TemporaryDirectory(prefix="race") as tmp,
        Testbed(COMPOSE, tmp, env_overrides=env, wan=wan) as tb,
    ):
        tb.up(timeout=300)
        deadline = time.monotonic() + args.timeout
        while not tb.finished("coordinator"):
            if tb.failed():
                raise RuntimeError(tb.describe_failure(tb.failed()))
            if time.monotonic() > deadline:
                raise RuntimeError(f"{arm.name} seed {seed}: not done in {args.timeout} s")
            time.sleep(1)
        if tb.returncode("coordinator") != 0:
            raise RuntimeError(f"{arm.name}: coordinator exited {tb.returncode('coordinator')}"
                               f"\n{tb.log_tail('coordinator')}")  # fmt: skip
        metrics = next(tb.volume_path("coordinator-state").rglob("metrics.jsonl"))
        rounds = [json.loads(line) for line in metrics.read_text().splitlines() if line]
    rounds = [{k: v for k, v in r.items() if k not in ("losses", "origin_losses")} for r in rounds]
    foreign = (machine_cpu() - machine0 - (own_cpu() - own0)) / (time.monotonic() - t0)
    return {"rounds": rounds, "load_before": load, "foreign_cores": max(0.0, foreign)}


def quiet_run(arm: RaceArm, args, steps: int, seed: int, link: Link | None) -> dict:
    """:func:`run_testbed`, run again (twice at most) while other processes took more than
    FOREIGN_LIMIT cores during it."""
    for _ in range(3):
        ran = run_testbed(arm, args, steps, seed, link)
        if ran["foreign_cores"] <= FOREIGN_LIMIT:
            break
        print(f"{arm.name} seed {seed}: other processes used {ran['foreign_cores']:.2f} cores "
              "during the run; running it again", flush=True)  # fmt: skip
    return ran


def compute_per_step(rounds: list[dict]) -> float:
    """Median over workers of compute seconds per step (the first round left out when there
    are more: start-up)."""
    rs = rounds[1:] if len(rounds) > 1 else rounds
    steps = rs[-1]["step"] - (rounds[0]["step"] if len(rounds) > 1 else 0)
    per = {}
    for r in rs:
        for w, m in r["workers"].items():
            per[w] = per.get(w, 0.0) + m["compute_s"]
    return statistics.median(v / steps for v in per.values())


def timeline(rounds: list[dict]) -> dict[str, float]:
    """Where a step's time went, seconds per step over the run: the rounds' wall time
    (coordinator clock, evaluations left out) and its barrier part (outside the slowest
    worker's training), that worker's compute, wait for frames and other training time,
    and the evaluations and start-up between rounds."""
    steps = rounds[-1]["step"]
    total = {"step": 0.0, "barrier": 0.0, "compute": 0.0, "wait": 0.0, "other": 0.0}
    for r in rounds:
        slow = max(r["workers"].values(), key=lambda f: f["train_s"])
        total["step"] += r["seconds"]
        total["barrier"] += max(0.0, r["seconds"] - slow["train_s"])
        total["compute"] += slow.get("compute_s") or 0.0
        total["wait"] += slow.get("wait_s") or 0.0
        total["other"] += (
            slow["train_s"] - (slow.get("compute_s") or 0.0) - (slow.get("wait_s") or 0.0)
        )
    wall = rounds[-1]["time"] - (rounds[0]["time"] - rounds[0]["seconds"])
    out = {k: v / steps for k, v in total.items()}
    out["between_rounds"] = (wall - total["step"]) / steps
    return out


def measured_bytes(rounds: list[dict]) -> dict[str, float]:
    """Bytes per site and step the workers reported (median over workers): up, its E/R and
    F_i payloads; down, the arrays that came down for its rounds (their evaluates' too),
    beside :func:`sent_bytes`'s accounting in each kept run; and its signed commitments
    (up too, not in the accounting: a fixed size per frame, NO_COMMITMENTS)."""
    keys = ("up", "down", "commitment")
    per: dict[str, dict[str, float]] = {}
    for r in rounds:
        for w, m in r["workers"].items():
            d = per.setdefault(w, dict.fromkeys(keys, 0.0))
            d["up"] += (m.get("er_bytes") or 0.0) + (m.get("sync_bytes") or 0.0)
            d["down"] += m.get("down_bytes") or 0.0
            d["commitment"] += m.get("commitment_bytes") or 0.0
    steps = rounds[-1]["step"]
    return {k: statistics.median(d[k] for d in per.values()) / steps for k in keys}


def curve(rounds: list[dict], tokens_per_step: int) -> dict:
    """Eq. 8 against seconds since the first step began and against tokens."""
    t0 = rounds[0]["time"] - rounds[0]["seconds"]
    evals = [r for r in rounds if "eval_loss" in r]
    return {
        "steps": [r["step"] for r in evals],
        "seconds": [r["time"] - t0 for r in evals],
        "tokens": [r["step"] * tokens_per_step for r in evals],
        "eval": [r["eval_loss"] for r in evals],
        "wall_s": rounds[-1]["time"] - t0,
        "tokens_s": rounds[-1]["step"] * tokens_per_step / (rounds[-1]["time"] - t0),
    }


def k_of(run: dict, own: bool = False) -> float:
    """The run's k: its calibration's (the link was built from it), or with ``own`` the
    compute per step the run itself measured over the GPU site's."""
    if own:
        return run["compute_s"] / run["link"]["compute_gpu_s"]
    return run["link"]["k"]


def end_excess(run: dict) -> float:
    """Wall seconds the run's last evaluation interval took beyond the median of the ones
    between (the first holds start-up and the first broadcast): at its last round every
    site also sends the coordinator a copy of its final checkpoint, weights and optimizer
    state in fp32 (``state_copy``), which a DiLoCo site, holding the whole model, pays
    most for. 0 with fewer than 4 evaluations or uneven ones."""
    t, steps = [0.0, *run["curve"]["seconds"]], [0, *run["curve"]["steps"]]
    gaps = [b - a for a, b in itertools.pairwise(t)]
    if len(gaps) < 4 or len({b - a for a, b in itertools.pairwise(steps)}) != 1:
        return 0.0
    return max(0.0, gaps[-1] - statistics.median(gaps[1:-1]))


def gpu_seconds(run: dict, own: bool = False, no_end: bool = False) -> list[float]:
    """The run's evaluation times in the GPU site's seconds: wall-clock ÷ k. Every part of an
    arm's step, compute and link, runs k times slower here than on the GPU site it stands
    for; k differs between arms because 4 workers share this machine's cores unequally
    (DiLoCo's sites all compute at once, the ring's take turns). The calibrated k makes the
    link's part exact; the run's own k its compute's (``own``). ``no_end``: the last
    evaluation without :func:`end_excess`."""
    t = list(run["curve"]["seconds"])
    if no_end and t:
        t[-1] -= end_excess(run)
    return [x / k_of(run, own) for x in t]


def time_to(run: dict, target: float, own: bool = False, no_end: bool = False) -> float | None:
    """GPU-site seconds until the run first reaches ``target`` (linear between evaluations)."""
    prev = (0.0, math.inf)
    for t, y in zip(gpu_seconds(run, own, no_end), run["curve"]["eval"]):
        if y <= target:
            t0, y0 = prev
            if not math.isfinite(y0):
                return t
            return t0 + (t - t0) * (y0 - target) / (y0 - y)
        prev = (t, y)
    return None


# ------------------------------------------------------------------ the race
def tag(args) -> str:
    return f"{args.preset}-b{args.batch}-{args.steps}steps-{args.rate}-rtt{args.rtt_ms:g}ms"


def race(args) -> dict:
    from mobius_fed.testbed import netns_available

    reason = netns_available()
    if reason:
        raise SystemExit(f"the race needs the namespace testbed: {reason}")
    out = RESULTS / tag(args)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    chosen = [a for a in arms() if not args.arms or any(picks(k, a.name) for k in args.arms)]
    calib_path = out / "calibration.json"
    calib = json.loads(calib_path.read_text()) if calib_path.exists() else {}
    for arm in chosen:
        if arm.kind not in calib:
            rounds = quiet_run(arm, args, args.calibration_steps, 0, None)["rounds"]
            calib[arm.kind] = compute_per_step(rounds)
            calib_path.write_text(json.dumps(calib, indent=2) + "\n")
            ms = calib[arm.kind] * 1e3
            print(f"calibration {arm.kind}: {ms:.1f} ms compute/step", flush=True)
    for seed in args.seeds:
        for arm in chosen:
            path = out / "runs" / f"{slug(arm.name)}-seed{seed}.json"
            if path.exists():
                continue
            link = scale_link(arm, args, calib[arm.kind])
            cfg = arm.train_config(args.preset, args.batch)
            t0 = time.perf_counter()
            ran = quiet_run(arm, args, args.steps, seed, link)
            rounds = ran["rounds"]
            doc = {
                "load_before": ran["load_before"],
                "foreign_cores": ran["foreign_cores"],
                "arm": arm.name,
                "seed": seed,
                "link": {**link.__dict__, "k": link.k},
                "compute_s": compute_per_step(rounds),
                "curve": curve(rounds, cfg.tokens_per_step),
                "timeline": timeline(rounds),
                "bytes": {"measured": measured_bytes(rounds), "accounted": sent_bytes(cfg)},
                "projected_tokens_s": cfg.tokens_per_step / link.projected_step_s,
                "seconds": time.perf_counter() - t0,
            }
            path.write_text(json.dumps(doc, indent=2) + "\n")
            c = doc["curve"]
            print(
                f"{arm.name} seed {seed}: Eq. 8 {c['eval'][-1]:.4f} in {c['wall_s']:.0f} s, "
                f"{c['tokens_s']:.0f} tok/s (projected {doc['projected_tokens_s']:.0f}), "
                f"link {link.rate_bps / 1e3:.0f} kbit/s",
                flush=True,
            )
    return report(out)


def picks(key: str, name: str) -> bool:
    """``--arms`` KEY picks the arm NAME: KEY in NAME, or ``=NAME`` exactly."""
    return key[1:] == name if key.startswith("=") else key in name


def slug(name: str) -> str:
    return "".join(ch if ch.isalnum() else "-" for ch in name).strip("-").lower()


def report(out: Path, figure: Path | None = None) -> dict:
    """The table (printed, kept as report.md and report.json) and the figure."""
    from mobius_fed.stats import ci95

    runs = [json.loads(p.read_text()) for p in sorted((out / "runs").glob("*.json"))]
    names = [a.name for a in arms()]
    by: dict[str, dict[int, dict]] = {}
    for r in runs:
        by.setdefault(r["arm"], {})[r["seed"]] = r
    base = by.get("DiLoCo H=100", {})
    lines = [
        f"Race {out.name}: Eq. 8 and wall-clock per arm (mean ± 95 % t over seeds)",
        "",
        "| arm | seeds | final Eq. 8 | wall s | GPU-site s | tok/s measured | tok/s projected | "
        "measured ÷ projected | link kbit/s | k (calibrated, run) | time to DiLoCo H=100's "
        "Eq. 8 ÷ its time, k calibrated | … k of each run | … ÷ its projected time | "
        "… ÷ the fastest DiLoCo arm's projected time | worst over DiLoCo arms, each at its "
        "own final Eq. 8 and measured time | time to DiLoCo H=100's Eq. 8 ÷ its time, both "
        "without the last round's excess (the final checkpoint copy) | the worst over DiLoCo "
        "arms, so | last round's excess, s | other processes, cores |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    rows, summary = [], []
    for name in [n for n in names if n in by]:
        seeds = sorted(by[name])
        rs = [by[name][s] for s in seeds]
        final = ci95([r["curve"]["eval"][-1] for r in rs])
        wall = statistics.mean(r["curve"]["wall_s"] for r in rs)
        gpu = statistics.mean(r["curve"]["wall_s"] / r["link"]["k"] for r in rs)
        meas = statistics.mean(r["curve"]["tokens_s"] for r in rs)
        proj = statistics.mean(r["projected_tokens_s"] for r in rs)
        ratios, texts = {}, []
        for own in (False, True):
            ratios[own] = [race_ratio(by[name][s], base[s], own) for s in seeds if s in base]
            texts.append(ratio_text(ratios[own], ci95))
        ideal = [race_ratio(by[name][s], base[s], False, ideal=True) for s in seeds if s in base]
        texts.append(ratio_text(ideal, ci95))
        best = [strongest_ratio(by, name, s) for s in seeds if s in base]
        texts.append(ratio_text(best, ci95))
        worst = [worst_measured_ratio(by, name, s) for s in seeds if s in base]
        texts.append(ratio_text(worst, ci95))
        no_end = [race_ratio(by[name][s], base[s], False, no_end=True) for s in seeds if s in base]
        texts.append(ratio_text(no_end, ci95))
        worst = [worst_measured_ratio(by, name, s, no_end=True) for s in seeds if s in base]
        texts.append(ratio_text(worst, ci95))
        link = rs[0]["link"]
        lines.append(
            f"| {name} | {len(seeds)} | {final[0]:.4f} ± {final[1]:.4f} | {wall:.0f} | {gpu:.0f} | "
            f"{meas:.0f} | {proj:.0f} | {meas / proj:.2f} | {link['rate_bps'] / 1e3:.0f} | "
            f"{link['k']:.2f}, {statistics.mean(k_of(r, True) for r in rs):.2f} | "
            f"{texts[0]} | {texts[1]} | {texts[2]} | {texts[3]} | {texts[4]} | "
            f"{texts[5]} | {texts[6]} | {statistics.mean(end_excess(r) for r in rs):.0f} | "
            f"{max(r.get('foreign_cores', 0.0) for r in rs):.2f} |"
        )
        rows.append({"arm": name, "seeds": seeds, "final": final, "wall_s": wall, "gpu_s": gpu,
                     "tokens_s": meas, "projected_tokens_s": proj, "ratios": ratios[False],
                     "ratios_own_k": ratios[True]})  # fmt: skip
        if name.startswith("ring"):
            summary.append(
                f"ring ÷ DiLoCo H=100, time to its Eq. 8: {texts[0]} ({name}; by each run's "
                f"own compute: {texts[1]}; against DiLoCo's projected time: {texts[2]}; against "
                f"the fastest DiLoCo arm's projected time: {texts[3]}; against every DiLoCo arm "
                f"at its own final Eq. 8, the worst: {texts[4]}; without the last rounds' "
                f"checkpoint copy: {texts[5]}, the worst: {texts[6]})"
            )
    text = "\n".join([*lines, "", *summary]) + "\n"
    print(text)
    (out / "report.md").write_text(text)
    (out / "report.json").write_text(json.dumps({"rows": rows}, indent=2) + "\n")
    plot(by, names, figure or out / "race.png")
    return {"rows": rows, "summary": summary}


def race_ratio(
    run: dict, base: dict, own: bool, ideal: bool = False, no_end: bool = False
) -> float:
    """GPU-site time for ``run`` to reach ``base``'s final Eq. 8 over ``base``'s own time
    (inf: never reached); with ``ideal``, over the time ``base``'s projection gives for its
    steps (DiLoCo as its step model says it could run, not as this coordinator ran it);
    ``no_end``: both without their last round's :func:`end_excess`."""
    t = time_to(run, base["curve"]["eval"][-1], own, no_end)
    if t is None:
        return math.inf
    if ideal:
        steps = base["curve"]["steps"][-1]
        return t / (steps * base["link"]["projected_step_s"] / base["link"]["k"])
    return t / gpu_seconds(base, own, no_end)[-1]


def ideal_run(run: dict) -> dict:
    """``run`` as its projection says it could have gone: evaluations at steps × the
    projected step, in GPU-site seconds."""
    step = run["link"]["projected_step_s"] / run["link"]["k"]
    curve = {"seconds": [s * step for s in run["curve"]["steps"]], "eval": run["curve"]["eval"]}
    return {"link": {"k": 1.0}, "curve": curve}


def strongest_ratio(by: dict, name: str, seed: int) -> float:
    """GPU-site time for arm ``name`` to reach DiLoCo H = 100's final Eq. 8 (``seed``) over
    the least time any DiLoCo arm of that seed would need at its projected speed: the
    strongest opponent (e.g. int4 pseudo-gradients, both ways, and no round overhead)."""
    target = by["DiLoCo H=100"][seed]["curve"]["eval"][-1]
    times = [time_to(ideal_run(runs[seed]), target) for n, runs in by.items()
             if n.startswith("DiLoCo") and seed in runs]  # fmt: skip
    best = min((t for t in times if t is not None), default=None)
    t = time_to(by[name][seed], target)
    return math.inf if t is None or best is None else t / best


def worst_measured_ratio(by: dict, name: str, seed: int, no_end: bool = False) -> float:
    """The largest, over the DiLoCo arms of ``seed``, of arm ``name``'s GPU-site time to
    reach that arm's own final Eq. 8 over that arm's measured time: against the opponent
    that did best at its own level (a compressed DiLoCo may end a little higher, sooner);
    ``no_end``: without the last rounds' :func:`end_excess`."""
    ratios = [race_ratio(by[name][seed], runs[seed], False, no_end=no_end)
              for n, runs in by.items() if n.startswith("DiLoCo") and seed in runs]  # fmt: skip
    return max(ratios, default=math.inf)


def ratio_text(ratios: list[float], ci95) -> str:
    finite = [x for x in ratios if math.isfinite(x)]
    if not ratios:
        return "—"
    if len(finite) < len(ratios):
        return f"not reached in {len(ratios) - len(finite)} of {len(ratios)} seeds"
    if len(finite) == 1:
        return f"{finite[0]:.2f}"
    m, h = ci95(finite)
    return f"{m:.2f} ± {h:.2f}"


def plot(by: dict, names: list[str], path: Path) -> None:
    from mobius_fed.plotting import pyplot, save_figure

    plt = pyplot()
    if plt is None:
        print("no matplotlib: figure skipped (pip install -e '.[plot]')")
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, name in enumerate(n for n in names if n in by):
        color = f"C{i}"
        for k, s in enumerate(sorted(by[name])):
            c = by[name][s]["curve"]
            label = name if k == 0 else None
            a.plot(gpu_seconds(by[name][s]), c["eval"], color=color, alpha=0.8, label=label,
                   marker=".")  # fmt: skip
            b.plot([t / 1e6 for t in c["tokens"]], c["eval"], color=color, alpha=0.8, label=label)
    a.set_xlabel("GPU-site seconds (wall-clock ÷ k; links matched to gpt2-small on a GPU)")
    b.set_xlabel("tokens (millions, all sites)")
    for ax in (a, b):
        ax.set_ylabel("held-out Eq. 8")
    save_figure(fig, path, a, b)
    print(f"figure: {path}")


def add_parser(sub) -> None:
    r = sub.add_parser("race", help="ring against DiLoCo: real processes on shaped links")
    r.add_argument("--preset", default="cpu-tiny")
    r.add_argument("--batch", type=int, default=8, help="sequences per site and step")
    r.add_argument("--steps", type=int, default=1000)
    r.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    r.add_argument("--rate", default="1gbit", help="the GPU site's link the race matches")
    r.add_argument("--rtt-ms", type=float, default=0.0, help="the GPU site's round trip")
    r.add_argument("--calibration-steps", type=int, default=60)
    r.add_argument(
        "--arms", nargs="+", help="only arms whose name contains one of these (=NAME: exactly)"
    )
    r.add_argument("--timeout", type=float, default=3600.0, help="seconds per run")
    r.add_argument("--quick", action="store_true", help="one seed, 300 steps")
    r.add_argument("--report", action="store_true", help="only the table and figure of kept runs")
    r.add_argument("--figure", type=Path, help="also write the figure here")


def _stop(signum: int, _frame: object) -> None:
    raise SystemExit(f"stopped by signal {signum}")  # the testbed in flight is torn down


def main(args) -> int:
    signal.signal(signal.SIGTERM, _stop)
    if args.quick:
        args.seeds, args.steps = [0], 300
    if args.report:
        report(RESULTS / tag(args), args.figure)
    else:
        race(args)
        if args.figure:
            report(RESULTS / tag(args), args.figure)
    return 0
