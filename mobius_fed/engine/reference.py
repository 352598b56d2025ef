"""The single-process reference engine: all P groups and P E/R replicas in one process.

It runs exactly the distributed semantics (docs/architecture.md §4): the same paths, the same
per-(stream, micro-batch) applications in the same order, the same loss scaling and the
same replica averaging, so a ring of workers must reproduce its losses.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import torch
from torch import Tensor

from mobius_fed import schedule
from mobius_fed.checkpoint import load_checkpoint, save_checkpoint
from mobius_fed.config import ConfigError, TrainConfig
from mobius_fed.data import SiteData
from mobius_fed.data.loader import Split
from mobius_fed.defences.nopeek import build_nopeek
from mobius_fed.defences.site_layers import build_site_replica
from mobius_fed.engine.er_round import LocalErRound
from mobius_fed.engine.hops import build_hops
from mobius_fed.engine.stream import Entry, StreamMaps, load_subspace_state, subspace_state
from mobius_fed.er_sync import ErSite
from mobius_fed.hop import Direction, HopContext, HopPhase
from mobius_fed.model import BlockGroup, Replica, build_group
from mobius_fed.model.layers import resolve_device
from mobius_fed.model.training import (
    average_parameters,
    make_optimizers,
    mean_loss,
    scale_grads,
    step_optimizers,
)


@dataclass
class StepResult:
    step: int
    loss: float
    origin_losses: list[float]
    seconds: float = 0.0
    tokens: int = 0


@dataclass
class EvalResult:
    step: int
    loss: float  # paper Eq. 8: equally weighted mean over origins
    origin_losses: list[float] = field(default_factory=list)


class ReferenceEngine:
    """All block groups F_0..F_{P-1} and per-origin replicas (E_s, R_s) in one process."""

    def __init__(self, cfg: TrainConfig, sites: Sequence[SiteData]) -> None:
        if cfg.rings > 1:
            raise ConfigError(
                f"rings={cfg.rings}: this engine (and mobius-fed local) trains one ring; "
                "train rings with mobius-fed up --rings R, or in one process with "
                "mobius_fed.engine.rings.make_engine under train_with_strategy (docs/rings.md)"
            )
        if len(sites) != cfg.workers:
            raise ValueError(f"need one site per worker: P={cfg.workers}, got {len(sites)} sites")
        self.cfg, self.sites = cfg, list(sites)
        mc = cfg.model()
        self.device = resolve_device(cfg.device)
        self.groups: list[BlockGroup] = [
            build_group(mc, i, cfg.seed).to(self.device) for i in range(cfg.P)
        ]
        self.replicas: list[Replica] = [
            build_site_replica(cfg, s).to(self.device) for s in range(cfg.P)
        ]
        self.group_opts = [make_optimizers(g, cfg, blocks=True) for g in self.groups]
        self.replica_opts = [make_optimizers(r, cfg, blocks=False) for r in self.replicas]
        self.step = 0
        self.handovers: list[tuple[int, int, SiteData, bool]] = []  # see hand_over
        self.average_replicas = True  # False when a Flower strategy averages (federated.py)
        self._table = schedule.tick_table(cfg.order, cfg.P, cfg.loops)
        self._paths = [schedule.path(cfg.order, s, cfg.P, cfg.loops) for s in range(cfg.P)]
        self.hops = build_hops(cfg, "reference")
        self.nopeek = build_nopeek(cfg)
        self.maps = StreamMaps(cfg, self.device)
        for i, (group, replica) in enumerate(zip(self.groups, self.replicas)):
            self.maps.bind(i, group, replica)  # a learned U: each worker's own copy
        # each origin's end of the E/R round (sync codec, delay); mobius-fed local's barrier
        self.er_sites = [ErSite(cfg.sync) for _ in range(cfg.P)]
        self.er_round = LocalErRound(cfg, self.er_sites)

    def _hop(
        self, phase: HopPhase, direction: Direction, step: int, s: int, slot: int, m: int
    ) -> HopContext:
        """Slot ``slot`` of stream s: written by the previous group (or home), read by the next."""
        path = self._paths[s]
        producer, consumer = schedule.producer(path, s, slot), schedule.consumer(path, s, slot)
        return HopContext(phase, direction, step, s, slot, m, producer, consumer)

    def _forward_hop(
        self, h: Tensor, phase: HopPhase, step: int, s: int, slot: int, m: int
    ) -> Tensor:
        if not self.hops:
            return h
        return self.hops.forward(h, self._hop(phase, "forward", step, s, slot, m))

    def _backward_hop(self, g: Tensor, step: int, s: int, slot: int, m: int) -> Tensor:
        g = self.maps.grad_out(g)
        if self.hops:
            g = self.hops.backward(g, self._hop("train", "backward", step, s, slot, m))
        return self.maps.grad_in(g)

    # ------------------------------------------------------------------ data
    def hand_over(
        self, origin: int, site: SiteData, at_step: int, evaluates_at_step: bool = False
    ) -> None:
        """Replay a handover to a standby (docs/recovery.md): from step ``at_step`` on (the
        end of the round it took over from) origin ``origin``'s batches come from ``site``;
        so do its evaluations after that step, and the one at ``at_step`` when the standby
        made it (``evaluates_at_step``: that round's evaluation was interrupted)."""
        if not 0 <= origin < self.cfg.P:
            raise ValueError(f"origin {origin} out of range for P={self.cfg.P}")
        self.handovers.append((at_step, origin, site, evaluates_at_step))

    def site_of(self, s: int, split: Split) -> SiteData:
        """Origin ``s``'s site at the current step: its own, or the standby's it went to."""
        site = self.sites[s]
        for at, origin, standby, at_eval in self.handovers:  # in order: a later one wins
            reached = self.step > at or (self.step == at and (split == "train" or at_eval))
            if origin == s and reached:
                site = standby
        return site

    def _micro(self, split: Split, s: int, step: int) -> list[tuple[Tensor, Tensor]]:
        x, y = self.site_of(s, split).batch(
            split, seed=self.cfg.seed, step=step, batch_size=self.cfg.batch_size
        )
        M = self.cfg.micro_batches
        x, y = x.to(self.device), y.to(self.device)
        return list(zip(x.chunk(M), y.chunk(M)))

    # ----------------------------------------------------------------- train
    def train_step(self) -> StepResult:
        """One step: forward K ticks, heads at home, backward in reverse, optimizer steps."""
        cfg, P = self.cfg, self.cfg.P
        strategy_only = [n for n in ("er_noise", "er_secagg") if getattr(cfg.privacy, n)]
        if self.average_replicas and strategy_only:  # before any work is done
            raise ConfigError(
                f"privacy.{strategy_only[0]} (DP-FedAvg or Secure Aggregation of the E/R) is "
                "applied by the Flower strategy at each barrier: train with a coordinator "
                "(mobius-fed up, compose), or drive this engine with "
                "mobius_fed.engine.federated.train_with_strategy"
            )
        if self.average_replicas and cfg.sync.active and self.er_round.global_er is None:
            self.er_round.begin(self.replicas)  # G = origin 0's E/R, as a strategy starts
        t0 = time.perf_counter()
        origin_losses = self.compute_gradients()
        for opts in self.group_opts + self.replica_opts:
            step_optimizers(opts, cfg, self.step)
        for replica in self.replicas:  # a learned U: one local step per round, then averaged
            self.maps.count_step(replica)
            if self.maps.ends_round(self.step):
                self.maps.end_round(replica, self.step)
        self.step += 1
        sync = cfg.sync_every  # a barrier every sync steps and at the end; 0: none
        if self.average_replicas and sync and (self.step % sync == 0 or self.step == cfg.steps):
            if cfg.sync.active:  # outer step, codec, delay: the coordinator's path
                self.er_round.barrier(self.replicas)
            else:
                average_parameters(self.replicas)
        return StepResult(
            step=self.step - 1,
            loss=sum(origin_losses) / P,
            origin_losses=origin_losses,
            seconds=time.perf_counter() - t0,
            tokens=cfg.tokens_per_step,
        )

    def compute_gradients(self) -> list[float]:
        """Forward and backward of step ``self.step``; leaves the scaled gradients in .grad.

        Block-group gradients equal those of the mean over origins (scaled by 1/(P·M));
        replica s holds the gradient of its own origin's loss (scaled by 1/M). Returns the
        per-origin losses.
        """
        P, M, K, n = self.cfg.P, self.cfg.micro_batches, self.cfg.K, self.step
        batches = [self._micro("train", s, n) for s in range(P)]
        embedded: dict[tuple[int, int], Entry] = {}
        hidden: dict[tuple[int, int], Tensor] = {}
        # NoPeek: the origin's penalty gradient for the slot its first remote hop carries
        nopeek, penalty, maps = self.nopeek, {}, self.maps
        for s in range(P):
            for m, (x, _) in enumerate(batches[s]):
                entry = embedded[s, m] = maps.enter(self.replicas[s].embed(x), ids=x, worker=s)
                if nopeek is not None and nopeek.slot(s) == 0:
                    penalty[s, 0, m] = nopeek.gradient(x, entry.slot0)
                hidden[s, m] = self._forward_hop(entry.slot0.detach(), "train", n, s, 0, m)
        applications: list[tuple[int, int, int, Tensor, Tensor]] = []
        for t, row in enumerate(self._table):
            for i, streams in row.items():
                for s in streams:
                    for m in range(M):
                        inp = hidden[s, m].requires_grad_()
                        out = maps.apply(
                            self.groups[i], inp, t, i, s, embedded[s, m], self.replicas[i].embed
                        )
                        if nopeek is not None and nopeek.slot(s) == t + 1:
                            penalty[s, t + 1, m] = nopeek.gradient(batches[s][m][0], out)
                        applications.append((t, s, m, inp, out))
                        hidden[s, m] = self._forward_hop(out.detach(), "train", n, s, t + 1, m)
        grads: dict[tuple[int, int], Tensor] = {}
        origin_losses = []
        for s in range(P):
            losses = []
            for m, (_, y) in enumerate(batches[s]):
                h = hidden[s, m].requires_grad_()
                loss = self.replicas[s].loss(maps.head(h, embedded[s, m]), y)
                loss.backward()
                grads[s, m] = self._backward_hop(cast(Tensor, h.grad), n, s, K, m)
                losses.append(loss)
            origin_losses.append(mean_loss(losses))
        for t, s, m, inp, out in reversed(applications):
            extra = penalty.pop((s, t + 1, m), None)
            out.backward(grads[s, m] if extra is None else grads[s, m] + extra)
            grads[s, m] = self._backward_hop(cast(Tensor, inp.grad), n, s, t, m)
        for s in range(P):
            for m in range(M):
                extra = penalty.pop((s, 0, m), None)
                embedded[s, m].backward(grads[s, m] if extra is None else grads[s, m] + extra)
        for group in self.groups:
            scale_grads(group.parameters(), 1.0 / (P * M))  # mean over origins
        for replica in self.replicas:
            scale_grads(replica.parameters(), 1.0 / M)
        return origin_losses

    # ------------------------------------------------------------------ eval
    @torch.no_grad()
    def evaluate(self) -> EvalResult:
        """Paper Eq. 8: the equally weighted mean over origins of the path-specific loss
        (under sync settings, of the global E/R: a site's own comes back afterwards)."""
        if not self.average_replicas:  # a strategy's grid loads what it evaluates
            return self._evaluate()
        with self.er_round.evaluating(self.replicas):
            return self._evaluate()

    def _evaluate(self) -> EvalResult:
        cfg = self.cfg
        per_origin = []
        for s in range(cfg.P):
            route = schedule.path(cfg.order, s, cfg.P, cfg.loops)
            losses = []
            micro = [mb for b in range(cfg.eval_batches) for mb in self._micro("val", s, b)]
            for j, (x, y) in enumerate(micro):
                entry = self.maps.enter(self.replicas[s].embed(x), grad=False, ids=x, worker=s)
                h = self._forward_hop(entry.slot0, "eval", self.step, s, 0, j)
                for t, i in enumerate(route):
                    out = self.maps.apply(self.groups[i], h, t, i, s, entry, self.replicas[i].embed)
                    h = self._forward_hop(out, "eval", self.step, s, t + 1, j)
                losses.append(self.replicas[s].loss(self.maps.head(h, entry), y))
            per_origin.append(mean_loss(losses))
        return EvalResult(step=self.step, loss=sum(per_origin) / cfg.P, origin_losses=per_origin)

    # ------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict:
        return {
            "config": self.cfg.model_dump(mode="json"),
            "step": self.step,
            "groups": [g.state_dict() for g in self.groups],
            "replicas": [r.state_dict() for r in self.replicas],
            "group_opts": [[o.state_dict() for o in opts] for opts in self.group_opts],
            "replica_opts": [[o.state_dict() for o in opts] for opts in self.replica_opts],
            **subspace_state(self.replicas),
            **({"er_sync": self.er_round.state_dict()} if self.cfg.sync.active else {}),
        }

    def load_state_dict(self, state: dict) -> None:
        saved = TrainConfig.model_validate(state["config"])
        why = self.cfg.difference(saved)
        if why:
            raise ValueError(f"checkpoint cannot continue this run: {why}")
        self.step = state["step"]
        for mod, sd in zip(self.groups + self.replicas, state["groups"] + state["replicas"]):
            mod.load_state_dict(sd)
        for opts, sds in zip(
            self.group_opts + self.replica_opts, state["group_opts"] + state["replica_opts"]
        ):
            for opt, sd in zip(opts, sds):
                opt.load_state_dict(sd)
        load_subspace_state(self.replicas, state)
        if "er_sync" in state:
            self.er_round.load_state_dict(state["er_sync"], self.replicas)

    def save(self, path: Path) -> Path:
        return save_checkpoint(path, self.state_dict())

    def load(self, path: Path) -> None:
        self.load_state_dict(load_checkpoint(path))
