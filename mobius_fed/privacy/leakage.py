"""The leakage audit: a site's input tokens at every hop, and its E/R update as the
coordinator receives it.

Training runs on the reference engine (it hands on exactly the tensors a ring
exchanges). Observers keep what each worker on stream ``victim``'s path receives at its
remote forward hops, for the first training batch (step 0) and the held-out text at the
end; :mod:`mobius_fed.privacy.input_attacks` and the trained inverter of
:mod:`mobius_fed.privacy.attacks` run on each. At every barrier the victim's E/R update
Δ = θ_victim − θ̄ (what the coordinator receives, less the average it sent) goes to
:mod:`mobius_fed.privacy.er_attacks`, against the site's true bag of tokens that round.
With ``privacy.er_secagg`` the coordinator holds only the sum: the attack scores the
quantised mean update of all sites, against the victim's bag and the union of all bags.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import Tensor

from mobius_fed import schedule
from mobius_fed.config import ConfigError, TrainConfig
from mobius_fed.data import SiteData
from mobius_fed.defences.secagg import Quantiser
from mobius_fed.engine.reference import ReferenceEngine
from mobius_fed.model.training import average_parameters
from mobius_fed.privacy import er_attacks, input_attacks
from mobius_fed.privacy.attacks import train_inverter
from mobius_fed.privacy.audit import (
    check_victim,
    ensure_home_layers,
    held_out,
    own_text,
    refuse_bottleneck,
)
from mobius_fed.privacy.input_attacks import TOP, recovery
from mobius_fed.privacy.leakage_report import HopRow, LeakageReport, UpdateRow
from mobius_fed.privacy.observer import Observer


def remote_hops(cfg: TrainConfig, s: int) -> list[tuple[int, int]]:
    """(slot, receiving worker) of every forward hop of stream s that another worker
    receives (the final hop home is the origin's own)."""
    path = schedule.path(cfg.order, s, cfg.P, cfg.loops)
    return [
        (slot, path[slot])
        for slot in range(cfg.K)
        if schedule.producer(path, s, slot) != path[slot] and path[slot] != s
    ]


class LeakageAudit:
    """One audited training run: input attacks at every hop, the E/R-update attack."""

    def __init__(
        self,
        cfg: TrainConfig,
        sites: Sequence[SiteData],
        *,
        victim: int = 0,
        inverter_steps: int = 400,
        attacker_batches: int = 64,
        known: Sequence[float] = (0.01, 0.05),
        first_hop_only: bool = False,
        log: Callable[[str], None] | None = None,
    ) -> None:
        check_victim(cfg, victim)
        refuse_bottleneck(cfg, "the leakage audit")
        if cfg.privacy.er_noise > 0:
            raise ConfigError("the leakage audit measures plain FedAvg: set privacy.er_noise 0")
        if cfg.sync_every < 1:
            raise ConfigError("sync_every = 0 never sends an E/R update: nothing to attack")
        self.cfg, self.sites, self.victim = cfg, list(sites), victim
        self.inverter_steps, self.attacker_batches = inverter_steps, attacker_batches
        self.known = tuple(known)
        self.log = log or (lambda _msg: None)
        self.engine = ReferenceEngine(cfg, self.sites)
        ensure_home_layers(self.engine)
        self.engine.average_replicas = False  # averaged here, after the update is read
        self.hops = remote_hops(cfg, victim)[: 1 if first_hop_only else None]
        self.observers = []
        for slot, worker in self.hops:
            obs = Observer(rank=worker, forward_slots={victim: slot}, train_steps=frozenset({0}))
            obs.attach(self.engine.hops)
            self.observers.append(obs)
        self.start_wte = {
            w: self.engine.replicas[w].wte.weight.detach().clone() for _, w in self.hops
        }
        self.updates: list[UpdateRow] = []
        self.secagg = Quantiser.of(cfg) if cfg.privacy.er_secagg else None
        self._previous: dict[str, Tensor] = {}

    # ------------------------------------------------------------ E/R update
    def _shared_rows(self, rank: int | None = None) -> dict[str, Tensor]:
        r = self.engine.replicas[self.victim if rank is None else rank]
        if r.lm_head is None:
            return {"E (tied: inputs and targets)": r.wte.weight.detach().clone()}
        return {
            "E (inputs)": r.wte.weight.detach().clone(),
            "R (targets)": r.lm_head.weight.detach().clone(),
        }

    def _bags(self, steps: range, site: int | None = None) -> dict[str, Tensor]:
        site = self.victim if site is None else site
        micro = [mb for n in steps for mb in self.engine._micro("train", site, n)]
        x = torch.cat([x.reshape(-1) for x, _ in micro])
        y = torch.cat([y.reshape(-1) for _, y in micro])
        return {
            "E (tied: inputs and targets)": torch.cat([x, y]),
            "E (inputs)": x,
            "R (targets)": y,
        }

    def _observed(
        self, before: dict[str, Tensor], steps: range
    ) -> list[tuple[str, str, Tensor, Tensor]]:
        """(rows label, rows, update, bag): what the coordinator holds, against whose bag.
        Plain FedAvg: the victim's own update. SecAgg: only the quantised mean of all the
        sites' updates, scored against the victim's bag, another site's and the union."""
        after, bags = self._shared_rows(), self._bags(steps)
        if self.secagg is None:
            return [(n, n, after[n] - before[n], bags[n]) for n in after]
        q, out = self.secagg, []
        each = [self._shared_rows(s) for s in range(self.cfg.P)]
        union = [self._bags(steps, s) for s in range(self.cfg.P)]
        for name, b in before.items():
            total = sum(
                (q.quantise((rows[name] - b).double().reshape(-1).numpy()) for rows in each),
                np.zeros(b.numel(), np.uint64),
            )
            mean = torch.from_numpy(q.mean(total)).float().reshape(b.shape)
            other = (self.victim + 1) % self.cfg.P  # the sum does not say whose a token is
            out.append((f"{name}, sum (SecAgg) vs victim's bag", name, mean, bags[name]))
            out.append(
                (f"{name}, sum (SecAgg) vs site {other}'s bag", name, mean, union[other][name])
            )
            every = torch.cat([u[name] for u in union])
            out.append((f"{name}, sum (SecAgg) vs union of bags", name, mean, every))
        return out

    def _attack_update(self, before: dict[str, Tensor], steps: range) -> None:
        cfg, rnd = self.cfg, steps.stop // self.cfg.sync_every
        decay = None
        if cfg.sync_every == 1 and steps.start >= 1:
            n = steps.start
            decay = er_attacks.adam_decay(n + 1, cfg.lr_multiplier(n), cfg.lr_multiplier(n - 1))
        seen: dict[str, Tensor] = {}
        for label, name, delta, bag in self._observed(before, steps):
            for kind in er_attacks.SCORES:
                if kind.startswith("residual") and (decay is None or name not in self._previous):
                    continue
                scores = er_attacks.row_scores(delta, kind, self._previous.get(name), decay or 0.0)
                p = er_attacks.presence(scores, bag, kind)
                figures = (p.topk_precision, p.precision, p.recall, p.base_rate, p.bag)
                self.updates.append(UpdateRow(rnd, label, kind, *figures))
            seen[name] = delta
        self._previous.update(seen)

    # ----------------------------------------------------------------- train
    def _train(self) -> float:
        cfg, eng = self.cfg, self.engine
        before, first = self._shared_rows(), 0
        for n in range(cfg.steps):
            eng.train_step()
            if eng.step % cfg.sync_every == 0 or eng.step == cfg.steps:
                self._attack_update(before, range(first, eng.step))
                average_parameters(eng.replicas)
                before, first = self._shared_rows(), eng.step
            if cfg.eval_every and (n + 1) % cfg.eval_every == 0:
                self.log(f"step {n}: training")
        ev = eng.evaluate()
        self.log(f"eval loss (Eq. 8) {ev.loss:.4f}")
        return ev.loss

    # ----------------------------------------------------------------- input
    @torch.no_grad()
    def _own_stream(self, slot: int, attacker: int) -> tuple[Tensor, Tensor]:
        """(hidden states, tokens) of the attacker's own text through what it holds: E and
        its own group, applied ``slot`` times as a stand-in for the groups it lacks (the
        first time as the stream's origin, then as a remote group), through the run's
        stream maps, and rebuilt as a receiver rebuilds a hop (:meth:`_lift`)."""
        eng, x = self.engine, own_text(self.cfg, self.sites[attacker], self.attacker_batches)
        entry = eng.maps.enter(eng.replicas[attacker].embed(x), grad=False)
        h = entry.slot0
        for t in range(slot):  # only the first application adds the origin's own b
            h = eng.maps.apply(
                eng.groups[attacker], h, t, attacker, attacker, entry if t == 0 else None
            )
        return torch.cat([self._lift(h), self._lift(entry.slot0)]), torch.cat([x, x])

    def _lift(self, c: Tensor) -> Tensor:
        """A received hop as the receiving worker rebuilds it: the hidden state itself, or
        with the subspace on h = U·c (a remote worker adds no b)."""
        basis = self.engine.maps.basis
        return c if basis is None else basis.expand(c)

    def _rows(self, wte: Tensor) -> Tensor:
        """The rows of E as the attacker compares them with a rebuilt hop: E itself, or with
        the subspace on their projection U·Uᵀ·E (a hop holds nothing outside span(U))."""
        basis = self.engine.maps.basis
        return wte if basis is None else basis.expand(basis.coords(wte))

    def _received(self, obs: Observer, slot: int, stage: str) -> tuple[Tensor, Tensor]:
        if stage != "step 0":
            h, x = held_out(self.engine, obs, self.victim, slot)
            return self._lift(h), x
        micro = self.engine._micro("train", self.victim, 0)
        got = [obs.received[("train", 0, self.victim, slot, j)] for j in range(len(micro))]
        return self._lift(torch.cat(got)), torch.cat([x for x, _ in micro])

    def _attack_hop(
        self, slot: int, attacker: int, stage: str, h: Tensor, x: Tensor
    ) -> list[HopRow]:
        cfg, vocab = self.cfg, self.cfg.model().vocab_size
        trained = self.engine.replicas[attacker].wte.weight.detach()
        wte = self.start_wte[attacker] if stage == "step 0" else trained
        public = own_text(cfg, self.sites[attacker], self.attacker_batches)
        floor = input_attacks.frequency_floor(public, x.numel(), vocab)
        nearest = input_attacks.nearest_row(h, self._rows(wte))
        clusters = input_attacks.cluster_frequency(h, public, vocab, seed=cfg.seed)
        found: list[tuple[str, Tensor, Tensor]] = [
            ("floor: most frequent tokens", floor, x),
            ("nearest row of E", nearest, x),
            ("clusters + public frequencies", clusters, x),
        ]
        for f in self.known:
            mask = input_attacks.known_mask(x.numel(), f, cfg.seed)
            guesses, rest = input_attacks.known_plaintext(h, x, wte, mask)
            found.append((f"known plaintext {100 * f:g} % + linear map", guesses, rest))
            guesses, rest = input_attacks.known_codebook(h, x, mask)
            found.append((f"known plaintext {100 * f:g} % as a codebook", guesses, rest))
        if stage == "trained":
            feats, own = self._own_stream(slot, attacker)
            noise = cfg.privacy.input_noise if slot == self.hops[0][0] else 0.0  # first hop
            model = train_inverter(
                feats, own, vocab, steps=self.inverter_steps, noise=noise, seed=cfg.seed
            )
            with torch.no_grad():
                guesses = model(h).topk(TOP, -1).indices.reshape(-1, TOP)
            found.append(("inverter trained on its own text", guesses, x))
        rows = []
        for name, guesses, truth in found:
            r = recovery(guesses, truth)
            rows.append(HopRow(stage, slot, attacker, name, r.exact, r.top5, r.tokens))
        return rows

    # ------------------------------------------------------------------- run
    def run(self) -> LeakageReport:
        cfg, t0 = self.cfg, time.perf_counter()
        loss = self._train()
        report = LeakageReport(
            preset=cfg.preset,
            order=cfg.order,
            optimizer=cfg.optimizer,
            tied=cfg.tied,
            steps=cfg.steps,
            workers=cfg.P,
            victim=self.victim,
            vocab=cfg.model().vocab_size,
            eval_loss=loss,
            warmup_steps=cfg.warmup_steps,
            updates=self.updates,
        )
        for stage in ("step 0", "trained"):
            for (slot, attacker), obs in zip(self.hops, self.observers):
                self.log(f"attacking slot {slot} ({stage}) as worker {attacker}")
                h, x = self._received(obs, slot, stage)
                report.hops.extend(self._attack_hop(slot, attacker, stage, h, x))
        report.seconds = time.perf_counter() - t0
        return report
