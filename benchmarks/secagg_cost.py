"""The cost of Secure Aggregation of the shared E/R per barrier: a site's masking time, the
coordinator's unmasking time, and the bytes of a train reply and order, against plain
FedAvg (E/R in fp32).

    python benchmarks/secagg_cost.py                            # cpu-tiny and cpu-small, P = 4
    python benchmarks/secagg_cost.py --presets cpu-small --workers 4 12 --bits 32 64
    python benchmarks/secagg_cost.py --presets cpu-tiny --accuracy-steps 20 --repeats 1

Times are the median of ``--repeats`` runs on one thread; bytes are the serialized Flower
records (``flwr.common.serde``) a reply carries, and the keys and attempt label the
coordinator adds to each train order.
"""

from __future__ import annotations

import argparse
import itertools
import logging

import numpy as np
import torch
from commitments import median_seconds
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from flwr.common import serde
from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

from mobius_fed.config import TrainConfig
from mobius_fed.defences.secagg import Round, SecAgg, SiteMasker
from mobius_fed.model import build_replica
from mobius_fed.transport.flower_wire import COORDINATOR_NODE_ID, set_task_identity


def _size(record: ArrayRecord | ConfigRecord) -> int:
    if isinstance(record, ArrayRecord):
        return serde.array_record_to_proto(record).ByteSize()
    return serde.config_record_to_proto(record).ByteSize()


def measure(preset: str, P: int, bits: int, repeats: int) -> dict[str, float]:
    """One row: masking/unmasking time and bytes for ``preset`` with P sites."""
    from flwr.app import Message

    cfg = TrainConfig(preset=preset, workers=P, privacy={"er_secagg": True, "er_secagg_bits": bits})
    shared = build_replica(cfg.model(), cfg.seed).shared_state_dict()
    start = ArrayRecord({k: Array(v.detach().numpy().copy()) for k, v in shared.items()})
    rng = np.random.default_rng(0)
    sites = [
        ArrayRecord({k: Array(a + rng.normal(0, 1e-3, a.shape).astype(a.dtype))
                     for k, a in zip(start.keys(), start.to_numpy_ndarrays(), strict=True)})
        for _ in range(P)
    ]  # fmt: skip
    maskers = [SiteMasker(cfg, s) for s in range(P)]
    order = Round(1, "run/bench.1", [m.keys.public for m in maskers])
    masked = [m.masked(a, start, order) for m, a in zip(maskers, sites, strict=True)]
    attempts = itertools.count(2)  # a key pair masks each (round, attempt) once

    def mask_once() -> None:
        again = Round(1, f"run/bench.{next(attempts)}", order.public_keys)
        maskers[0].masked(sites[0], start, again)

    mask_s = median_seconds(mask_once, repeats)
    set_task_identity(COORDINATOR_NODE_ID)
    server = SecAgg.of(cfg)
    metrics = MetricRecord({"num-examples": 1})

    def replies() -> list[Message]:
        return [Message(RecordDict({"secagg": m, "metrics": metrics}), dst_node_id=1,
                        message_type="train") for m in masked]  # fmt: skip

    unmask_s = median_seconds(lambda: server.unmask(replies(), start, list(range(P))), repeats)
    plain = [RecordDict({"arrays": a, "metrics": metrics}) for a in sites]
    fedavg_s = median_seconds(lambda: aggregate_arrayrecords(plain, "num-examples"), repeats)
    keys = ConfigRecord()
    order.fill(keys)
    return {
        "elements": sum(a.size for a in start.to_numpy_ndarrays()),
        "mask_ms": 1e3 * mask_s,
        "unmask_ms": 1e3 * unmask_s,
        "fedavg_ms": 1e3 * fedavg_s,
        "reply_plain_B": _size(sites[0]),
        "reply_secagg_B": _size(masked[0]),
        "order_extra_B": _size(keys),
    }


def accuracy(
    preset: str, P: int, steps: int, strategy: str, optimizer: str
) -> tuple[float, float, float]:
    """(max per-step loss difference, Eq. 8 with SecAgg, Eq. 8 without): the reference
    engine under ``strategy``, a barrier every step, with and without ``er_secagg``."""
    import tempfile
    from pathlib import Path

    from mobius_fed.data import SiteData, embedded_corpus, prepare_sites
    from mobius_fed.engine import ReferenceEngine
    from mobius_fed.engine.federated import train_with_strategy
    from mobius_fed.strategies import RoundPlan, make_strategy

    cfg = TrainConfig(preset=preset, workers=P, batch_size=2, steps=steps, sync_every=1,
                      eval_every=0, optimizer=optimizer, privacy={"er_secagg": True})  # fmt: skip
    plain = cfg.model_copy(update={"privacy": cfg.privacy.model_copy(update={"er_secagg": False})})
    with tempfile.TemporaryDirectory() as tmp:
        dirs = prepare_sites(None, Path(tmp), P, text=embedded_corpus()[:60_000])
        sites = [SiteData(d, cfg.model().seq_len) for d in dirs]
        runs = [
            train_with_strategy(
                ReferenceEngine(c, sites),
                make_strategy(strategy, P, RoundPlan.of(c), secagg=SecAgg.of(c)),
            )
            for c in (cfg, plain)
        ]
    diff = max(
        abs(a - b)
        for r, s in zip(runs[0].steps, runs[1].steps, strict=True)
        for a, b in zip(r.origin_losses, s.origin_losses, strict=True)
    )
    return diff, runs[0].evals[-1].loss, runs[1].evals[-1].loss


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", nargs="+", default=["cpu-tiny", "cpu-small"])
    ap.add_argument("--workers", type=int, nargs="+", default=[4])
    ap.add_argument("--bits", type=int, nargs="+", default=[32])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--accuracy-steps",
        type=int,
        default=0,
        help="also train this many steps with and without SecAgg and compare",
    )
    ap.add_argument("--strategy", default="fedavg", help="for --accuracy-steps")
    ap.add_argument("--optimizer", default="muon", help="for --accuracy-steps")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    logging.getLogger("flwr").setLevel(logging.WARNING)
    if args.accuracy_steps:
        print("| preset | P | strategy | optimizer | steps | max per-step loss difference "
              "| Eq. 8 SecAgg | Eq. 8 plain |\n|---|---|---|---|---|---|---|---|")  # fmt: skip
        for preset in args.presets:
            for P in args.workers:
                d, with_, without = accuracy(
                    preset, P, args.accuracy_steps, args.strategy, args.optimizer
                )
                print(f"| {preset} | {P} | {args.strategy} | {args.optimizer} "
                      f"| {args.accuracy_steps} | {d:.2g} | {with_:.6f} | {without:.6f} |",
                      flush=True)  # fmt: skip
        print()
    print("| preset | P | b | E/R elements | site: mask | coordinator: unmask | plain FedAvg "
          "| reply, plain fp32 | reply, SecAgg | keys + attempt per order |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for preset in args.presets:
        for P in args.workers:
            for bits in args.bits:
                r = measure(preset, P, bits, args.repeats)
                print(
                    f"| {preset} | {P} | {bits} | {r['elements']:,} | {r['mask_ms']:.2f} ms "
                    f"| {r['unmask_ms']:.2f} ms | {r['fedavg_ms']:.2f} ms "
                    f"| {r['reply_plain_B']:,} B | {r['reply_secagg_B']:,} B "
                    f"| {r['order_extra_B']:,} B |",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
