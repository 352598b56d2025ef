"""Sites of unequal speed: what an uneven split costs in quality, and what it buys in speed.

``quality``: Eq. 8 of ``--layers-per-group 4,4,2,2`` against the even 3,3,3,3 at equal
tokens (same steps, batch and data), paired by seed. Each (split, seed) trains with the
reference engine in this process (the ring equals it bit for bit, so no workers are
needed) and reports its final validation loss (Eq. 8); then Δ = uneven − even per seed,
with its mean and spread. One thread: run it alone, or niced, on a shared machine.

``speed`` (root: the namespace testbed): a static ring of P = 4 ``mobius-worker``
processes over mTLS, one namespace each, in scenarios where one site is slow: its compute
×2 or ×4, or its egress link at 1/10 of the others'. Compute is emulated with
``--emulate-slowdown x``: each application of a group lasts x times the CPU time it used
(the worker sleeps the rest), every site at ``--scale`` (3) and the slow one at 3 × its
factor, so a site's pace does not depend on the other workers sharing this host's cores.
Per scenario: the even split runs first; from its measured compute per step each site's
speed follows, ``mobius-fed plan``'s planner
(``mobius_fed.ops.plan``) proposes a split and predicts both splits' tokens/s; then the
planned split runs. The table sets measured tokens/s beside the predictions, and the
planned split's speed-up over the even one, measured and predicted.

    python benchmarks/uneven.py quality                       # cpu-small, 3 seeds
    python benchmarks/uneven.py quality --split 6,2,2,2 --seeds 0 1 --steps 60
    python benchmarks/uneven.py speed                         # x2, x4, link/10, base
    python benchmarks/uneven.py speed --scenarios x2 --steps 12 --out /tmp/speed.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

SHAKESPEARE = Path(__file__).resolve().parents[2] / "shared/data/tinyshakespeare.txt"


def final_eq8(train: dict, sites_root: Path) -> tuple[float, float]:
    """(final Eq. 8, seconds) of one reference-engine run of ``train``."""
    import torch

    from mobius_fed.config import TrainConfig
    from mobius_fed.data import SiteData
    from mobius_fed.engine import ReferenceEngine

    torch.set_num_threads(1)
    cfg = TrainConfig(**train)
    seq = cfg.model().seq_len
    sites = [SiteData(sites_root / f"site-{i}", seq, cfg.encoding) for i in range(cfg.P)]
    engine = ReferenceEngine(cfg, sites)
    start = time.perf_counter()
    for _ in range(cfg.steps):
        engine.train_step()
    return engine.evaluate().loss, time.perf_counter() - start


def add_quality_flags(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--preset", default="cpu-small")
    ap.add_argument("--split", default="4,4,2,2", help="the uneven split (default: %(default)s)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--loops", type=int, default=1)
    ap.add_argument("--order", default="cyclic")
    ap.add_argument("--eval-batches", type=int, default=8)
    ap.add_argument("--data", type=Path, default=SHAKESPEARE, help="text (default: %(default)s)")
    ap.add_argument("--out", type=Path, help="write the rows and the summary as JSON")


def quality(args: argparse.Namespace) -> None:
    from mobius_fed.data import embedded_corpus, prepare_sites

    split = [int(n) for n in args.split.split(",")]
    P = len(split)
    base = dict(
        preset=args.preset,
        workers=P,
        loops=args.loops,
        order=args.order,
        steps=args.steps,
        batch_size=args.batch_size,
        eval_every=0,
        eval_batches=args.eval_batches,
    )
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "sites"
        if args.data.is_file():
            prepare_sites([args.data], root, P)
        else:
            prepare_sites(None, root, P, text=embedded_corpus())
        for seed in args.seeds:
            for name, lpg in (("even", None), ("uneven", split)):
                loss, secs = final_eq8({**base, "seed": seed, "layers_per_group": lpg}, root)
                rows.append({"seed": seed, "split": name, "eq8": loss, "seconds": secs})
                print(f"seed {seed} {name:>6} {args.split if lpg else 'even':>8}: "
                      f"Eq. 8 {loss:.4f} ({secs:.0f} s)", flush=True)  # fmt: skip
    eq8 = {(r["seed"], r["split"]): r["eq8"] for r in rows}
    deltas = [eq8[s, "uneven"] - eq8[s, "even"] for s in args.seeds]
    mean = statistics.fmean(deltas)
    sd = statistics.stdev(deltas) if len(deltas) > 1 else 0.0
    print(f"Δ Eq. 8 ({args.split} − even), per seed: {', '.join(f'{d:+.4f}' for d in deltas)}")
    print(f"mean Δ {mean:+.4f} ± {sd:.4f} (sd over {len(deltas)} seeds)")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        summary = {"split": args.split, "deltas": deltas, "mean": mean, "sd": sd}
        args.out.write_text(json.dumps({"config": base, "rows": rows, **summary}, indent=2))


# ----------------------------------------------------------------------------- speed
sys.path.insert(0, str(Path(__file__).parent))  # the sibling benchmarks below
SLOW = 2
"""The rank of the slow site in every scenario."""
SCENARIOS = {
    "base": "every site alike, unshaped (the ring's overhead κ beyond its compute)",
    "x2": f"worker-{SLOW}'s compute ×2, unshaped",
    "x4": f"worker-{SLOW}'s compute ×4, unshaped",
    "link": f"every site's egress at --rate, worker-{SLOW}'s at 1/10 of it",
}


def add_speed_flags(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
    ap.add_argument("--preset", default="cpu-small")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--skip", type=int, default=2, help="untimed first steps (default 2)")
    ap.add_argument("--rate", default="100mbit", help="the link scenario's rate (default 100mbit)")
    ap.add_argument(
        "--scale",
        type=float,
        default=3.0,
        help="every site's compute emulated this many times slower than one core of this "
        "host, the slow one's that times its own factor (default 3: four workers' compute "
        "fits on two cores, each computing a third of its time)",
    )
    ap.add_argument("--timeout", type=float, default=900, help="seconds a run may take")
    ap.add_argument("--out", type=Path, help="write the rows as JSON")


def scenario_sites(name: str, rate: str, scale: float) -> list[tuple[float, str]]:
    """(compute slowdown, link shape) per site of scenario ``name``."""
    P = 4
    if name == "link":
        from mobius_fed.testbed.wan import parse_rate

        slow = f"{parse_rate(rate) // 10}bit"
        return [(scale, slow if i == SLOW else rate) for i in range(P)]
    x = {"base": 1.0, "x2": 2.0, "x4": 4.0}[name]
    return [(scale * (x if i == SLOW else 1.0), "loopback") for i in range(P)]


def run_ring(args, sites: list[tuple[float, str]], split: tuple[int, ...]) -> dict:
    """One static ring on the testbed: its tokens/s and each worker's compute s/step."""
    from wan import _compose, parse_shape, static_worker_argv

    from mobius_fed.config import TrainConfig
    from mobius_fed.data import embedded_corpus, prepare_sites
    from mobius_fed.model.config import show_split
    from mobius_fed.testbed import Testbed
    from mobius_fed.transport.certs import init_certs

    P = len(sites)
    with tempfile.TemporaryDirectory(prefix="uneven") as tmp:
        root = Path(tmp)
        init_certs(root / "certs", P)
        prepare_sites(None, root / "sites", P, text=embedded_corpus())
        services = {}
        for i, (slowdown, _) in enumerate(sites):
            argv = static_worker_argv(root, i, P, "--preset", args.preset)
            argv += ["--steps", str(args.steps), "--eval-every", "0"]
            argv += ["--layers-per-group", show_split(split), "--emulate-slowdown", str(slowdown)]
            services[f"worker-{i}"] = argv
        compose = _compose(root / "compose.yaml", services)
        wan = {f"worker-{i}": parse_shape(shape) for i, (_, shape) in enumerate(sites)}
        with Testbed(compose, root / "tb", wan=wan) as tb:
            tb.up(timeout=60)
            deadline = time.monotonic() + args.timeout
            while not all(tb.finished(s) for s in services):
                if tb.failed():
                    raise RuntimeError(tb.describe_failure(tb.failed()))
                if time.monotonic() > deadline:
                    raise RuntimeError(f"split {show_split(split)} did not finish")
                time.sleep(1)
        seconds, compute = [], []
        for i in range(P):
            lines = (root / "out" / f"worker-{i}" / "metrics.jsonl").read_text().splitlines()
            steps = [r for r in map(json.loads, lines) if "compute_s" in r][args.skip :]
            seconds.append(sum(r["seconds"] for r in steps))
            compute.append(statistics.fmean(r["compute_s"] for r in steps))
    tokens = TrainConfig(preset=args.preset, workers=P).tokens_per_step
    return {"tokens_s": (args.steps - args.skip) * tokens / max(seconds), "compute_s": compute}


