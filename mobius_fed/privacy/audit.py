"""The privacy audit: train while a curious worker keeps what it sees, then attack.

Training runs on the reference engine, which hands on exactly the tensors a ring
exchanges. Two observers record what two workers legitimately receive:

* the worker before stream ``victim``'s home (the producer of slot K) keeps the final
  hidden states it sends and the gradients that come back, and runs the target attack at
  every step with its own head replica as it is at that step;
* the worker that receives ``victim``'s first remote hop keeps the hidden states of the
  victim's held-out text (the final evaluation), and inverts them with a model trained on
  its own text through the parts of the model it holds.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch
from torch import Tensor, nn

from mobius_fed import schedule
from mobius_fed.config import TrainConfig
from mobius_fed.data import SiteData
from mobius_fed.defences.site_layers import build_site_replica
from mobius_fed.defences.stages import NoiseKeys, first_remote_slot, gaussian
from mobius_fed.engine.reference import ReferenceEngine
from mobius_fed.hop import HopContext
from mobius_fed.model.training import make_optimizers
from mobius_fed.privacy.attacks import (
    cluster_targets,
    group_purity,
    recover_targets,
    recover_targets_linear,
    recover_targets_matching,
    recover_targets_through,
    train_inverter,
)
from mobius_fed.privacy.input_attacks import TOP, recovery
from mobius_fed.privacy.observer import Observer


@dataclass
class TargetAttack:
    """Target recovery at the last hop of stream ``victim`` by worker ``attacker``."""

    victim: int
    attacker: int
    tokens: int = 0
    correct: int = 0
    model_correct: int = 0  # the head's own prediction from h, without the gradient
    first_step: float | None = None  # accuracy at step 0
    last_step: float | None = None  # accuracy at the last step
    # With a home layer: attackers that adapt to it (None when it is off / not applicable).
    home_layer: str = "off"
    linear_correct: int | None = None  # models the unknown layer as a fitted linear map
    surrogate_correct: int | None = None  # exact matching through a layer it can know
    surrogate: str | None = None  # which layer: the victim's public-seed one, or its own
    matching_correct: int | None = None  # soft-label gradient matching through that layer
    cluster_correct: int | None = None  # groups gradients by direction, labels by its model
    cluster_pure: int | None = None  # tokens grouped with others of their own target
    cluster_pure_chance: int | None = None  # the same groups, targets shuffled

    def _share(self, count: int | None) -> float | None:
        """``count`` as a share of the tokens attacked (None for an attack not run)."""
        return None if count is None else count / max(1, self.tokens)

    @property
    def accuracy(self) -> float:
        return self.correct / max(1, self.tokens)

    @property
    def model_accuracy(self) -> float:
        return self.model_correct / max(1, self.tokens)

    @property
    def linear_accuracy(self) -> float | None:
        return self._share(self.linear_correct)

    @property
    def surrogate_accuracy(self) -> float | None:
        return self._share(self.surrogate_correct)

    @property
    def matching_accuracy(self) -> float | None:
        return self._share(self.matching_correct)

    @property
    def cluster_accuracy(self) -> float | None:
        return self._share(self.cluster_correct)

    @property
    def cluster_purity(self) -> float | None:
        return self._share(self.cluster_pure)

    @property
    def cluster_purity_chance(self) -> float | None:
        return self._share(self.cluster_pure_chance)

    @property
    def best_accuracy(self) -> float:
        """The best of the attacks run (what the table reports as target recovery)."""
        found = [
            self.accuracy,
            self.linear_accuracy,
            self.surrogate_accuracy,
            self.matching_accuracy,
            self.cluster_accuracy,
        ]
        return max(a for a in found if a is not None)


@dataclass
class InputAttack:
    """Inversion of stream ``victim``'s first remote hop (slot ``slot``) by ``attacker``."""

    victim: int
    attacker: int
    slot: int
    tokens: int = 0
    exact: float = 0.0
    top5: float = 0.0
    frequency_baseline: float = 0.0  # guessing the attacker's most frequent token


@dataclass
class AuditReport:
    order: str
    preset: str
    steps: int
    privacy: dict
    eval_loss: float
    chance: float  # 1 / vocabulary
    target: TargetAttack
    inversion: InputAttack | None
    seconds: float = 0.0
    epsilon: float | None = None  # at the configured sample_rate
    epsilon_sampled: float | None = None  # at q = one batch's tokens / the site's train tokens
    data_sample_rate: float = 1.0

    def as_dict(self) -> dict:
        out = asdict(self)
        for name in DERIVED:
            out["target"][name] = getattr(self.target, name)
        return out


