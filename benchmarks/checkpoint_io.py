"""Checkpoint save/load time: format 2 (safetensors) against format 1 (tensors + JSON).

    python benchmarks/checkpoint_io.py [--presets cpu-base gpt2-small] [--workers 4]
        [--repeats 3] [--dir /tmp] [--old-ref fc4dc2f]

The state is one worker's file of a P-worker run: its block group F_i, an E/R replica and
AdamW moments for both (what ``round-<r>.ckpt`` holds, the optimizer states dominating).
Format 1 is timed with the writer and reader of ``--old-ref`` (the last commit with the
format-1 writer, read with ``git show``; ``b6dec74`` gives the first format-2 reader,
which let safetensors' ``deserialize`` copy every tensor). Prints the best of
``--repeats`` for each, and new/old ratios (below 1: faster). Durable writes (fsync) as in
training; the formats take turns, so a busy host slows both alike, and the host's load
average is printed with the table (a busy host inflates the absolute times).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from mobius_fed import checkpoint
from mobius_fed.model.config import make_model_config
from mobius_fed.model.groups import build_group, build_replica

REPO = Path(__file__).resolve().parents[1]


def old_module(ref: str, into: Path):
    """mobius_fed/checkpoint.py as of git ``ref``, imported as a separate module."""
    src = subprocess.run(
        ["git", "-C", str(REPO), "show", f"{ref}:mobius_fed/checkpoint.py"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    file = into / "checkpoint_v1.py"
    file.write_text(src)
    spec = importlib.util.spec_from_file_location("checkpoint_v1", file)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def worker_state(preset: str, workers: int) -> dict:
    """One worker's checkpoint-shaped state (group, replica, AdamW moments)."""
    cfg = make_model_config(preset, groups=workers, vocab_size=50257)
    group, replica = build_group(cfg, 0, seed=0), build_replica(cfg, seed=0)
    opts = []
    for module in (group, replica):
        params = list(module.parameters())
        opt = torch.optim.AdamW(params, lr=1e-3)
        for p in params:
            opt.state[p] = {
                "step": torch.tensor(10.0),
                "exp_avg": torch.randn_like(p),
                "exp_avg_sq": torch.rand_like(p),
            }
        opts.append(opt.state_dict())
    return {
        "rank": 0,
        "step": 10,
        "group": group.state_dict(),
        "replica": replica.state_dict(),
        "opts": opts,
    }


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def row(preset: str, workers: int, old, d: Path, repeats: int) -> str:
    """One table row: the best save and load times of both formats on ``preset``'s worker
    state, the two formats taking turns (a busy host slows both alike)."""
    state = worker_state(preset, workers)
    nbytes = sum(t.numel() * t.element_size() for t in checkpoint.iter_tensors(state))
    f1, f2 = d / "v1.ckpt", d / "v2.ckpt"
    times: dict[str, list[float]] = {"s1": [], "s2": [], "l1": [], "l2": []}
    for _ in range(repeats):
        times["s1"].append(timed(lambda: old.save_checkpoint(f1, state)))
        times["s2"].append(timed(lambda: checkpoint.save_checkpoint(f2, state)))
        times["l1"].append(timed(lambda: old.load_checkpoint(f1)))
        times["l2"].append(timed(lambda: checkpoint.load_checkpoint(f2)))
    s1, s2, l1, l2 = (min(times[k]) for k in ("s1", "s2", "l1", "l2"))
    return (
        f"| {preset} | {nbytes / 1e6:.0f} | {s1:.3f} | {s2:.3f} | {s2 / s1:.2f} "
        f"| {l1:.3f} | {l2:.3f} | {l2 / l1:.2f} |"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", nargs="+", default=["cpu-base", "gpt2-small"])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=None, help="where the files go (a temp dir)")
    ap.add_argument("--old-ref", default="fc4dc2f", help="git ref of the format-1 writer")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        d = Path(tmp)
        old = old_module(args.old_ref, d)
        print("| preset | MB | save v1 s | save v2 s | ratio | load v1 s | load v2 s | ratio |")
        print("|---|---|---|---|---|---|---|---|")
        for preset in args.presets:
            print(row(preset, args.workers, old, d, args.repeats), flush=True)
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"\nhost load average (1, 5, 15 min) at the end: {load} on {os.cpu_count()} cores")
    return 0


if __name__ == "__main__":
    sys.exit(main())
