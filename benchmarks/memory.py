"""Peak memory of one ring worker against the full model in one process, with the memory
options (``TrainConfig.memory``: recompute, chunked head loss) and the step-time cost.

* **worker**: the real step executor (:class:`mobius_fed.worker.executor.RingExecutor`,
  worker 1 of P, cyclic, L = ``--loops``) with its ring links replaced by a stub that hands
  it random tensors of the frame shape: F_i on every stream, E/R on its own, backward, the
  optimizer step; the options under test apply.
* **full model**: benchmarks/gpu.py's full model, all P groups and one E/R training the
  same P·B sequences through the whole stack, without any option (the process a site
  would otherwise need).

Peak memory: on CUDA ``torch.cuda.max_memory_allocated``; on a CPU the process's peak
resident set (VmHWM, reset through ``/proc/self/clear_refs`` before the measured step)
minus its resident set before the model was built. PyTorch's CPU allocator takes tensors
of more than a few hundred KiB straight from mmap and gives them back on free, so the high
-water mark follows the live tensor bytes (parameters, optimizer state, activations, logits
and transients). Step time: process CPU seconds of the measured step (one thread), which
the machine's other load does not inflate. Each measurement runs in its own process, after
one warm-up step (the optimizer state exists).

    python benchmarks/memory.py --preset gpt2-small --batch 2   # 50304-wide head, byte data
    python benchmarks/memory.py --preset cpu-base --batch 8
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

OPTIONS = {
    "none": {},
    "recompute": {"recompute": True},
    "chunked loss": {"loss_chunk": 1024},
    "both": {"recompute": True, "loss_chunk": 1024},
}


def _rss(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


class StubLinks:
    """Ring links that send nowhere and receive random tensors of the frame shape."""

    def __init__(self, shape: tuple[int, ...], device: torch.device) -> None:
        self.inbox = self
        self.shape, self.device = shape, device
        self.gen = torch.Generator().manual_seed(0)

    def get(self, key, timeout: float, what: str) -> torch.Tensor:
        del key, timeout, what
        return torch.randn(self.shape, generator=self.gen).to(self.device)

    def send_tensor(self, key, tensor: torch.Tensor) -> None:
        del key, tensor

    def send_packed(self, key, payload: torch.Tensor, codec) -> None:
        del key, payload, codec


def _worker(cfg, root: Path):
    from mobius_fed.data import SiteData, embedded_corpus, prepare_sites
    from mobius_fed.worker.executor import RingExecutor

    dirs = prepare_sites(None, root, cfg.P, cfg.encoding, text=embedded_corpus())
    site = SiteData(dirs[1], cfg.model().seq_len, cfg.encoding)
    ex = RingExecutor(cfg, 1, site, "memory")
    ex.links = StubLinks(ex.rules.shape, ex.device)  # type: ignore[assignment]
    return ex.train_step


def measure(which: str, option: str, args: argparse.Namespace) -> dict:
    """Peak bytes and CPU seconds of one step of ``which`` (worker/full) with ``option``."""
    import tempfile

    from mobius_fed.config import TrainConfig

    sys.path.insert(0, str(Path(__file__).parent))
    from gpu import full_step

    torch.set_num_threads(1)
    cuda = args.device == "cuda"
    base = _rss("VmRSS") if not cuda else 0
    cfg = TrainConfig(
        preset=args.preset,
        workers=args.workers,
        loops=args.loops,
        batch_size=args.batch,
        encoding=args.encoding,
        device=args.device,
        memory=OPTIONS[option] if which == "worker" else {},
    )
    device = torch.device(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        step = _worker(cfg, Path(tmp)) if which == "worker" else full_step(cfg, device)
        step()  # warm-up: optimizer state allocated
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        else:
            Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
        t0, w0 = time.process_time(), time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        cpu_s, wall_s = time.process_time() - t0, time.perf_counter() - w0
        peak = torch.cuda.max_memory_allocated() if cuda else _rss("VmHWM") - base
    return {"which": which, "option": option, "peak_bytes": peak, "cpu_s": cpu_s, "wall_s": wall_s}


def table(rows: list[dict], args: argparse.Namespace) -> str:
    full = next(r for r in rows if r["which"] == "full")
    plain = next((r for r in rows if r["which"] == "worker" and r["option"] == "none"), None)
    time_key = "wall_s" if args.device == "cuda" else "cpu_s"
    lines = [
        f"{args.preset}, P = {args.workers}, L = {args.loops}, batch {args.batch} per origin, "
        f"{args.device}",
        "",
        "| process | memory option | peak GiB | peak / full model | step s | step-time cost |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        cost = f"{r[time_key] / plain[time_key]:.2f}×" if plain and r["which"] == "worker" else "—"
        name = "one ring worker" if r["which"] == "worker" else "full model, one process"
        lines.append(
            f"| {name} | {r['option']} | {r['peak_bytes'] / 2**30:.3f} "
            f"| {r['peak_bytes'] / full['peak_bytes']:.2f} | {r[time_key]:.2f} | {cost} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default="gpt2-small")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--loops", type=int, default=1)
    p.add_argument("--batch", type=int, default=8, help="sequences per origin")
    p.add_argument(
        "--encoding",
        default="bytes",
        help="data tokenizer (gpt2-small keeps its 50304-wide head with bytes)",
    )
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--options", nargs="+", default=list(OPTIONS), choices=list(OPTIONS))
    p.add_argument("--one", nargs=2, metavar=("WHICH", "OPTION"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(measure(*args.one, args)))
        return 0
    rows = []
    flags = [a for a in sys.argv[1:] if a != "--options"]
    flags = [a for a in flags if a not in OPTIONS]
    for which, option in [("full", "none")] + [("worker", o) for o in args.options]:
        out = subprocess.run(
            [sys.executable, __file__, *flags, "--one", which, option],
            capture_output=True,
            text=True,
            check=True,
        )
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    print(table(rows, args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