# TargetAttack's properties, in order: as_dict writes them, sweep.report_from_dict drops them.
DERIVED = tuple(name for name, v in vars(TargetAttack).items() if isinstance(v, property))


def check_victim(cfg: TrainConfig, victim: int) -> None:
    """Refuse an audit with nothing to observe (P < 2) or a victim that is no origin."""
    if cfg.P < 2:
        raise ValueError("the audit needs P >= 2 workers: with one, nothing leaves a site")
    if not 0 <= victim < cfg.P:
        raise ValueError(f"victim {victim} is not an origin of P={cfg.P} workers")


def refuse_bottleneck(cfg: TrainConfig, audit: str) -> None:
    """The leakage audit rebuilds every hop as h = U·c (a shared U) and trains its inverter
    and its rows of E through U: the learned bottleneck (subspace modes ``bottleneck``,
    ``bottleneck-home``) has no U. The patient audit attacks it (the first remote hop's
    code and the receiver's decoder output, :func:`receiver_rebuild`)."""
    if cfg.subspace.bottleneck:
        raise ValueError(
            f"{audit}: subspace mode {cfg.subspace.mode!r} is not audited here: its attacks "
            "rebuild every hop with a shared U, and a received code is rebuilt by the "
            "receiver's own learned decoder; the patient audit attacks the bottleneck "
            "(mobius-fed audit --patient, benchmarks/privacy_audit.py --patient)"
        )


def refuse_subspace(cfg: TrainConfig, audit: str) -> None:
    """The one-victim audit attacks full-width hidden states with the head and an inverter
    of its own states: with the subspace on a hop carries k-wide coordinates (or a learned
    bottleneck's code), which it does not rebuild."""
    sub = cfg.subspace
    if sub.on:
        raise ValueError(
            f"{audit}: with subspace mode {sub.mode!r} (rank {sub.rank}) a hop carries k-wide "
            "coordinates, and this audit attacks full-width hidden states; run the patient "
            "audit (mobius-fed audit --patient), which attacks each site's first remote hop "
            "as its receiver rebuilds it (and a bottleneck's code itself)"
        )


def receiver_rebuild(engine: ReferenceEngine) -> Callable[[Tensor, HopContext], Tensor] | None:
    """In a bottleneck mode, what the worker receiving a forward hop computes from the code c
    it receives: dec_r(c), with its own group's decoder as it is when the code arrives (an
    :class:`Observer` evaluates it then: the decoder of that step, before that step's
    update). A remote hop's receiver adds no b unless it is the stream's origin, so at a
    first remote hop this is exactly what its group is applied to. None in other modes (a
    hop is the state itself, or U·c with the public U)."""
    if not engine.cfg.subspace.bottleneck:
        return None
    maps = engine.maps

    def rebuild(c: Tensor, ctx: HopContext) -> Tensor:
        return maps.basis_of(ctx.consumer).expand(c)

    return rebuild


def own_text(cfg: TrainConfig, site: SiteData, batches: int) -> Tensor:
    """An attacker's own training text (its public text): [S, T] token ids."""
    return torch.cat(
        [
            site.batch("train", seed=cfg.seed + 7919, step=k, batch_size=cfg.batch_size)[0]
            for k in range(batches)
        ]
    )


def last_hop_attacker(cfg: TrainConfig, s: int) -> int:
    """The worker that produces stream s's final hidden state (slot K)."""
    return schedule.path(cfg.order, s, cfg.P, cfg.loops)[-1]


def first_hop_attacker(cfg: TrainConfig, s: int) -> tuple[int, int] | None:
    """(slot, receiving worker) of stream s's first remote forward hop."""
    slot = first_remote_slot(cfg, s)
    if slot is None:
        return None
    path = schedule.path(cfg.order, s, cfg.P, cfg.loops)
    return slot, schedule.consumer(path, s, slot)


def held_out(
    engine: ReferenceEngine, obs: Observer, victim: int, slot: int
) -> tuple[Tensor, Tensor]:
    """(what ``obs`` received at ``slot`` of stream ``victim`` in the final evaluation,
    the victim's held-out tokens it carries)."""
    micro = [mb for b in range(engine.cfg.eval_batches) for mb in engine._micro("val", victim, b)]
    got = [obs.received[("eval", engine.step, victim, slot, j)] for j in range(len(micro))]
    return torch.cat(got), torch.cat([x for x, _ in micro])


