"""P ``mobius-worker`` processes on one machine's accelerator, over loopback mTLS, against the
reference engine on the same device: the GPU ring.

Every worker and the reference get the same TrainConfig (any training flag, e.g.
``--subspace-rank 96 --subspace-mode home --subspace-writes full`` or
``--memory-recompute``). Reported: max |Δ loss| ring vs reference over every (step, origin),
the ring's tokens/s (median over steady steps of the slowest worker's step), each worker's
peak memory (``torch.cuda.max_memory_allocated`` on CUDA, the peak resident set on a CPU)
and bytes sent per step.

    python benchmarks/gpu_ring.py --device cuda --precision fp32 --steps 4      # == reference
    python benchmarks/gpu_ring.py --device cuda --precision bf16 --steps 8 \\
        --subspace-rank 96 --subspace-mode home --subspace-writes full
    python benchmarks/gpu_ring.py --device cpu --preset cpu-tiny --steps 3      # any machine

On a CPU the ring equals the reference exactly. On CUDA, kernels may differ between a
worker process and the reference (cuBLAS/SDPA choices), so the check is a tolerance
(``--tolerance``: 1e-5 by default, 1e-2 for bf16 blocks on CUDA).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from ring_benchmark import RingRun, run_reference

from mobius_fed.cli.common import add_train_flags, train_config_from_args
from mobius_fed.data import SiteData, embedded_corpus, prepare_sites
from mobius_fed.ops.federation import toml_table
from mobius_fed.transport.certs import init_certs


class ConfiguredRing(RingRun):
    """The benchmark's ring with the whole TrainConfig handed to every worker (--config)."""

    toml: Path | None = None

    def command(self, i: int, ports: list[int]) -> list[str]:
        return [*super().command(i, ports), "--config", str(self.toml)]


def peaks(run: RingRun) -> list[int]:
    """Each worker's peak memory over the run, from its metrics rows."""
    return [max((r.get("peak_bytes") or 0) for r in rows.values()) for rows in run.rows]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_train_flags(p)
    p.add_argument("--warmup", type=int, default=1, help="untimed ring steps")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument(
        "--tolerance",
        type=float,
        default=None,
        help="max |Δ loss| allowed (default 1e-5; 1e-2 for bf16 blocks on CUDA)",
    )
    p.add_argument("--timeout", type=float, default=900, help="seconds for the ring")
    p.add_argument("--keep", type=Path, default=None, help="keep worker dirs and logs here")
    p.set_defaults(preset="gpt2-small")
    args = p.parse_args(argv)
    cfg = train_config_from_args(args, sync_every=0, eval_every=0)  # E/R local: static ring
    if not 1 <= args.warmup < cfg.steps:
        p.error(f"--warmup ({args.warmup}) must be at least 1 and below --steps ({cfg.steps})")
    cuda = cfg.device.startswith("cuda")
    if args.tolerance is None:
        args.tolerance = 1e-2 if cuda and cfg.precision == "bf16" else 1e-5
    mc = cfg.model()
    print(
        f"gpu ring: {cfg.preset} ({mc.n_layer} layers, d={mc.d_model}, T={mc.seq_len}), "
        f"P={cfg.P} L={cfg.loops} {cfg.order}, batch {cfg.batch_size}/origin, "
        f"{cfg.tokens_per_step:,} tokens/step, device {cfg.device}, precision {cfg.precision}, "
        f"subspace k={cfg.subspace.rank} ({cfg.subspace.mode}, {cfg.subspace.writes}), "
        f"wire {cfg.wire_dtype}",
        flush=True,
    )
    tmp = tempfile.TemporaryDirectory(prefix="gpu-ring-")
    root = args.keep or Path(tmp.name)
    root.mkdir(parents=True, exist_ok=True)
    try:
        sites_dir, certs = root / "sites", root / "certs"
        prepare_sites(None, sites_dir, cfg.P, cfg.encoding, text=embedded_corpus(), overwrite=True)
        init_certs(certs, cfg.P)
        sites = [SiteData(sites_dir / f"site-{i}", mc.seq_len, cfg.encoding) for i in range(cfg.P)]
        print("[reference] ...", flush=True)
        ref = run_reference(cfg, sites, args.threads, args.warmup, cfg.steps - args.warmup)
        ref_peak = torch.cuda.max_memory_allocated() if cuda else None
        if cuda:
            torch.cuda.empty_cache()  # the engine is gone: leave the device to the workers
        print("[ring] ...", flush=True)
        ring = ConfiguredRing(root / "ring", cfg, args.threads, sites_dir, certs)
        ring.root.mkdir(parents=True, exist_ok=True)
        ring.toml = root / "train.toml"
        ring.toml.write_text("\n".join(toml_table("train", cfg.model_dump(mode="json"))) + "\n")
        ring.run(timeout=args.timeout)
        got = ring.summarize(args.warmup)
        peak = peaks(ring)
    finally:
        tmp.cleanup()
    common = sorted(k for k in ref["losses"] if k in got["losses"])
    if not common:
        print("no (step, origin) loss of the ring matches the reference's", file=sys.stderr)
        return 1
    diff = max(abs(ref["losses"][k] - got["losses"][k]) for k in common)
    result = {
        "preset": cfg.preset,
        "device": cfg.device,
        "precision": cfg.precision,
        "subspace": cfg.subspace.model_dump(),
        "memory": cfg.memory.model_dump(),
        "max_abs_dloss": diff,
        "pairs": len(common),
        "ring_tokens_per_s": got["tokens/s"],
        "ring_s_per_step": got["s/step"],
        "reference_tokens_per_s": ref["tokens/s"],
        "worker_peak_gib": [round(b / 2**30, 3) for b in peak],
        "reference_peak_gib": None if ref_peak is None else round(ref_peak / 2**30, 3),
        "bytes_per_step_per_worker": statistics.mean(got["bytes/step"]),
    }
    print(json.dumps(result))
    print(
        f"ring == reference: max |Δ loss| {diff:.2e} over {len(common)} (step, origin) pairs "
        f"({'within' if diff <= args.tolerance else 'OUTSIDE'} {args.tolerance:g}); "
        f"ring {got['tokens/s']:,.0f} tokens/s ({got['s/step']:.3f} s/step), reference "
        f"{ref['tokens/s']:,.0f}; worker peak {max(peak) / 2**30:.2f} GiB; "
        f"{result['bytes_per_step_per_worker'] / 1e6:.2f} MB sent per step and worker"
    )
    return 0 if diff <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
