"""One block group per GPU (the paper's claim) against the full model in one process.

On one CUDA device (bf16 autocast for the blocks, fp32 residual stream, Muon + AdamW as in
training) this measures, for ``--preset`` (default gpt2-small), P = ``--workers``, L = 1,
cyclic, batch ``--batch`` per origin:

* **worker**: what one ring worker computes per step — its embedding and head for its own
  stream plus its block group F_i applied to every stream (P applications), forward and
  backward, and its optimizer step; communication is left out (that is benchmarks/wan.py);
* **full model**: one process holding all P groups and one E/R pair, training the same P
  streams (P·B sequences) through the whole stack.

Reported: seconds per step, tokens/s (P·B·T tokens per step; for the ring, P workers run
in parallel, so the ring's tokens/s is the worker's), and peak GPU memory
(``torch.cuda.max_memory_allocated``), each with the worker / full-model ratio.

    python benchmarks/gpu.py                        # gpt2-small, P = 4, batch 8
    python benchmarks/gpu.py --preset cpu-base --batch 8 --steps 5

Exits with status 2 and a message when torch sees no CUDA device.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def _batch(cfg, vocab: int, gen: torch.Generator, device) -> tuple[torch.Tensor, torch.Tensor]:
    T = cfg.model().seq_len
    x = torch.randint(0, vocab, (cfg.batch_size, T + 1), generator=gen)
    return x[:, :-1].to(device), x[:, 1:].to(device)


def _measure(fn, steps: int, warmup: int) -> tuple[float, int]:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps, torch.cuda.max_memory_allocated()


def worker_step(cfg, device):
    """One worker's step: E/R for its stream, F_i on all P streams, its optimizers."""
    from mobius_fed.model import build_group, build_replica
    from mobius_fed.model.training import make_optimizers, step_optimizers

    mc = cfg.model()
    group = build_group(mc, 0, cfg.seed).to(device)
    replica = build_replica(mc, cfg.seed).to(device)
    opts = make_optimizers(group, cfg, blocks=True) + make_optimizers(replica, cfg, blocks=False)
    gen = torch.Generator().manual_seed(0)
    x, y = _batch(cfg, mc.vocab_size, gen, device)

    grad = torch.randn((*x.shape, mc.d_model), generator=gen).to(device) * 1e-3

    def leaf(h: torch.Tensor) -> torch.Tensor:  # a hidden state that came over the ring
        return h.detach().clone().requires_grad_()

    def step() -> None:
        h = replica.embed(x)
        outs = [group(h, 0)] + [group(leaf(h), t) for t in range(1, cfg.P)]
        replica.loss(leaf(h), y).backward()  # the home stream's head
        for out in outs:  # gradients arriving from the successor
            out.backward(grad)
        step_optimizers(opts, cfg, 0)
        for o in opts:
            o.zero_grad(set_to_none=True)

    return step


def full_step(cfg, device):
    """The whole stack in one process on the same P·B sequences."""
    from mobius_fed.model import build_group, build_replica
    from mobius_fed.model.training import make_optimizers, step_optimizers

    mc = cfg.model()
    groups = [build_group(mc, i, cfg.seed).to(device) for i in range(cfg.P)]
    replica = build_replica(mc, cfg.seed).to(device)
    opts = [o for g in groups for o in make_optimizers(g, cfg, blocks=True)]
    opts += make_optimizers(replica, cfg, blocks=False)
    gen = torch.Generator().manual_seed(0)
    batches = [_batch(cfg, mc.vocab_size, gen, device) for _ in range(cfg.P)]

    def step() -> None:
        for x, y in batches:
            h = replica.embed(x)
            for t, g in enumerate(groups):
                h = g(h, t)
            replica.loss(h, y).backward()
        step_optimizers(opts, cfg, 0)
        for o in opts:
            o.zero_grad(set_to_none=True)

    return step


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default="gpt2-small")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--encoding", default="gpt2", help="vocabulary size source (no download)")
    p.add_argument(
        "--tf32", action="store_true", help="allow TF32 for fp32 matmuls (the head, the optimizer)"
    )
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("error: benchmarks/gpu.py needs a CUDA device; torch sees none")
        return 2
    from mobius_fed.config import TrainConfig

    enc = args.encoding if args.preset == "gpt2-small" else "bytes"
    cfg = TrainConfig(preset=args.preset, workers=args.workers, batch_size=args.batch, encoding=enc)
    device = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = args.tf32
    tokens = cfg.tokens_per_step
    w_s, w_mem = _measure(worker_step(cfg, device), args.steps, args.warmup)
    torch.cuda.empty_cache()
    f_s, f_mem = _measure(full_step(cfg, device), args.steps, args.warmup)
    gpu = torch.cuda.get_device_name(0)
    rows = {
        "gpu": gpu,
        "preset": args.preset,
        "P": cfg.P,
        "batch": args.batch,
        "tf32": args.tf32,
        "worker_s": w_s,
        "full_s": f_s,
        "worker_tokens_s": tokens / w_s,
        "full_tokens_s": tokens / f_s,
        "worker_peak_GiB": w_mem / 2**30,
        "full_peak_GiB": f_mem / 2**30,
    }
    print(json.dumps(rows))
    tf32 = ", TF32 for fp32 matmuls" if args.tf32 else ""
    head = f"{gpu}, {args.preset}, P = {cfg.P}, batch {args.batch} per origin, bf16 autocast"
    print(f"\n{head}{tf32}\n")
    print("| process | s/step | tokens/s | peak GiB |")
    print("|---|---|---|---|")
    print(
        f"| one ring worker (F_i + E/R) | {w_s:.3f} | {tokens / w_s:,.0f} | {w_mem / 2**30:.2f} |"
    )
    print(f"| full model, one process | {f_s:.3f} | {tokens / f_s:,.0f} | {f_mem / 2**30:.2f} |")
    print(f"| worker / full | {w_s / f_s:.2f} | {f_s / w_s:.2f} | {w_mem / f_mem:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