class Audit:
    """One audited training run on the reference engine."""

    def __init__(
        self,
        cfg: TrainConfig,
        sites: Sequence[SiteData],
        *,
        victim: int = 0,
        inverter_steps: int = 400,
        attacker_batches: int = 64,
        log: Callable[[str], None] | None = None,
    ) -> None:
        check_victim(cfg, victim)
        refuse_subspace(cfg, "the one-victim audit")
        self.cfg, self.sites, self.victim = cfg, list(sites), victim
        self.inverter_steps, self.attacker_batches = inverter_steps, attacker_batches
        self.log = log or (lambda _msg: None)
        self.engine = ReferenceEngine(cfg, self.sites)
        ensure_home_layers(self.engine)
        self.keys = NoiseKeys(cfg, "reference", None)
        attacker = last_hop_attacker(cfg, victim)
        self.target = TargetAttack(victim, attacker, home_layer=cfg.privacy.home_layer)
        self._surrogate: nn.Module | None = None
        if cfg.privacy.home_layer != "off":
            self.target.linear_correct = self.target.cluster_correct = 0
            self.target.cluster_pure = self.target.cluster_pure_chance = 0
            self.target.matching_correct = 0
            if cfg.privacy.noise_key_dir is None:  # keyed by the public seed: recomputable
                self._surrogate = build_site_replica(cfg, victim).home
                self.target.surrogate = "the victim's initial layer (public seed)"
            else:
                self.target.surrogate = "its own home layer"
        if cfg.privacy.home_layer == "mlp":  # token-wise: exact per-token matching too
            self.target.surrogate_correct = 0
        self._step_hits: dict[int, list[int]] = {}
        self.last_hop = Observer(
            rank=attacker,
            backward_slots={victim: cfg.K},
            phases=("train",),
            on_backward=self._attack_targets,
            sent_forward={victim: cfg.K},
        )
        self.last_hop.attach(self.engine.hops)
        first = first_hop_attacker(cfg, victim)
        self.first_hop: Observer | None = None
        if first is not None:
            slot, receiver = first
            self.inversion = InputAttack(victim, receiver, slot)
            self.first_hop = Observer(rank=receiver, forward_slots={victim: slot}, phases=("eval",))
            self.first_hop.attach(self.engine.hops)

    # ---------------------------------------------------------------- target
    def _attack_targets(self, ctx: HopContext, g: Tensor) -> None:
        """Runs inside the home's backward, when the gradient reaches the attacker."""
        pc, obs = self.cfg.privacy, self.last_hop
        h = obs.sent.pop(("train", ctx.step, ctx.s, ctx.slot, ctx.m))
        head = self.engine.replicas[self.target.attacker]
        sigma, clip = pc.label_noise, pc.label_clip
        if sigma > 0 and pc.noise_key_dir is None:
            # Public-seed noise: the attacker regenerates it and subtracts it.
            n = g.shape[:-1].numel()
            g = g - (sigma * clip / n) * gaussian(g, self.keys.generator(ctx))
            sigma = 0.0
        guess, model = recover_targets(
            h, g, head, sigma=sigma, clip=clip if pc.label_noise > 0 else None
        )
        y = self.engine._micro("train", ctx.s, ctx.step)[ctx.m][1].reshape(-1)
        t = self.target
        if t.linear_correct is not None:
            model = head.logits(h).argmax(-1).reshape(-1)  # what it predicts with its own layer
            t.linear_correct += int((recover_targets_linear(h, g, head, guess) == y).sum())
            votes, group = cluster_targets(g, model, seed=ctx.step)
            t.cluster_correct = (t.cluster_correct or 0) + int((votes == y).sum())
            t.cluster_pure = (t.cluster_pure or 0) + group_purity(group, y)
            t.cluster_pure_chance = (t.cluster_pure_chance or 0) + group_purity(
                group, y, shuffle_seed=ctx.step
            )
        if t.surrogate_correct is not None:
            home = self._surrogate if self._surrogate is not None else head.home
            assert home is not None
            t.surrogate_correct += int((recover_targets_through(h, g, head, home) == y).sum())
        if t.matching_correct is not None:
            own = head.home
            if self._surrogate is not None:  # its head with the victim's public-seed layer
                head.home = self._surrogate
            try:
                t.matching_correct += int((recover_targets_matching(h, g, head) == y).sum())
            finally:
                head.home = own
        hits = int((guess == y).sum())
        t.tokens += y.numel()
        t.correct += hits
        t.model_correct += int((model == y).sum())
        tally = self._step_hits.setdefault(ctx.step, [0, 0])
        tally[0] += hits
        tally[1] += y.numel()

    # ----------------------------------------------------------------- input
    @torch.no_grad()
    def _attacker_features(self, slot: int, attacker: int) -> tuple[Tensor, Tensor]:
        """(hidden states, tokens) of the attacker's own text through what it holds."""
        eng = self.engine
        x = own_text(self.cfg, self.sites[attacker], self.attacker_batches)
        e = eng.replicas[attacker].embed(x)
        if slot == 0:
            return e, x
        h = e
        for t in range(slot):  # its own group stands in for the origin's (unknown) groups
            h = eng.groups[attacker](h, t)
        return torch.cat([h, e]), torch.cat([x, x])

    def _attack_inputs(self) -> None:
        if self.first_hop is None:
            return
        cfg, inv = self.cfg, self.inversion
        received, tokens = held_out(self.engine, self.first_hop, inv.victim, inv.slot)
        feats, own = self._attacker_features(inv.slot, inv.attacker)
        vocab = cfg.model().vocab_size
        model = train_inverter(
            feats,
            own,
            vocab,
            steps=self.inverter_steps,
            noise=cfg.privacy.input_noise,
            seed=cfg.seed,
        )
        with torch.no_grad():
            r = recovery(model(received).topk(TOP, -1).indices.reshape(-1, TOP), tokens)
        inv.exact, inv.top5, inv.tokens = r.exact, r.top5, r.tokens
        common = torch.bincount(own.flatten(), minlength=vocab).argmax()
        inv.frequency_baseline = (tokens == common).float().mean().item()

    # ------------------------------------------------------------------- run
    def run(self) -> AuditReport:
        from mobius_fed.defences.accounting import epsilon_spent

        cfg, t0 = self.cfg, time.perf_counter()
        for n in range(cfg.steps):
            r = self.engine.train_step()
            if cfg.eval_every and (n + 1) % cfg.eval_every == 0 and n + 1 < cfg.steps:
                self.log(f"step {r.step}: loss {r.loss:.4f}")
        ev = self.engine.evaluate()
        self.log(f"eval loss (Eq. 8) {ev.loss:.4f}")
        self._attack_inputs()
        hits = self._step_hits
        if hits:
            self.target.first_step = hits[min(hits)][0] / hits[min(hits)][1]
            self.target.last_step = hits[max(hits)][0] / hits[max(hits)][1]
        q = min(
            1.0, cfg.batch_size * cfg.model().seq_len / self.sites[self.victim].num_tokens("train")
        )
        eps = eps_q = None
        if cfg.privacy.label_noise > 0:
            eps = epsilon_spent(cfg.privacy, cfg.steps)
            eps_q = epsilon_spent(cfg.privacy.model_copy(update={"sample_rate": q}), cfg.steps)
        return AuditReport(
            order=cfg.order,
            preset=cfg.preset,
            steps=cfg.steps,
            privacy=cfg.privacy.model_dump(mode="json"),
            eval_loss=ev.loss,
            chance=1.0 / cfg.model().vocab_size,
            target=self.target,
            inversion=self.inversion if self.first_hop is not None else None,
            seconds=time.perf_counter() - t0,
            epsilon=eps,
            epsilon_sampled=eps_q,
            data_sample_rate=q,
        )


def ensure_home_layers(engine: ReferenceEngine) -> None:
    """Give a reference engine that has not stepped yet, and whose replicas lack the home
    layer of its configuration, the site replicas (each origin's keyed layer) and fresh
    replica optimizers; a no-op for an engine that built them with
    :func:`build_site_replica` (the reference engine does)."""
    cfg = engine.cfg
    pc = cfg.privacy
    if all(
        r.home_layer == pc.home_layer and r.input_kind == pc.home_input for r in engine.replicas
    ):
        return  # built by build_site_replica already (or no layer asked for)
    if engine.step != 0:
        raise RuntimeError("the home layer can only be added before the first step")
    engine.replicas = [build_site_replica(cfg, s).to(engine.device) for s in range(cfg.P)]
    engine.replica_opts = [make_optimizers(r, cfg, blocks=False) for r in engine.replicas]
