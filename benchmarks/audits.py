"""What audits by recomputation cost (docs/audits.md): a coordinator and P workers as
processes over mTLS train the same run with ``audit.rate`` at its default (0.05) and 0,
alternating, and the tokens/s of each (tokens over the rounds' wall time at the
coordinator, the first round left out) are compared as the median of the paired ratios,
and so are the CPU seconds all its processes spent (run it without MOBIUS_WARM_START);
plus the pieces on one core: what a site adds to each round (its group state's digest and
serialized copy) and what the auditor spends on one audited step (the replay of one
group), each against a step of the ring.

    python benchmarks/audits.py                                   # cpu-small, P = 3
    python benchmarks/audits.py --pieces-only --preset cpu-small  # one core, seconds
    python benchmarks/audits.py --out benchmarks/results/audits/cpu-small.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))  # the sibling benchmark below

from commitments import median_seconds, run_once  # noqa: E402

from mobius_fed.config import TrainConfig  # noqa: E402


def pieces(train: TrainConfig, repeats: int = 10) -> dict[str, float]:
    """On one core: a site's per-round cost (its group state's digest and bytes, for
    worker 0 of ``train``) and the auditor's replay of one step of that group, on frames
    of the right shapes."""
    import torch

    from mobius_fed.engine.audit_replay import (
        GroupReplay,
        initial_state,
        state_bytes,
        state_digest,
    )

    torch.set_num_threads(1)
    state = initial_state(train, 0)

    def median(fn: Any) -> float:
        return median_seconds(fn, repeats)

    site_s = median(lambda: (state_digest(state), state_bytes(state)))
    mc = train.model()
    shape = (train.batch_size // train.micro_batches, mc.seq_len, mc.d_model)
    gen = torch.Generator().manual_seed(0)
    frames: dict[Any, torch.Tensor] = {}

    def take(frame: Any) -> torch.Tensor:
        if frame not in frames:
            frames[frame] = torch.randn(shape, generator=gen)
        return frames[frame]

    replay = GroupReplay(train, 0, state)
    replay_s = median(lambda: replay.step(0, take))
    return {
        "state_bytes": len(state_bytes(state)),
        "site_s_per_round": site_s,
        "replay_s_per_step": replay_s,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="cpu-small")
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--rate", type=float, default=0.05)
    p.add_argument("--repeats", type=int, default=3, help="runs per arm, alternating")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--pieces-only", action="store_true", help="only the pieces, in-process")
    p.add_argument("--out", type=Path, default=None, help="write the results here (JSON)")
    args = p.parse_args()
    base = dict(preset=args.preset, workers=args.workers, steps=args.steps,
                batch_size=args.batch_size, sync_every=1, eval_every=0)  # fmt: skip
    result: dict[str, Any] = {"setting": {**base, "rate": args.rate, "repeats": args.repeats}}
    result["pieces"] = pieces(TrainConfig(**base))
    if not args.pieces_only:
        arms: dict[str, list[dict[str, Any]]] = {"on": [], "off": []}
        with tempfile.TemporaryDirectory() as tmp:
            for k in range(args.repeats):
                for arm in ("off", "on") if k % 2 == 0 else ("on", "off"):
                    rate = args.rate if arm == "on" else 0.0
                    train = TrainConfig(**base, audit={"rate": rate})
                    r = run_once(train, Path(tmp) / f"{arm}-{k}", args.threads)
                    arms[arm].append(r)
                    print(f"{arm:>3} run {k}: {r['tokens_per_s']:,.0f} tokens/s, "
                          f"{r['cpu_s']:.1f} CPU s", flush=True)  # fmt: skip
        paired = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(arms["on"], arms["off"])]
        cpu = {a: statistics.median(r["cpu_s"] for r in runs) for a, runs in arms.items()}
        result.update(
            runs=arms,
            paired_ratios=paired,
            median_paired_ratio=statistics.median(paired),
            cpu_ratio_on_off=cpu["on"] / cpu["off"],
        )
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
