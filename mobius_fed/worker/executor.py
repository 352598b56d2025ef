"""The ring step executor of worker i (docs/architecture.md §2).

Per step: embed the home batch, apply F_i to every (tick, stream, micro-batch) this worker
owns in forward order, compute R and the loss at home, back-propagate the same
applications in reverse order, then step the optimizers. The order of applications is
fixed by the schedule, so parameter gradients accumulate exactly as in the reference
engine and the losses match it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import cast

import torch
from torch import Tensor

from mobius_fed import schedule
from mobius_fed.config import TrainConfig
from mobius_fed.data import SiteData
from mobius_fed.data.loader import Split
from mobius_fed.defences.nopeek import build_nopeek
from mobius_fed.defences.site_layers import build_site_replica
from mobius_fed.engine.hops import build_hops
from mobius_fed.engine.stream import StreamMaps, load_subspace_state, subspace_state
from mobius_fed.engine.wire_stages import CodecStage, codecs
from mobius_fed.er_sync import ErSite
from mobius_fed.hop import HopContext
from mobius_fed.model import build_group
from mobius_fed.model.layers import resolve_device
from mobius_fed.model.training import make_optimizers, mean_loss, scale_grads, step_optimizers
from mobius_fed.worker.audits import AuditStore, frame_of
from mobius_fed.worker.frames import (
    BACKWARD,
    EVAL,
    FORWARD,
    TRAIN,
    FrameBounds,
    FrameKey,
    FrameRules,
)
from mobius_fed.worker.link import RingLinks

log = logging.getLogger("mobius.executor")


@dataclass
class WorkerStep:
    step: int
    loss: float  # this worker's origin: mean CE of its own stream
    compute_s: float
    wait_s: float
    seconds: float


class RingExecutor:
    """Worker ``rank``'s block group F_rank, its E/R replica and its local data."""

    def __init__(
        self, cfg: TrainConfig, rank: int, site: SiteData, run_id: str, peer_timeout: float = 120
    ) -> None:
        self.cfg, self.rank, self.site, self.run_id = cfg, rank, site, run_id
        self.device = resolve_device(cfg.device)
        self.group = build_group(cfg.model(), rank, cfg.seed).to(self.device)
        self.replica = build_site_replica(cfg, rank, "ring").to(self.device)
        self.group_opts = make_optimizers(self.group, cfg, blocks=True)
        self.replica_opts = make_optimizers(self.replica, cfg, blocks=False)
        self.step = 0
        self.bounds = FrameBounds(cfg.bounds, rank)  # lives as long as this worker
        self.rules = FrameRules(cfg, rank, run_id, lambda: self.step, self.bounds)
        self.ticks = schedule.worker_schedule(cfg.order, rank, cfg.P, cfg.loops)  # (t, s)
        self.applications = [(t, s, m) for t, s in self.ticks for m in range(cfg.micro_batches)]
        self.links: RingLinks | None = None
        self.peer_timeout = peer_timeout
        self.hops = build_hops(cfg, "ring", rank)
        self.nopeek = build_nopeek(cfg)
        self.maps = StreamMaps(cfg, self.device)
        self.maps.bind(rank, self.group, self.replica)  # a learned U: this worker's copy
        self._codecs = codecs(cfg)
        stages = [st for st in self.hops.stages if isinstance(st, CodecStage)]
        self._codec_stage: CodecStage | None = stages[0] if stages else None
        self._warned_reencode = False
        self._local: dict[FrameKey, Tensor] = {}
        self._wait = 0.0
        self.slowdown = 1.0  # benchmarks: behave as a site this many times slower
        self.er = ErSite(cfg.sync)  # its end of the E/R round (codec, residual, delay)
        self.audit: AuditStore | None = None  # audits: keeps the frames passed without a hop

    # ------------------------------------------------------------ transport
    def _emit(self, key: FrameKey, tensor: Tensor, dest: int, ctx: HopContext) -> None:
        if dest == self.rank:
            self._local[key] = tensor
            if self.audit is not None and key.phase == TRAIN:  # its home's, for an audit
                self.audit.local(frame_of(key), tensor)
            return
        assert self.links is not None, "a ring of P > 1 needs links"
        codec = self._codecs[0 if key.direction == FORWARD else 1]
        if codec.lossless:
            self.links.send_tensor(key, tensor)
            return
        stage = self._codec_stage
        assert stage is not None, "a lossy codec always has its hop stage"
        payload = stage.take_payload(ctx, tensor)
        if payload is None:  # a stage after the codec changed the tensor: encode it anew
            if not self._warned_reencode:
                log.warning("a hop stage runs after the wire codec: the ring re-encodes")
                self._warned_reencode = True
            payload = stage.encode(ctx, tensor)
        self.links.send_packed(key, payload, codec)

    def _take(self, key: FrameKey) -> Tensor:
        if key in self._local:
            return self._local.pop(key)
        assert self.links is not None, f"missing local {key.describe()}"
        start = time.perf_counter()
        src = "predecessor" if key.direction == FORWARD else "successor"
        tensor = self.links.inbox.get(key, self.peer_timeout, f"{key.describe()} from the {src}")
        self._wait += time.perf_counter() - start
        return tensor.to(self.device, non_blocking=True)

    def _take_grad(self, key: FrameKey) -> Tensor:
        """A BACKWARD frame as the slot's gradient (see StreamMaps.grad_in)."""
        return self.maps.grad_in(self._take(key))

    def _send(self, key: FrameKey, tensor: Tensor) -> None:
        """Pass ``tensor`` through the hop stages and emit it as frame ``key``: forward to
        the slot's consumer, backward to its producer."""
        s, slot, forward = key.origin, key.tick, key.direction == FORWARD
        ctx = HopContext(
            "train" if key.phase == TRAIN else "eval",
            "forward" if forward else "backward",
            key.step,
            s,
            slot,
            key.micro,
            self.rules.producer(s, slot),
            self.rules.consumer(s, slot),
        )
        if not forward:
            tensor = self.maps.grad_out(tensor)
        if self.hops:
            tensor = (self.hops.forward if forward else self.hops.backward)(tensor, ctx)
        self._emit(key, tensor, ctx.consumer if forward else ctx.producer, ctx)

    # ---------------------------------------------------------------- train
    def _emulate_slower_site(self, start: tuple[float, float]) -> None:
        """With ``slowdown`` x > 1, the application begun at ``start`` (wall, this thread's
        CPU seconds) lasts x times the CPU time it used: the worker sleeps the rest. A site
        x times slower than one core of this host, whatever else shares the host."""
        if self.slowdown > 1:
            wall, cpu = time.perf_counter() - start[0], time.thread_time() - start[1]
            time.sleep(max(0.0, self.slowdown * cpu - wall))

    def _micro(self, split: Split, step: int) -> list[tuple[Tensor, Tensor]]:
        x, y = self.site.batch(split, seed=self.cfg.seed, step=step, batch_size=self.cfg.batch_size)
        M = self.cfg.micro_batches
        x, y = x.to(self.device), y.to(self.device)
        return list(zip(x.chunk(M), y.chunk(M)))

    def train_step(self) -> WorkerStep:
        cfg, n, K, M = self.cfg, self.step, self.cfg.K, self.cfg.micro_batches
        self._wait, t0 = 0.0, time.perf_counter()
        batches = self._micro("train", n)
        embedded = []
        # NoPeek: this origin's penalty gradient for the slot its first remote hop carries
        nopeek, penalty = self.nopeek, {}
        first = nopeek.slot(self.rank) if nopeek is not None else None
        for m, (x, _) in enumerate(batches):
            entry = self.maps.enter(self.replica.embed(x), ids=x, worker=self.rank)
            embedded.append(entry)
            if nopeek is not None and first == 0:
                penalty[0, m] = nopeek.gradient(x, entry.slot0)
            self._send(FrameKey(TRAIN, n, FORWARD, self.rank, 0, m), entry.slot0.detach())
        saved: dict[tuple[int, int, int], tuple[Tensor, Tensor]] = {}
        for t, s, m in self.applications:
            inp = self._take(FrameKey(TRAIN, n, FORWARD, s, t, m)).requires_grad_()
            own = embedded[m] if s == self.rank else None
            start = time.perf_counter(), time.thread_time()
            out = self.maps.apply(self.group, inp, t, self.rank, s, own, self.replica.embed)
            self._emulate_slower_site(start)
            if nopeek is not None and s == self.rank and first == t + 1:
                penalty[t + 1, m] = nopeek.gradient(batches[m][0], out)
            saved[t, s, m] = (inp, out)
            self._send(FrameKey(TRAIN, n, FORWARD, s, t + 1, m), out.detach())
        losses = []
        for m, (_, y) in enumerate(batches):
            h = self._take(FrameKey(TRAIN, n, FORWARD, self.rank, K, m)).requires_grad_()
            loss = self.replica.loss(self.maps.head(h, embedded[m]), y)
            loss.backward()
            losses.append(loss)
            self._send(FrameKey(TRAIN, n, BACKWARD, self.rank, K, m), cast(Tensor, h.grad))
        for t, s, m in reversed(self.applications):
            inp, out = saved.pop((t, s, m))
            g = self._take_grad(FrameKey(TRAIN, n, BACKWARD, s, t + 1, m))
            extra = penalty.pop((t + 1, m), None) if s == self.rank else None
            start = time.perf_counter(), time.thread_time()
            out.backward(g if extra is None else g + extra)
            self._emulate_slower_site(start)
            self._send(FrameKey(TRAIN, n, BACKWARD, s, t, m), cast(Tensor, inp.grad))
        for m in range(M):
            g = self._take_grad(FrameKey(TRAIN, n, BACKWARD, self.rank, 0, m))
            extra = penalty.pop((0, m), None)
            embedded[m].backward(g if extra is None else g + extra)
        scale_grads(self.group.parameters(), 1.0 / (cfg.P * M))  # mean over origins
        step_optimizers(self.group_opts, cfg, n)
        scale_grads(self.replica.parameters(), 1.0 / M)
        step_optimizers(self.replica_opts, cfg, n)
        self.maps.count_step(self.replica)  # a learned U: one local step per round, which
        if self.maps.ends_round(n):  # the barrier after this step averages
            self.maps.end_round(self.replica, n)
        self.step = n + 1
        seconds = time.perf_counter() - t0
        return WorkerStep(n, mean_loss(losses), seconds - self._wait, self._wait, seconds)

    # ----------------------------------------------------------------- eval
    @torch.no_grad()
    def evaluate(self) -> float:
        """This origin's path-specific validation loss (one term of paper Eq. 8)."""
        n, K = self.step, self.cfg.K
        micro = [mb for b in range(self.cfg.eval_batches) for mb in self._micro("val", b)]
        entries = [
            self.maps.enter(self.replica.embed(x), grad=False, ids=x, worker=self.rank)
            for x, _ in micro
        ]
        for j, entry in enumerate(entries):
            self._send(FrameKey(EVAL, n, FORWARD, self.rank, 0, j), entry.slot0)
        for t, s in self.ticks:
            for j, entry in enumerate(entries):
                h = self._take(FrameKey(EVAL, n, FORWARD, s, t, j))
                out = self.maps.apply(self.group, h, t, self.rank, s, entry, self.replica.embed)
                self._send(FrameKey(EVAL, n, FORWARD, s, t + 1, j), out)
        losses = []
        for j, ((_, y), entry) in enumerate(zip(micro, entries)):
            h = self._take(FrameKey(EVAL, n, FORWARD, self.rank, K, j))
            losses.append(self.replica.loss(self.maps.head(h, entry), y))
        return mean_loss(losses)

    # ------------------------------------------------------------- recovery
    def set_run_id(self, run_id: str) -> None:
        """Address a new ring incarnation: frames of any earlier one are refused."""
        self.run_id = run_id
        self.rules = FrameRules(self.cfg, self.rank, run_id, lambda: self.step, self.bounds)

    def abandon_step(self) -> None:
        """Forget a step in flight: accumulated gradients and frames kept for itself."""
        for module in (self.group, self.replica):
            for p in module.parameters():
                p.grad = None
        if self.replica.subspace is not None:
            self.replica.subspace.forget()
        self._local.clear()
        if self._codec_stage is not None:
            self._codec_stage.forget()

    def initial_state(self) -> dict:
        """The state before step 0, rebuilt from the seed (restore target of round 0)."""
        fresh = RingExecutor(self.cfg, self.rank, self.site, self.run_id, self.peer_timeout)
        return fresh.state_dict()

    # ----------------------------------------------------------- checkpoint
    def group_state(self) -> dict:
        """Its block group and the group's optimizers: what an audit restores
        (:class:`~mobius_fed.engine.audit_replay.GroupReplay`)."""
        return {
            "group": self.group.state_dict(),
            "group_opts": [o.state_dict() for o in self.group_opts],
        }

    def state_dict(self) -> dict:
        return {
            "rank": self.rank,
            "step": self.step,
            "config": self.cfg.model_dump(mode="json"),
            "group": self.group.state_dict(),
            "replica": self.replica.state_dict(),
            "group_opts": [o.state_dict() for o in self.group_opts],
            "replica_opts": [o.state_dict() for o in self.replica_opts],
            "cursor": {"seed": self.cfg.seed, "next_step": self.step},
            **subspace_state([self.replica]),
            **({"er_sync": self.er.state_dict()} if self.cfg.sync.on_sites else {}),
        }

    def load_state_dict(self, state: dict) -> None:
        if state["rank"] != self.rank:
            raise ValueError(f"checkpoint is for worker {state['rank']}, not {self.rank}")
        saved = TrainConfig.model_validate(state["config"])
        why = self.cfg.difference(saved)
        if why:
            raise ValueError(f"worker checkpoint cannot continue this run: {why}")
        self.step = state["step"]
        self.group.load_state_dict(state["group"])
        self.replica.load_state_dict(state["replica"])
        for opt, sd in zip(
            self.group_opts + self.replica_opts, state["group_opts"] + state["replica_opts"]
        ):
            opt.load_state_dict(sd)
        load_subspace_state([self.replica], state)
        self.er.load_state_dict(state.get("er_sync", {}))
