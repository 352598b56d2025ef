"""The cost of Secure Aggregation of the shared E/R per barrier: a site's masking time, the
coordinator's unmasking time, and the bytes of a train reply and order, against plain
FedAvg (E/R in fp32).

    python benchmarks/secagg_cost.py                            # cpu-tiny and cpu-small, P = 4
    python benchmarks/secagg_cost.py --presets cpu-small --workers 4 8 16 --bits 32 64

Times are the median of ``--repeats`` runs on one thread; bytes are the serialized Flower
records (``flwr.common.serde``) a reply carries, and the keys and attempt label the
coordinator adds to each train order.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from flwr.common import serde
from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

from mobius_fed.config import TrainConfig
from mobius_fed.defences.secagg import Round, SecAgg, SiteMasker
from mobius_fed.model import build_replica
from mobius_fed.transport.flower_wire import COORDINATOR_NODE_ID, set_task_identity


def _median_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


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

    mask_s = _median_s(mask_once, repeats)
    set_task_identity(COORDINATOR_NODE_ID)
    server = SecAgg.of(cfg)
    metrics = MetricRecord({"num-examples": 1})

    def replies() -> list[Message]:
        return [Message(RecordDict({"secagg": m, "metrics": metrics}), dst_node_id=1,
                        message_type="train") for m in masked]  # fmt: skip

    unmask_s = _median_s(lambda: server.unmask(replies(), start, list(range(P))), repeats)
    plain = [RecordDict({"arrays": a, "metrics": metrics}) for a in sites]
    fedavg_s = _median_s(lambda: aggregate_arrayrecords(plain, "num-examples"), repeats)
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", nargs="+", default=["cpu-tiny", "cpu-small"])
    ap.add_argument("--workers", type=int, nargs="+", default=[4])
    ap.add_argument("--bits", type=int, nargs="+", default=[32])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
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
