"""Wire compression: bytes on ring hops vs fp32 and the price in validation loss (Eq. 8).

Each arm trains the reference engine (which applies every codec exactly as a ring does,
see mobius_fed/engine/wire_stages.py) for ``--steps`` steps on cpu-small, P = 4, from
the same seed and data, and evaluates Eq. 8 at the end. Δ is the arm's Eq. 8 minus the
fp32 arm's with the same order and L, from the same run of this script. Bytes are the
payloads of one training step's remote hops (forward + backward) against fp32.

    python benchmarks/compression.py --steps 300 --wire none fwd=int3,bwd=int4 ...
    python benchmarks/compression.py --jobs 2 --out runs/compression.json   # every arm

Arms run as separate one-thread processes (``--jobs`` at once); results are appended to
``--out`` as JSON lines, so an interrupted sweep resumes where it stopped. ``--seeds`` runs
every arm from several seeds (Δ is paired: same seed, fp32 arm). ``--device cuda
--precision fp32`` runs the arms on a GPU in fp32 with deterministic kernels (cuBLAS
workspace pinned), so that an arm repeated gives the same Eq. 8, as on a CPU.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

DEFAULT_WIRES = (
    "none",
    "both=int8",
    "both=fp8",
    "fwd=int4,bwd=int8",
    "both=int4",
    "fwd=int3,bwd=int4",
    "both=int3",
    "fwd=int2,bwd=int4",
    "both=int2",
    "fwd=lowrank,bwd=int8,rank=16",
)
ARMS = (("cyclic", 1), ("ordered", 1), ("cyclic", 2), ("ordered", 2))


def hop_bytes(cfg) -> tuple[int, int]:
    """(forward, backward) bytes of one remote hop of one micro-batch
    (:func:`mobius_fed.ops.plan.hop_bytes`, imported when used)."""
    from mobius_fed.ops.plan import hop_bytes as payload

    return payload(cfg)


def step_bytes(cfg) -> tuple[int, int]:
    """(bytes, fp32 bytes) of one training step's remote hops in both directions, the whole
    ring: :func:`hop_bytes` per hop, against fp32 d-wide hidden states."""
    from mobius_fed import schedule

    mc = cfg.model()
    fp32 = 4 * (cfg.batch_size // cfg.micro_batches) * mc.seq_len * mc.d_model  # the paper's
    remote = 0
    for s in range(cfg.P):
        path = schedule.path(cfg.order, s, cfg.P, cfg.loops)
        nodes = [s, *path, s]
        remote += sum(a != b for a, b in itertools.pairwise(nodes))
    hops = remote * cfg.micro_batches
    return hops * sum(hop_bytes(cfg)), hops * 2 * fp32


SUBSPACE_KEYS = ("rank", "mode", "writes", "learn", "lr", "schedule")
SWITCH = {"on": True, "off": False}


def parse_subspace(text: str) -> dict:
    """``off`` or ``rank=K[,mode=stream|home|tokens|bottleneck|bottleneck-home]
    [,writes=basis|full][,learn=on|off][,lr=LR][,schedule=run|constant]`` →
    TrainConfig.subspace's fields
    (``learn=on``: U trains, with its own Adam learning rate ``lr`` and ``schedule``;
    the bottleneck modes need ``writes=full``: each group's learned encoder and decoder)."""
    if text == "off":
        return {}
    fields = dict(item.split("=", 1) for item in text.split(",") if item)
    unknown = set(fields) - set(SUBSPACE_KEYS)
    if unknown:
        raise ValueError(
            f"--subspace {text!r}: unknown key(s) {sorted(unknown)} ({', '.join(SUBSPACE_KEYS)})"
        )
    out: dict = {"rank": int(fields["rank"]), "mode": fields.get("mode", "stream")}
    if "writes" in fields:
        out["writes"] = fields["writes"]
    if "learn" in fields:
        if fields["learn"] not in SWITCH:
            raise ValueError(f"--subspace {text!r}: learn must be on or off")
        out["learn"] = SWITCH[fields["learn"]]
    if "lr" in fields:
        out["lr"] = float(fields["lr"])
    if "schedule" in fields:
        out["schedule"] = fields["schedule"]
    return out


def parse_privacy(text: str) -> dict:
    """``off`` or ``FIELD=VALUE[,FIELD=VALUE…]`` of ``TrainConfig.privacy`` (numbers and
    true/false read as such), e.g. ``preset=private-wire`` or ``home_input=mlp,input_noise=1``."""
    if text == "off":
        return {}
    out: dict = {}
    for item in text.split(","):
        name, _, value = item.partition("=")
        if not value:
            raise ValueError(f"--privacy {text!r}: {item!r} is not FIELD=VALUE")
        try:
            out[name] = json.loads(value)
        except json.JSONDecodeError:
            out[name] = value
    return out


def with_privacy(cfg, privacy: str, keys: Path):
    """``cfg`` with the privacy fields of ``privacy`` and one key per site in ``keys``. The
    keys are derived from the seed (a benchmark's arms must repeat; a real site's key is a
    random secret, ``write_site_keys``)."""
    import hashlib

    from mobius_fed.config import TrainConfig

    keys.mkdir(parents=True, exist_ok=True)
    for name in [f"site-{s}.key" for s in range(cfg.P)] + ["coordinator.key"]:
        seed = f"benchmark key {cfg.seed} {name}".encode()
        (keys / name).write_bytes(hashlib.blake2b(seed, digest_size=32).digest())
    raw = cfg.model_dump(mode="json", exclude_unset=True)
    raw["privacy"] = {
        **raw.get("privacy", {}),
        "noise_key_dir": str(keys),
        **parse_privacy(privacy),
    }
    return TrainConfig(**raw)


def _pin_threads_and_kernels(device: str) -> None:
    """One torch thread; on cuda deterministic kernels (a repeated arm gives the same Eq. 8)."""
    import os

    if device == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    import torch

    torch.set_num_threads(1)
    if device == "cuda":
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False


def run_arm(
    order: str,
    loops: int,
    wire: str,
    steps: int,
    preset: str,
    seed: int,
    device: str = "cpu",
    precision: str = "bf16",
    subspace: str = "off",
    privacy: str = "off",
) -> dict:
    _pin_threads_and_kernels(device)
    from mobius_fed.config import TrainConfig
    from mobius_fed.data import SiteData, embedded_corpus, prepare_sites
    from mobius_fed.engine import ReferenceEngine
    from mobius_fed.transport.wire_config import WireConfig

    cfg = TrainConfig(
        device=device,
        precision=precision,
        preset=preset,
        workers=4,
        loops=loops,
        order=order,
        steps=steps,
        seed=seed,
        eval_every=0,
        eval_batches=4,
        wire=WireConfig(**WireConfig.parse_flag(wire)) if wire != "none" else WireConfig(),
        subspace=parse_subspace(subspace),
    )
    mc = cfg.model()
    with tempfile.TemporaryDirectory() as tmp:
        if privacy != "off":
            cfg = with_privacy(cfg, privacy, Path(tmp) / "keys")
        dirs = prepare_sites(None, Path(tmp), cfg.P, cfg.encoding, text=embedded_corpus())
        sites = [SiteData(d, mc.seq_len, cfg.encoding) for d in dirs]
        engine = ReferenceEngine(cfg, sites)
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.train_step()
        seconds = time.perf_counter() - t0
        eq8 = engine.evaluate().loss
    sent, fp32 = step_bytes(cfg)
    fwd_hop, bwd_hop = hop_bytes(cfg)
    return {
        "order": order,
        "loops": loops,
        "wire": wire,
        "subspace": subspace,
        "privacy": privacy,
        "steps": steps,
        "preset": preset,
        "seed": seed,
        "device": device,
        "precision": precision if device == "cuda" else "fp32",
        "eq8": eq8,
        "ratio": fp32 / sent,
        "hop_bytes": [fwd_hop, bwd_hop],  # one remote hop of one micro-batch, each way
        "fp32_hop_bytes": 4 * (cfg.batch_size // cfg.micro_batches) * mc.seq_len * mc.d_model,
        "seconds": round(seconds, 1),
    }


def table(rows: list[dict]) -> str:
    """One line per (wire, seed): Δ against the fp32 arm of the same order, L and seed."""
    seeds = sorted({r["seed"] for r in rows})
    if len(seeds) > 1:
        return "".join(f"seed {s}:\n" + table([r for r in rows if r["seed"] == s]) for s in seeds)
    base = {(r["order"], r["loops"]): r["eq8"] for r in rows if r["wire"] == "none"}
    heads = " | ".join(f"Δ {o} L={L}" for o, L in ARMS)
    lines = [
        f"| wire | bytes vs fp32 | {heads} | max abs Δ |",
        "|---|---|" + "---|" * (len(ARMS) + 1),
    ]
    for wire in dict.fromkeys(r["wire"] for r in rows):
        got = {(r["order"], r["loops"]): r for r in rows if r["wire"] == wire}
        ratio = next(iter(got.values()))["ratio"]
        cells, deltas = [], []
        for arm in ARMS:
            if arm in got and arm in base:
                d = got[arm]["eq8"] - base[arm]
                deltas.append(abs(d))
                cells.append(f"{d:+.4f} ({got[arm]['eq8']:.4f})")
            else:
                cells.append("—")
        worst = f"{max(deltas):.4f}" if deltas else "—"
        lines.append(f"| {wire} | {ratio:.1f}× | " + " | ".join(cells) + f" | {worst} |")
    return "\n".join(lines) + "\n"


def _arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--preset", default="cpu-small")
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="one arm per seed")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--precision", choices=("bf16", "fp32"), default="fp32", help="on cuda")
    p.add_argument("--wire", nargs="+", default=list(DEFAULT_WIRES), help="--wire values")
    p.add_argument(
        "--subspace",
        nargs="+",
        default=["off"],
        help="off or rank=K[,mode=stream|home|tokens|bottleneck|bottleneck-home]"
        "[,writes=basis|full]"
        "[,learn=on|off]"
        "[,lr=LR][,schedule=run|constant] (TrainConfig.subspace; learn=on: U trains, "
        "averaged at each barrier, with its own Adam lr and schedule); each × each --wire",
    )
    p.add_argument("--arms", nargs="+", default=[f"{o}:{L}" for o, L in ARMS])
    p.add_argument("--jobs", type=int, default=1, help="arms trained at once")
    p.add_argument("--out", default="runs/compression.jsonl", help="results (JSON lines)")
    p.add_argument("--table", action="store_true", help="print the table of --out; train nothing")
    p.add_argument(
        "--width-law",
        nargs="+",
        metavar="JSONL",
        help="print the width-law table of these result files (every preset, steps and seed "
        "in them), the power-law fit and the targets; train nothing",
    )
    p.add_argument(
        "--front",
        action="store_true",
        help="print the front of --out (these steps, preset, seeds and arms): every "
        "(subspace, wire) by its wire ratio, exact bytes per hop, and paired Δ Eq. 8 with "
        "95 %% intervals against fp32 and against the plain codec; train nothing",
    )
    p.add_argument("--figure", help="with --width-law: write Δ vs d per scheme here (png)")
    p.add_argument(
        "--privacy",
        nargs="+",
        default=["off"],
        help="off or FIELD=VALUE[,…] of TrainConfig.privacy (site keys derived from the seed), "
        "e.g. preset=private-wire; each × each --subspace and --wire",
    )
    p.add_argument(
        "--one",
        nargs=6,
        metavar=("ORDER", "L", "WIRE", "SEED", "SUB", "PRIV"),
        help=argparse.SUPPRESS,
    )
    return p


def main() -> int:
    args = _arg_parser().parse_args()
    if args.width_law:  # reads result files only
        print(width_law(args.width_law, args.figure))
        return 0
    if args.one:
        order, loops, wire, seed, sub, priv = args.one
        row = run_arm(
            order,
            int(loops),
            wire,
            args.steps,
            args.preset,
            int(seed),
            args.device,
            args.precision,
            sub,
            priv,
        )
        print(json.dumps(row))
        return 0
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = []
    if out.exists():
        done = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    where = (args.device, args.precision if args.device == "cuda" else "fp32")
    done = [r for r in done if (r.get("device", "cpu"), r.get("precision", "fp32")) == where]
    for r in done:
        r.setdefault("subspace", "off")
        r.setdefault("privacy", "off")

    def key(o: str, L: int | str, w: str, seed: int | str, sub: str, priv: str) -> tuple:
        return (o, int(L), w, int(seed), sub, priv, args.steps, args.preset)

    have = {
        key(r["order"], r["loops"], r["wire"], r["seed"], r["subspace"], r["privacy"]) for r in done
    }
    todo = [
        (o, L, w, str(seed), sub, priv)
        for seed in args.seeds
        for priv in args.privacy
        for sub in args.subspace
        for w in args.wire
        for o, L in (a.split(":") for a in args.arms)
        if key(o, L, w, seed, sub, priv) not in have
    ]
    if args.table or args.front:
        todo = []
    cmd = [sys.executable, __file__, "--steps", str(args.steps), "--preset", args.preset]
    cmd += ["--device", args.device, "--precision", args.precision, "--one"]
    done += _run_all(cmd, todo, args.jobs, out)
    rows = [
        r
        for r in done
        if r["steps"] == args.steps and r["preset"] == args.preset and r["seed"] in args.seeds
    ]
    if args.table or args.front:  # every row of --out for these steps, preset and seeds
        rows = [r for r in rows if f"{r['order']}:{r['loops']}" in args.arms]
    if args.front:
        print(front_table(rows))
        return 0
    if all(r["subspace"] == "off" and r["privacy"] == "off" for r in rows):
        print(table(rows))
    else:  # a defended arm is its own subspace row: "<subspace>; <privacy>"
        for r in rows:
            if r["privacy"] != "off":
                r["subspace"] = f"{r['subspace']}; {r['privacy']}"
        print(subspace_table(rows))
    return 0


def _run_all(cmd: list[str], todo: list[tuple], jobs: int, out: Path) -> list[dict]:
    """Train the arms ``todo`` (``jobs`` processes at once), appending each row to ``out``."""
    running: list[tuple[subprocess.Popen, tuple]] = []
    rows = []
    while todo or running:
        while todo and len(running) < jobs:
            arm = todo.pop(0)
            proc = subprocess.Popen([*cmd, *arm], stdout=subprocess.PIPE, text=True)
            running.append((proc, arm))
        time.sleep(1)
        for proc, arm in list(running):
            if proc.poll() is None:
                continue
            running.remove((proc, arm))
            text = proc.stdout.read() if proc.stdout else ""
            if proc.returncode != 0:
                print(f"arm {arm} failed (exit {proc.returncode})", file=sys.stderr)
                continue
            row = json.loads(text.strip().splitlines()[-1])
            print(json.dumps(row), flush=True)
            with out.open("a") as f:
                f.write(json.dumps(row) + "\n")
            rows.append(row)
    return rows


# two-sided 95 % Student t quantiles by degrees of freedom
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def paired_interval(deltas: list[float]) -> str:
    """mean of paired Δs with its 95 % t interval (one seed: the value alone)."""
    from mobius_fed.stats import ci95

    n = len(deltas)
    mean, half = ci95(deltas)
    if n < 2:
        return f"{mean:+.4f} (n=1)"
    return f"{mean:+.4f} ± {half:.4f} (n={n})"


def front_table(rows: list[dict]) -> str:
    """The front (issue 55): one line per (subspace, wire, order, L), highest wire ratio
    first: exact payload bytes of one remote hop each way against fp32 hidden states, the
    step's ratio, and the paired Δ Eq. 8 (same seed and data; 95 % t interval over seeds,
    :func:`mobius_fed.stats.ci95`) against the unconstrained fp32 model and against the
    plain codec (no subspace, the same wire)."""
    eq8 = {(r["subspace"], r["wire"], r["order"], r["loops"], r["seed"]): r["eq8"] for r in rows}
    arms = dict.fromkeys((r["subspace"], r["wire"], r["order"], r["loops"]) for r in rows)
    lines = [
        "| subspace | wire | order, L | bytes/hop fwd, bwd (fp32) | ratio | seeds "
        "| Δ Eq. 8 vs fp32 (95 % CI) | Δ vs plain codec (95 % CI) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    body = []
    for arm in arms:
        sub, wire, order, loops = arm
        mine = [r for r in rows if (r["subspace"], r["wire"], r["order"], r["loops"]) == arm]
        seeds = sorted(r["seed"] for r in mine)
        cells = []
        for plain, base in enumerate((("off", "none"), ("off", wire))):
            pairs = [
                eq8[(*arm[:2], order, loops, s)] - eq8[(*base, order, loops, s)]
                for s in seeds
                if (*base, order, loops, s) in eq8
            ]
            # no Δ against itself, and no plain-codec Δ without a codec or a subspace
            same = (wire == "none" or sub == "off") if plain else base == (sub, wire)
            cells.append("—" if same or not pairs else paired_interval(pairs))
        hop = mine[0].get("hop_bytes")
        per_hop = "—" if hop is None else f"{hop[0]:,}, {hop[1]:,} ({mine[0]['fp32_hop_bytes']:,})"
        body.append(
            (
                -mine[0]["ratio"],
                f"| {sub} | {wire} | {order} L={loops} | {per_hop} | {mine[0]['ratio']:.1f}× "
                f"| {len(seeds)} | {cells[0]} | {cells[1]} |",
            )
        )
    return "\n".join(lines + [line for _, line in sorted(body)]) + "\n"


def subspace_table(rows: list[dict]) -> str:
    """One line per (subspace, wire, order, L): bytes ratio, Eq. 8, and the paired Δs
    against the unconstrained fp32 model and against the same subspace without a codec."""
    eq8 = {(r["subspace"], r["wire"], r["order"], r["loops"], r["seed"]): r["eq8"] for r in rows}
    lines = [
        "| subspace | wire | order, L | bytes vs fp32 | Eq. 8 (mean) "
        "| Δ vs unconstrained fp32 (95 % CI) | Δ vs same subspace, no codec |",
        "|---|---|---|---|---|---|---|",
    ]
    arms = dict.fromkeys((r["subspace"], r["wire"], r["order"], r["loops"]) for r in rows)
    for sub, wire, order, loops in arms:
        mine = [
            r
            for r in rows
            if (r["subspace"], r["wire"], r["order"], r["loops"]) == (sub, wire, order, loops)
        ]
        seeds = sorted(r["seed"] for r in mine)
        mean = sum(r["eq8"] for r in mine) / len(mine)
        cells = []
        for base in (("off", "none"), (sub, "none")):
            pairs = [
                eq8[(sub, wire, order, loops, s)] - eq8[(*base, order, loops, s)]
                for s in seeds
                if (*base, order, loops, s) in eq8
            ]
            same = base == (sub, wire)
            cells.append("—" if same or not pairs else paired_interval(pairs))
        lines.append(
            f"| {sub} | {wire} | {order} L={loops} | {mine[0]['ratio']:.1f}× | {mean:.4f} "
            f"| {cells[0]} | {cells[1]} |"
        )
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------ the width law

TARGET_RATIO, MOONSHOT_RATIO, TARGET_DELTA, TARGET_UPPER = 32.0, 100.0, 0.02, 0.03
EXTRAPOLATE_TO = (768, 2048, 4096)


def ratio_class(ratio: float) -> str:
    """The issue's two operating points: ~41× (k = d/8; token ids lower it to 34–40×) and
    ≥ 100× (the smallest k that reaches it, which is a different fraction of d per width)."""
    return "≥100×" if ratio >= MOONSHOT_RATIO else "~40×" if ratio >= 30 else f"{ratio:.0f}×"


def _k(row: dict, d: int) -> str:
    k = parse_subspace(row["subspace"]).get("rank", 0)
    return "–" if not k else f"d/{d // k}" if d % k == 0 else f"{k}/{d}·d"


def _scheme(row: dict, d: int) -> str:
    """A scheme comparable across widths: mode, writes, the ratio class on the wire, U, wire."""
    sub = parse_subspace(row["subspace"])
    priv = "" if row.get("privacy", "off") == "off" else f", {row['privacy']}"
    if not sub:
        return f"off{priv}; {row['wire']}"
    u = ""  # a fixed U (the seed's); a learned one is its own scheme, lr and schedule named
    if sub.get("learn"):
        sched = "" if sub.get("schedule", "run") == "run" else f", {sub['schedule']}"
        u = f", learned U (lr {sub.get('lr', 1e-3):g}{sched})"
    cls = ratio_class(row["ratio"])
    return f"{sub['mode']}, {sub.get('writes', 'basis')}, {cls}{u}{priv}; {row['wire']}"


def _tokens_per_parameter(row: dict) -> float:
    from mobius_fed.config import TrainConfig
    from mobius_fed.model.groups import count_parameters

    cfg = TrainConfig(preset=row["preset"], workers=4, loops=row["loops"], order=row["order"])
    return row["steps"] * cfg.tokens_per_step / count_parameters(cfg.model())


def paired_stats(deltas: list[float]) -> tuple[float, float | None]:
    """(mean, 95 % t half-width; None for one value) of paired Δs."""
    n = len(deltas)
    mean = sum(deltas) / n
    if n < 2:
        return mean, None
    sd = (sum((d - mean) ** 2 for d in deltas) / (n - 1)) ** 0.5
    return mean, T975.get(n - 1, 1.96) * sd / n**0.5


def line_fit(
    xs: list[float], ys: list[float]
) -> tuple[float, float, float | None, Callable[[float], tuple[float, float | None]]]:
    """Least squares y = icpt + slope·x: icpt, slope, the residual standard error (None with
    two points: the line passes through both), and ``band(x)``: the fitted y and the
    half-width of its 95 % prediction interval (None without a residual error)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    icpt = my - slope * mx
    se = None
    if n > 2:
        se = (sum((y - icpt - slope * x) ** 2 for x, y in zip(xs, ys)) / (n - 2)) ** 0.5

    def band(x: float) -> tuple[float, float | None]:
        if se is None:
            return icpt + slope * x, None
        return icpt + slope * x, T975.get(n - 2, 1.96) * se * (
            1 + 1 / n + (x - mx) ** 2 / sxx
        ) ** 0.5

    return icpt, slope, se, band


def power_law(points: list[tuple[float, float]]) -> dict:
    """Least squares of log Δ = log a − β log d over (d, Δ > 0) points: a, β, and the
    residual standard error of log Δ (None with two points). ``predict(d)`` gives Δ and
    its 95 % interval for a new width."""
    if len(points) < 2 or any(v <= 0 for _, v in points):
        raise ValueError("a power law needs ≥ 2 widths with Δ > 0")
    icpt, slope, se, band = line_fit(
        [math.log(d) for d, _ in points], [math.log(v) for _, v in points]
    )

    def predict(d: float) -> tuple[float, tuple[float, float] | None]:
        mid, half = band(math.log(d))
        if half is None:
            return math.exp(mid), None
        return math.exp(mid), (math.exp(mid - half), math.exp(mid + half))

    def width_for(delta: float) -> float:
        """The width at which the fitted Δ falls to ``delta`` (inf when it grows)."""
        if slope >= 0:
            return math.inf
        return math.exp((math.log(delta) - icpt) / slope)

    return {
        "a": math.exp(icpt),
        "beta": -slope,
        "se": se,
        "predict": predict,
        "width_for": width_for,
    }


def log_linear(points: list[tuple[float, float]]) -> dict:
    """Least squares of Δ = a + b·ln d, the fallback where some Δ ≤ 0 (better than fp32)
    leaves no power law: a, b, the residual standard error, ``predict`` with a 95 %
    prediction interval, and ``width_for(Δ)``, where the line crosses Δ (inf if never)."""
    a, b, se, band = line_fit([math.log(d) for d, _ in points], [v for _, v in points])

    def predict(d: float) -> tuple[float, tuple[float, float] | None]:
        mid, half = band(math.log(d))
        return mid, None if half is None else (mid - half, mid + half)

    def width_for(delta: float) -> float:
        return math.inf if b == 0 else math.exp((delta - a) / b)

    return {"a": a, "b": b, "se": se, "predict": predict, "width_for": width_for}


def _fit_line(fit: dict, law: str) -> str:
    preds = []
    for d in EXTRAPOLATE_TO:
        mid, iv = fit["predict"](d)
        band = "" if iv is None else f" [{iv[0]:+.3f}, {iv[1]:+.3f}]"
        preds.append(f"d={d}: {mid:+.3f}{band}")
    se = "" if fit["se"] is None else f", residual s.e. {fit['se']:.3f}"
    return law.format(**fit) + se + "; " + "; ".join(preds) + f"; {_crossing(fit)}\n"


def _crossing(fit: dict) -> str:
    """Where the fitted Δ meets the target, and from which side."""
    at = fit["width_for"](TARGET_DELTA)
    if fit.get("b", 0) > 0:  # a line in ln d that rises: the target is met only below it
        return f"Δ grows with d: above {TARGET_DELTA} from d ≈ {at:.0f}"
    return f"Δ = {TARGET_DELTA} at d ≈ {at:.0f}"


def width_law(paths: list[str], figure: str | None = None) -> str:
    """The width-law table of result files: per (scheme, width) the paired Δ Eq. 8 against
    the unconstrained fp32 model of the same preset, steps and seed, with its 95 % CI, the
    ratio on the wire, tokens per parameter; per scheme a power-law fit of Δ against d
    extrapolated to :data:`EXTRAPOLATE_TO`; and the issue's targets, met or missed."""
    from mobius_fed.config import TrainConfig

    rows = [json.loads(x) for p in paths for x in Path(p).read_text().splitlines() if x.strip()]
    for r in rows:
        r.setdefault("subspace", "off")
    widths = {r["preset"]: TrainConfig(preset=r["preset"]).model().d_model for r in rows}
    base = {
        (r["preset"], r["steps"], r["order"], r["loops"], r["seed"]): r["eq8"]
        for r in rows
        if r["subspace"] == "off" and r["wire"] == "none"
    }
    cells: dict[tuple[str, int], dict] = {}
    for r in rows:
        if r["subspace"] == "off" and r["wire"] == "none":
            continue
        key = (r["preset"], r["steps"], r["order"], r["loops"], r["seed"])
        if key not in base:
            continue
        d = widths[r["preset"]]
        cell = cells.setdefault(
            (_scheme(r, d), d),
            {
                "deltas": [],
                "k": _k(r, d),
                "ratio": r["ratio"],
                "tpp": _tokens_per_parameter(r),
                "steps": r["steps"],
            },
        )
        cell["deltas"].append(r["eq8"] - base[key])
    lines = [
        "| scheme | d | k | steps | tokens/param | ratio on the wire | Δ Eq. 8 vs fp32 (95 % CI) "
        "| n |",
        "|---|---|---|---|---|---|---|---|",
    ]
    fits: dict[str, list[tuple[float, float]]] = {}
    for (scheme, d), c in sorted(cells.items()):
        mean, half = paired_stats(c["deltas"])
        ci = f"{mean:+.3f}" + ("" if half is None else f" ± {half:.3f}")
        lines.append(
            f"| {scheme} | {d} | {c['k']} | {c['steps']} | {c['tpp']:.2f} | {c['ratio']:.1f}× "
            f"| {ci} | {len(c['deltas'])} |"
        )
        c["mean"], c["half"] = mean, half
        fits.setdefault(scheme, []).append((d, mean))
    out = "\n".join(lines) + "\n"
    for scheme, points in fits.items():
        if len({d for d, _ in points}) < 2:
            out += f"\n{scheme}: no fit (needs ≥ 2 widths)\n"
            continue
        if any(v <= 0 for _, v in points):  # no power law through Δ ≤ 0: Δ linear in log d
            fit = log_linear(points)
            out += f"\n{scheme}: {_fit_line(fit, 'Δ ≈ {a:+.3f} {b:+.4f}·ln d')}"
            continue
        fit = power_law(points)
        preds = []
        for d in EXTRAPOLATE_TO:
            mid, iv = fit["predict"](d)
            preds.append(
                f"d={d}: {mid:+.3f}" + ("" if iv is None else f" [{iv[0]:.3f}, {iv[1]:.3f}]")
            )
        se = "" if fit["se"] is None else f", residual s.e. of log Δ {fit['se']:.3f}"
        sign = "−" if fit["beta"] >= 0 else "+"  # Δ falls with d, or grows
        out += (
            f"\n{scheme}: Δ ≈ {fit['a']:.3g}·d^{sign}{abs(fit['beta']):.3f}{se}; "
            + "; ".join(preds)
            + f"; Δ = {TARGET_DELTA} at d ≈ {fit['width_for'](TARGET_DELTA):.0f}\n"
        )
    out += "\n" + targets(cells, fits)
    if figure:
        _figure(cells, fits, figure)
    return out


def targets(cells: dict, fits: dict) -> str:
    """The issue's targets at the widest width measured: ≥ 32× at Δ ≤ 0.02 with the 95 %
    CI's upper bound ≤ 0.03, and the moonshot ≥ 100× at Δ ≤ 0.02. One-sided: a Δ below
    zero (a loss lower than the fp32 model's) costs no quality."""
    if not cells:
        return "targets: no arm measured\n"
    widest = max(d for _, d in cells)
    lines = [f"targets at the widest width measured, d = {widest}:"]
    for name, ratio in (("target", TARGET_RATIO), ("moonshot", MOONSHOT_RATIO)):
        arms = [(s, c) for (s, d), c in cells.items() if d == widest and c["ratio"] >= ratio]
        if not arms:
            lines.append(f"- {name} ≥ {ratio:.0f}×: no arm at that ratio measured at d = {widest}")
            continue
        scheme, c = min(arms, key=lambda a: a[1]["mean"] + (a[1]["half"] or 0.0))
        upper = c["mean"] + (c["half"] or 0.0)
        met = c["mean"] <= TARGET_DELTA and (name != "target" or upper <= TARGET_UPPER)
        where = ""
        if not met and scheme in fits and len({d for d, _ in fits[scheme]}) >= 2:
            pts = fits[scheme]
            fit = log_linear(pts) if any(v <= 0 for _, v in pts) else power_law(pts)
            where = f"; fit: {_crossing(fit)}"
        verdict = "MET" if met else f"MISSED by {c['mean'] - TARGET_DELTA:.3f}"
        if met and name == "target" and c["half"] is None:
            verdict = "MET on one seed (no interval: the CI bound is unchecked)"
        ci = "" if c["half"] is None else f", CI upper {upper:.3f}"
        lines.append(
            f"- {name} ≥ {ratio:.0f}× at Δ ≤ {TARGET_DELTA}: {verdict} (best: {scheme}, "
            f"{c['ratio']:.1f}×, Δ {c['mean']:+.3f}{ci}{where})"
        )
    return "\n".join(lines) + "\n"


def _figure(cells: dict, fits: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for scheme, points in fits.items():
        ds = sorted(d for d, _ in points)
        means = [cells[(scheme, d)]["mean"] for d in ds]
        errs = [cells[(scheme, d)]["half"] or 0.0 for d in ds]
        ax.errorbar(ds, means, yerr=errs, marker="o", capsize=3, label=scheme)
    ax.axhline(TARGET_DELTA, color="grey", linestyle="--", linewidth=1)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("width d")
    ax.set_ylabel("Δ Eq. 8 vs fp32 model of the same width")
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