def measured_sites(cfg, sites: list[tuple[float, str]], split, compute: list[float]):
    """The planner's sites: each one's speed from its measured compute s/step holding
    ``split[i]`` blocks, its link from the scenario."""
    from mobius_fed.ops.plan import UNSHAPED_BPS, Site, site_flops
    from mobius_fed.testbed.wan import parse_rate

    out = []
    for i, ((_, shape), n, c) in enumerate(zip(sites, split, compute, strict=True)):
        rate = UNSHAPED_BPS if shape == "loopback" else float(parse_rate(shape))
        out.append(Site(f"worker-{i}", site_flops(cfg, n, c), rate, 0.0, f"{c:.3f} s/step"))
    return out


def predict(cfg, sites, split: tuple[int, ...]) -> float:
    """Simulated tokens/s of ``split`` on ``sites``, each shaped link a token bucket as the
    testbed's ``tc tbf`` sets it."""
    from dataclasses import replace

    from wan import testbed_burst

    from mobius_fed.ops.plan import UNSHAPED_BPS, site_costs
    from mobius_fed.ops.step_sim import simulate_step

    costs = [
        replace(c, burst_bytes=testbed_burst(int(s.rate_bps)) if s.rate_bps < UNSHAPED_BPS else 0)
        for c, s in zip(site_costs(cfg, sites, split), sites, strict=True)
    ]
    step = simulate_step(cfg.order, cfg.P, cfg.loops, cfg.micro_batches, costs)["step_s"]
    return cfg.tokens_per_step / step


