"""What commitments cost (docs/security.md "Commitments"): a coordinator and P workers as
processes over mTLS train the same run with ``audit.commitments`` on and off, alternating,
and the tokens/s of each (tokens over the rounds' wall time at the coordinator, the first
round left out) are compared as the ratio of the medians, and so are the CPU seconds all
its processes spent (run it without MOBIUS_WARM_START, so that they are this process's
children); plus the pieces on one core: the sha256 of one frame of the preset's hidden
state, one signature and one verification.

    python benchmarks/commitments.py                                  # cpu-small, P = 3
    python benchmarks/commitments.py --preset cpu-tiny --steps 20 --repeats 5
    python benchmarks/commitments.py --out benchmarks/results/commitments/cpu-small.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mobius_fed.config import TrainConfig  # noqa: E402
from mobius_fed.ops.federation import LocalFederation  # noqa: E402
from mobius_fed.transport.commitments import TRAIN, frame_hops  # noqa: E402


def median_seconds(fn, repeats: int) -> float:
    """The median wall time of ``repeats`` calls of ``fn`` (one piece's cost, in seconds)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _children_cpu_s() -> float:
    """CPU seconds (user + system) of this process's waited-for children so far."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_once(train: TrainConfig, root: Path, threads: int) -> dict[str, Any]:
    """One run; its tokens/s over the rounds after the first, and the CPU seconds its
    processes spent (start-up included: the same in both arms), which a loaded machine
    disturbs less than wall time."""
    fed = LocalFederation(root, train, threads=threads)
    fed.prepare()
    cpu0 = _children_cpu_s()
    fed.start()
    try:
        final = fed.wait(timeout=1800)
        hist = fed.rest("/v1/history")
    finally:
        fed.stop()
    cpu_s = _children_cpu_s() - cpu0
    if final["phase"] != "done":
        raise SystemExit(f"run failed: {final.get('error')}\n{fed.tail('coordinator', 30)}")
    rounds = hist["rounds"][1:]
    tokens = train.workers * train.batch_size * train.model().seq_len
    seconds = sum(r["seconds"] for r in rounds)
    steps = sum(r["steps"] for r in rounds)
    c, a = final.get("commitments") or {}, final.get("audits") or {}
    return {
        "tokens_per_s": tokens * steps / seconds,
        "cpu_s": cpu_s,
        "seconds": seconds,
        "steps": steps,
        "frames_checked": c.get("frames_checked"),
        "incidents": len(c.get("incidents", [])),
        "audits": {k: a[k] for k in ("asked", "passed", "skipped") if k in a},
    }


def pieces(train: TrainConfig, repeats: int = 20) -> dict[str, float]:
    """What commitments add to one step, timed on one core: the sha256 of one frame of the
    preset's hidden state (each hop is digested by its sender and its receiver), one site's
    seal (a step's entries, signed) and the coordinator's check of a round of P replies,
    and the critical path they add to a step (a worker's share of the digests, its seal and
    the check, at one barrier per step)."""
    import torch
    from flwr.app import RecordDict

    from mobius_fed.coordinator.commitments import CommitmentAudit
    from mobius_fed.messages import COMMITMENT
    from mobius_fed.transport.certs import init_certs
    from mobius_fed.transport.codec import encode_frames
    from mobius_fed.transport.commitments import own_entries
    from mobius_fed.transport.flower_wire import worker_node_id
    from mobius_fed.worker.commitments import Commitments
    from mobius_fed.worker.frames import FrameKey

    mc, P = train.model(), train.P
    t = torch.randn(train.batch_size // train.micro_batches, mc.seq_len, mc.d_model)
    frames = list(encode_frames(run_id="r", step=0, origin=0, tick=1, micro=0, direction=1,
                                tensor=t))  # fmt: skip

    def median(fn) -> float:
        return median_seconds(fn, repeats)

    digest_s = median(lambda: hashlib.sha256(b"".join(frames)).hexdigest())
    hops = frame_hops(train.order, P, train.loops, train.micro_batches, TRAIN, 0)
    n_hops = sum(len(route) - 1 for _, route in hops)
    with tempfile.TemporaryDirectory() as d:
        init_certs(Path(d), P)
        nodes = [Path(d) / "nodes" / f"worker-{r}" for r in range(P)]
        certs = [(n / "tls.crt").read_bytes() for n in nodes]
        sites = [Commitments(train, r, r, f"mobius://worker/{r}", (n / "tls.key").read_bytes(),
                             1.0) for r, n in enumerate(nodes)]  # fmt: skip
    claims = [own_entries(frame_hops(train.order, P, train.loops, train.micro_batches,
                                     TRAIN, 0), r) for r in range(P)]  # fmt: skip

    def seal(r: int) -> Any:
        for (step, phase, direction, origin, slot, micro), way, peer in claims[r]:
            key = FrameKey(phase, step, direction, origin, slot, micro)
            sites[r].ledger.record(key, way, peer, "0" * 64)
        return sites[r].seal("run/1.0", 1, TRAIN, 0, 1)

    seal_s = median(lambda: seal(0))
    replies = [SimpleNamespace(metadata=SimpleNamespace(src_node_id=worker_node_id(r)),
                               content=RecordDict({COMMITMENT: seal(r).to_record()}))
               for r in range(P)]  # fmt: skip
    audit = CommitmentAudit(train, certs.__getitem__, lambda: "run/1.0", lambda r: f"w{r}")
    check_s = median(lambda: audit.check(1, TRAIN, 0, 1, replies))
    return {
        "frame_bytes": sum(len(f) for f in frames),
        "frame_sha256_s": digest_s,
        "hops_per_step": n_hops,
        "seal_s": seal_s,
        "check_s": check_s,
        "body_bytes_per_step": len(replies[0].content[COMMITMENT]["body"]),
        "added_s_per_step": 2 * n_hops / P * digest_s + seal_s + check_s,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="cpu-small")
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3, help="runs per arm, alternating")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--out", type=Path, default=None, help="write the results here (JSON)")
    args = p.parse_args()
    base = dict(preset=args.preset, workers=args.workers, steps=args.steps,
                batch_size=args.batch_size, sync_every=1, eval_every=0)  # fmt: skip
    arms: dict[str, list[dict[str, Any]]] = {"on": [], "off": []}
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(args.repeats):
            for arm in ("off", "on") if k % 2 == 0 else ("on", "off"):
                train = TrainConfig(**base, audit={"commitments": arm == "on"})
                r = run_once(train, Path(tmp) / f"{arm}-{k}", args.threads)
                arms[arm].append(r)
                print(
                    f"{arm:>3} run {k}: {r['tokens_per_s']:,.0f} tokens/s, {r['cpu_s']:.1f} CPU s",
                    flush=True,
                )
    med = {a: statistics.median(r["tokens_per_s"] for r in runs) for a, runs in arms.items()}
    # each repeat's on and off ran back to back: their ratio sees the same machine load
    paired = [on["tokens_per_s"] / off["tokens_per_s"] for on, off in zip(arms["on"], arms["off"])]
    cpu = {a: statistics.median(r["cpu_s"] for r in runs) for a, runs in arms.items()}
    result = {
        "setting": {**base, "repeats": args.repeats, "threads": args.threads},
        "runs": arms,
        "median_tokens_per_s": med,
        "ratio_on_off": med["on"] / med["off"],
        "paired_ratios": paired,
        "median_paired_ratio": statistics.median(paired),
        "median_cpu_s": cpu,
        "cpu_ratio_on_off": cpu["on"] / cpu["off"],
        "pieces": pieces(TrainConfig(**base)),
    }
    step_s = statistics.median(r["seconds"] / r["steps"] for r in arms["off"])
    added = result["pieces"]["added_s_per_step"]
    result["step_s_off"] = step_s
    result["pieces_ratio"] = step_s / (step_s + added)  # what the pieces alone predict
    shown = ("median_tokens_per_s", "ratio_on_off", "paired_ratios", "median_paired_ratio",
             "median_cpu_s", "cpu_ratio_on_off", "step_s_off", "pieces_ratio")  # fmt: skip
    print(json.dumps({k: result[k] for k in (*shown, "pieces")}, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
