"""How rare, small and late the E/R round may be (issue 54, item 1): the quality table of the
E/R sync settings, each arm a ``mobius-fed local`` run (the reference engine).

Arms: H = ``--sync-every`` ∈ {1, 10, 100} × outer step (``--sync-outer`` fedavg / diloco) ×
codec of the pseudo-gradient (``--sync-codec`` none = fp32, int8, int4; error feedback on) ×
τ = ``--sync-delay`` ∈ {0, 1}, every arm on the same seeds. Per arm: the final Eq. 8 (mean
over seeds), its paired Δ against the every-step fp32 baseline (H = 1, fedavg, fp32, τ = 0)
with a Student-t 95 % interval over seeds, and the E/R bytes one site sends per step (its
payload ÷ H). An arm within +0.02 of the baseline on the interval's upper end meets the
issue's target. Results are kept per run (``--out``/runs/<arm>-s<seed>.json, by default
under benchmarks/results/er_sync/<preset>-P<workers>-<steps>steps/) and reused by a later
call with the same setting (the runs themselves go to a temporary directory and are deleted).

    python benchmarks/er_sync.py --quick                    # 2 arms, cpu-tiny, a smoke
    python benchmarks/er_sync.py --preset cpu-small --seeds 3 --steps 120 --jobs 2
    python benchmarks/er_sync.py --preset width-192 --seeds 3 --steps 120 --jobs 2
    python benchmarks/er_sync.py --preset cpu-small --seeds 3 --H 1 10 --codec none int4
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mobius_fed.stats import ci95, mean  # noqa: E402

TARGET = 0.02  # issue 54: rare, compressed, late E/R within +0.02 Eq. 8 of every step


@dataclass(frozen=True)
class Arm:
    H: int
    outer: str = "fedavg"
    codec: str = "none"
    delay: int = 0

    @property
    def name(self) -> str:
        codec = "fp32" if self.codec == "none" else self.codec
        return f"H{self.H}-{self.outer}-{codec}-tau{self.delay}"

    def flags(self) -> list[str]:
        flags = ["--sync-every", str(self.H), "--sync-codec", self.codec]
        flags += ["--sync-delay", str(self.delay)]
        return flags + (["--sync-outer", self.outer] if self.outer != "fedavg" else [])


BASELINE = Arm(1)


def arms_of(args: argparse.Namespace) -> list[Arm]:
    grid = itertools.product(args.H, args.outer, args.codec, args.delay)
    arms = [Arm(h, o, c, d) for h, o, c, d in grid]
    return [BASELINE] + [a for a in arms if a != BASELINE]


def run_one(arm: Arm, seed: int, args: argparse.Namespace, data: Path | None) -> dict:
    """One ``mobius-fed local`` run (cached in runs/<arm>-s<seed>.json)."""
    runs = args.out / "runs"
    done = runs / f"{arm.name}-s{seed}.json"
    if done.is_file():
        kept = json.loads(done.read_text())
        if {k: kept.get(k) for k in setting(args)} == setting(args):
            return kept
        sys.exit(f"{done} is of another setting ({kept}): choose another --out")
    out = args.work / f"{arm.name}-s{seed}"
    argv = [sys.executable, "-m", "mobius_fed.cli.main", "local", "--preset", args.preset,
            "--workers", str(args.workers), "--steps", str(args.steps), "--seed", str(seed),
            "--eval-every", "0", "--threads", "1", "--checkpoint-every", "0",
            "--out", str(out), *arm.flags(), *args.extra]  # fmt: skip
    if data is not None:
        argv += ["--data", str(data)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(argv, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{arm.name} seed {seed} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    shutil.rmtree(out, ignore_errors=True)  # its checkpoint: not kept
    evals = [r for r in rows if "eval_loss" in r]
    result = {"arm": arm.name, "seed": seed, "eq8": evals[-1]["eval_loss"], **setting(args)}
    runs.mkdir(parents=True, exist_ok=True)
    done.write_text(json.dumps(result) + "\n")
    return result


def setting(args: argparse.Namespace) -> dict:
    """What a kept result must share with this table to be reused."""
    return {"preset": args.preset, "workers": args.workers, "steps": args.steps,
            "extra": list(args.extra)}  # fmt: skip


def er_bytes_per_step(arm: Arm, args: argparse.Namespace) -> float:
    """What one site's E/R reply takes (fp32 arrays or the codec's payloads) ÷ H."""
    from mobius_fed.config import TrainConfig
    from mobius_fed.model import build_replica
    from mobius_fed.transport.compress import Codec

    cfg = TrainConfig(preset=args.preset, workers=args.workers)
    shapes = [tuple(v.shape) for v in build_replica(cfg.model(), 0).shared_state_dict().values()]
    if arm.codec == "none":
        total = sum(4 * math.prod(s) for s in shapes)
    else:
        total = sum(Codec(arm.codec).payload_bytes(s) for s in shapes)
    return total / arm.H


def table(arms: list[Arm], results: dict[tuple[str, int], float], args: argparse.Namespace) -> str:
    seeds = list(range(args.seed, args.seed + args.seeds))
    base = {s: results[BASELINE.name, s] for s in seeds}
    head = (
        "| arm | H | outer | codec | τ | Eq. 8 | Δ vs every-step fp32 [95 % CI] | E/R B/step/site |"
    )
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    for arm in arms:
        finals = [results[arm.name, s] for s in seeds]
        deltas = [results[arm.name, s] - base[s] for s in seeds]
        m, half = ci95(deltas)
        delta = f"{m:+.4f}" if math.isnan(half) else f"{m:+.4f} [{m - half:+.4f}, {m + half:+.4f}]"
        if arm == BASELINE:
            delta = "baseline"
        elif not math.isnan(half):
            delta += " ✓" if m + half <= TARGET else ""
        codec = "fp32" if arm.codec == "none" else f"{arm.codec}+EF"
        lines.append(
            f"| {arm.name} | {arm.H} | {arm.outer} | {codec} | {arm.delay} | {mean(finals):.4f} "
            f"| {delta} | {fmt_bytes(er_bytes_per_step(arm, args))} |"
        )
    title = (
        f"{args.preset}, P = {args.workers}, {args.steps} steps, seeds {seeds[0]}..{seeds[-1]} "
        f"(paired by seed; ✓: the interval's upper end within +{TARGET})"
    )
    return title + "\n\n" + "\n".join(lines) + "\n"


def fmt_bytes(b: float) -> str:
    for unit, size in (("MB", 1e6), ("kB", 1e3)):
        if b >= size:
            return f"{b / size:.1f} {unit}"
    return f"{b:.0f} B"


def prepare_data(args: argparse.Namespace) -> Path | None:
    """The embedded corpus split once into P sites, shared by every run (unless --data)."""
    if "--data" in args.extra:
        return None
    from mobius_fed.config import TrainConfig
    from mobius_fed.data import embedded_corpus, prepare_sites

    root = args.work / "sites"
    cfg = TrainConfig(preset=args.preset, workers=args.workers)
    prepare_sites(None, root, args.workers, cfg.encoding, text=embedded_corpus())
    return root


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="cpu-small")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0, help="first seed")
    ap.add_argument("--H", type=int, nargs="+", default=[1, 10, 100])
    ap.add_argument("--outer", nargs="+", default=["fedavg", "diloco"])
    ap.add_argument("--codec", nargs="+", default=["none", "int8", "int4"])
    ap.add_argument("--delay", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--jobs", type=int, default=1, help="runs at once (one thread each)")
    ap.add_argument(
        "--out",
        type=Path,
        default=None,
        help="results (default: benchmarks/results/er_sync/<preset>-P<workers>-<steps>steps)",
    )
    ap.add_argument(
        "--quick", action="store_true", help="smoke: cpu-tiny, P = 2, 6 steps, 2 arms, 2 seeds"
    )
    ap.add_argument(
        "--report",
        action="store_true",
        help="run nothing: the table of every arm whose seeds are all kept under --out",
    )
    ap.add_argument("extra", nargs="*", help="more `mobius-fed local` flags, after --")
    args = ap.parse_args(argv)
    if args.quick:
        args.preset, args.workers, args.steps, args.seeds = "cpu-tiny", 2, 6, 2
        args.H, args.outer, args.codec, args.delay = [2], ["fedavg"], ["int4"], [1]
    if args.out is None:
        name = f"{args.preset}-P{args.workers}-{args.steps}steps"
        args.out = ROOT / "benchmarks" / "results" / "er_sync" / name
    if args.report:
        return report(args)
    arms = arms_of(args)
    args.out.mkdir(parents=True, exist_ok=True)
    args.work = Path(tempfile.mkdtemp(prefix="er_sync-"))  # sites and runs in flight
    try:
        return run_table(arms, args)
    finally:
        shutil.rmtree(args.work, ignore_errors=True)


def run_table(arms: list[Arm], args: argparse.Namespace) -> int:
    data = prepare_data(args)
    jobs = [(a, s) for a in arms for s in range(args.seed, args.seed + args.seeds)]
    print(
        f"{len(arms)} arms × {args.seeds} seeds = {len(jobs)} runs of mobius-fed local", flush=True
    )
    results: dict[tuple[str, int], float] = {}
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        for r in pool.map(lambda job: run_one(*job, args, data), jobs):
            results[r["arm"], r["seed"]] = r["eq8"]
            print(f"  {r['arm']} seed {r['seed']}: Eq. 8 {r['eq8']:.4f}", flush=True)
    text = table(arms, results, args)
    (args.out / "table.md").write_text(text)
    print("\n" + text)
    return 0


def arm_of(name: str) -> Arm:
    """The arm an ``Arm.name`` names (``H100-diloco-int4-tau1``)."""
    h, outer, codec, tau = name.split("-")
    return Arm(int(h[1:]), outer, "none" if codec == "fp32" else codec, int(tau[3:]))


def report(args: argparse.Namespace) -> int:
    """The table of the kept results alone: every arm with all ``--seeds`` seeds kept."""
    seeds = set(range(args.seed, args.seed + args.seeds))
    results: dict[tuple[str, int], float] = {}
    for path in sorted((args.out / "runs").glob("*.json")):
        kept = json.loads(path.read_text())
        if {k: kept.get(k) for k in setting(args)} == setting(args):
            results[kept["arm"], kept["seed"]] = kept["eq8"]
    complete = {a for a, _ in results if all((a, s) in results for s in seeds)}
    if BASELINE.name not in complete:
        sys.exit(f"{args.out}: the baseline {BASELINE.name} lacks a seed of {sorted(seeds)}")
    arms = sorted(map(arm_of, complete), key=lambda a: (a != BASELINE, a.H, a.name))
    text = table(arms, results, args)
    (args.out / "table.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