def speed_scenario(args, name: str) -> dict:
    """The even split, the plan from its measurements, then the planned split."""
    from mobius_fed.config import TrainConfig
    from mobius_fed.model.config import near_even_split, show_split
    from mobius_fed.ops.plan import plan_split

    sites = scenario_sites(name, args.rate, args.scale)
    cfg = TrainConfig(preset=args.preset, workers=len(sites))
    even = near_even_split(cfg.model().n_layer, cfg.P)
    got = run_ring(args, sites, even)
    measured = measured_sites(cfg, sites, even, got["compute_s"])
    plan = plan_split(cfg, measured)
    row = {
        "scenario": name,
        "even": {"split": show_split(even), **got, "predicted": predict(cfg, measured, even)},
        "planned": {
            "split": show_split(plan.split),
            "predicted": predict(cfg, measured, plan.split),
        },
    }
    if plan.split != even:
        mine = run_ring(args, sites, plan.split)
        own = measured_sites(cfg, sites, plan.split, mine["compute_s"])
        row["planned"].update(mine, own_predicted=predict(cfg, own, plan.split))
    else:  # the plan keeps the even split: its run is the even one
        row["planned"].update(got, own_predicted=row["even"]["predicted"])
    print(json.dumps(row), flush=True)
    return row


def speed_table(rows: list[dict], args) -> str:
    kappa = next(
        (r["even"]["predicted"] / r["even"]["tokens_s"] for r in rows if r["scenario"] == "base"),
        None,
    )
    lines = [
        f"{args.preset}, P = 4, L = 1, M = 1, cyclic, static ring of mobius-worker processes over "
        f"mTLS in the namespace testbed, {args.steps} steps ({args.skip} untimed); predicted "
        "from the even run's measured compute per site; κ: the base scenario's predicted over "
        "measured tokens/s" + (f" = {kappa:.2f}" if kappa else " (base not run)"),
        "",
        "| scenario | split | measured tokens/s | predicted | measured ÷ predicted "
        "| ÷ (predicted / κ) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        for which in ("even", "planned"):
            x = r[which]
            if which == "planned" and x["split"] == r["even"]["split"]:
                continue
            ratio = x["tokens_s"] / x["predicted"]
            at_k = f"{ratio * kappa:.2f}" if kappa else "—"
            lines.append(
                f"| {r['scenario']} ({SCENARIOS[r['scenario']]}) | {which} {x['split']} "
                f"| {x['tokens_s']:,.0f} | {x['predicted']:,.0f} | {ratio:.2f} | {at_k} |"
            )
    lines += ["", "| scenario | planned ÷ even, measured | predicted |", "|---|---|---|"]
    for r in rows:
        e, p = r["even"], r["planned"]
        lines.append(
            f"| {r['scenario']} | {p['tokens_s'] / e['tokens_s']:.2f} "
            f"| {p['predicted'] / e['predicted']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def speed(args: argparse.Namespace) -> None:
    from mobius_fed.testbed import netns_available

    why = netns_available()
    if why:
        raise SystemExit(f"speed: {why}")
    rows = [speed_scenario(args, name) for name in args.scenarios]
    print(speed_table(rows, args))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=2)
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="part", required=True)
    add_quality_flags(sub.add_parser("quality", help="Eq. 8 of an uneven split vs the even one"))
    add_speed_flags(sub.add_parser("speed", help="tokens/s of the even and planned splits"))
    args = ap.parse_args()
    (quality if args.part == "quality" else speed)(args)


if __name__ == "__main__":
    main()
