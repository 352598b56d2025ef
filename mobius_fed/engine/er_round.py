"""``mobius-fed local``'s E/R round under ``TrainConfig.sync`` (outer step, codec, delay):
the coordinator's path in one process, with the same functions.

Each origin's :class:`~mobius_fed.er_sync.ErSite` sends what a worker sends; the payloads
are decoded (:func:`~mobius_fed.er_sync.decode_er`), averaged by Flower's weighted average
(as :class:`~flwr.serverapp.strategy.FedAvg` does) and, with ``sync.outer = diloco``,
stepped by :func:`~mobius_fed.strategies.nesterov_step`; then each site starts the next
round from the result. Without a strategy wrapper on either side (no update clip here), the
losses are those of :func:`~mobius_fed.engine.federated.train_with_strategy` with the same
outer step (tests/test_er_sync.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, MetricRecord, RecordDict
from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

from mobius_fed.config import TrainConfig
from mobius_fed.er_sync import DownLink, ErSite, decode_er
from mobius_fed.model import Replica
from mobius_fed.strategies import nesterov_step


class LocalErRound:
    """The global E/R G, DiLoCo's outer momentum and the barrier that updates both."""

    def __init__(self, cfg: TrainConfig, sites: Sequence[ErSite]) -> None:
        self.cfg, self.sites = cfg, list(sites)
        self.global_er: ArrayRecord | None = None
        self.momentum: list[np.ndarray] | None = None
        # sync.down_codec: what the sites hold (the coordinator's ErDownRounds, one process)
        down = cfg.sync.down_codec
        self.down = DownLink(down) if down != "fp32" else None
        self.rounds = 0  # barriers so far: the broadcast's round

    def begin(self, replicas: Sequence[Replica]) -> None:
        """Before the first step: G = origin 0's E/R, every site starts from it."""
        shared = replicas[0].shared_state_dict()
        self.global_er = ArrayRecord({k: v.detach().clone() for k, v in shared.items()})
        self._start(replicas)

    def held(self) -> dict[str, torch.Tensor]:
        """What the sites start a round from: G, or with a down codec their held copy
        after its broadcast (:class:`~mobius_fed.er_sync.DownLink`)."""
        assert self.global_er is not None
        if self.down is None:
            return self.global_er.to_torch_state_dict()
        self.down.send(self.global_er, self.rounds, False)
        assert self.down.held is not None
        return {k: v.clone() for k, v in self.down.held.items()}

    def _start(self, replicas: Sequence[Replica]) -> None:
        state = self.held()
        for site, replica in zip(self.sites, replicas, strict=True):
            site.start_round(replica.shared_state_dict(), state)

    def barrier(self, replicas: Sequence[Replica]) -> None:
        """Every site's reply, decoded, averaged and stepped; the next round starts."""
        if self.global_er is None:
            raise RuntimeError("the E/R round was never begun")
        sync, n = self.cfg.sync, self.cfg.batch_size * self.cfg.model().seq_len
        records = []
        for site, replica in zip(self.sites, replicas, strict=True):
            arrays = site.end_round(replica.shared_state_dict())
            if sync.codec != "none":
                arrays = decode_er(arrays, self.global_er, sync.codec)
            records.append(RecordDict({"arrays": arrays, "metrics": MetricRecord({"n": n})}))
        average = aggregate_arrayrecords(records, "n")
        if sync.outer == "diloco":
            cfg = self.cfg
            average, self.momentum = nesterov_step(
                self.global_er, average, self.momentum, cfg.outer_lr, cfg.outer_momentum
            )
        self.global_er = average
        self.rounds += 1
        self._start(replicas)

    @contextmanager
    def evaluating(self, replicas: Sequence[Replica]) -> Iterator[None]:
        """With τ = 1, evaluate G, the model (each site's own E/R comes back afterwards);
        with τ = 0 the replicas as they are (G itself at a barrier, as a coordinator
        evaluates; between barriers, as ``mobius-fed local`` always did)."""
        if self.global_er is None or not self.cfg.sync.delay:
            yield
            return
        state = self.held()
        with ExitStack() as stack:
            for site, replica in zip(self.sites, replicas, strict=True):
                stack.enter_context(site.evaluating(replica.shared_state_dict(), state))
            yield

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"sites": [s.state_dict() for s in self.sites]}
        if self.global_er is not None:
            out["global"] = self.global_er.to_torch_state_dict()
        if self.momentum is not None:
            out["momentum"] = [torch.from_numpy(np.array(m)) for m in self.momentum]
        if self.down is not None:
            out["down"] = self.down.state()
            out["rounds"] = self.rounds
        return out

    def load_state_dict(self, state: dict[str, Any], replicas: Sequence[Replica]) -> None:
        for site, saved in zip(self.sites, state["sites"], strict=True):
            site.load_state_dict(saved)
        self.global_er = None
        if self.down is not None and "down" in state:
            self.down.load_state(state["down"])
            self.rounds = int(state["rounds"])
        if "global" in state:
            self.global_er = ArrayRecord({k: v.clone() for k, v in state["global"].items()})
            glob = self.held()
            for site, replica in zip(self.sites, replicas, strict=True):  # the round's G
                shared = replica.shared_state_dict()
                site.base = {k: glob[k].to(p.dtype).to(p.device) for k, p in shared.items()}
        moms = state.get("momentum")
        self.momentum = None if moms is None else [m.numpy().copy() for m in moms]
