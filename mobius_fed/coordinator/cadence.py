"""Which rounds the coordinator checkpoints: the plan's (``checkpoint_every`` and the last
round) and, while a standby site waits, at least every ``standby_checkpoint_every`` steps,
each with every worker's copy, so that a handover redoes at most that many steps
(docs/recovery.md "Handover to a standby"). A standby has no state of its own: it can only
take the group from the coordinator's copy of the replaced rank's checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mobius_fed.strategies import RoundPlan

# Standby-only checkpoints kept when checkpoint_every is 0 (the newest, and one before it
# in case the newest is being written when a handover comes).
KEEP_STANDBY = 2


@dataclass
class CheckpointCadence:
    """The checkpoint rounds of a run; each round's answer is fixed when its train order
    goes out (:meth:`order`), so the manifest written after it (:meth:`ordered`) agrees
    even when a standby registers or leaves in between."""

    plan: RoundPlan
    standby_rounds: int  # rounds between checkpoints while a standby waits (0: off)
    copies: bool  # workers send the coordinator a copy (state_copy = coordinator)
    standby_waiting: Callable[[], bool] = lambda: False
    copy_round: int | None = None  # the newest manifest's round, when it holds every copy
    no_copy: str | None = None  # why the newest manifest lacks a copy (None: it has them)
    _orders: dict[int, bool] = field(default_factory=dict)

    @classmethod
    def of(cls, plan: RoundPlan, standby_rounds: int, copies: bool) -> CheckpointCadence:
        # the standby's cadence only where the plan's alone is sparser
        every = plan.checkpoint_every
        sparser = standby_rounds and (every == 0 or every > standby_rounds)
        return cls(plan, standby_rounds if sparser else 0, copies)

    @property
    def rounds_with_standby(self) -> int:
        """Rounds between checkpoints while a standby waits (0: only the last round)."""
        return self.standby_rounds or self.plan.checkpoint_every

    def keep_checkpoints(self, keep: int) -> int:
        """Complete manifests to keep: ``keep``, or with ``checkpoint_every`` 0 (the last
        round only) and all kept, the newest :data:`KEEP_STANDBY` (every earlier one is a
        standby's, superseded)."""
        only_standby = self.standby_rounds and not self.plan.checkpoint_every
        return keep or (KEEP_STANDBY if only_standby else 0)

    def order(self, rnd: int) -> bool:
        """Whether round ``rnd`` checkpoints: asked once, as its train order goes out."""
        yes = self.plan.checkpoints(rnd) or bool(
            self.standby_rounds and rnd % self.standby_rounds == 0 and self.standby_waiting()
        )
        self._orders = {r: v for r, v in self._orders.items() if r < rnd and r >= rnd - 4}
        self._orders[rnd] = yes
        return yes

    def ordered(self, rnd: int) -> bool:
        """Whether round ``rnd``'s train order asked for a checkpoint (the plan's answer
        for a round whose order this coordinator did not send)."""
        return self._orders.get(rnd, self.plan.checkpoints(rnd))

    def written(self, rnd: int, workers: dict[str, dict[str, Any]]) -> None:
        """Round ``rnd``'s manifest was written with these worker entries."""
        missing = sorted(int(r) for r, e in workers.items() if not e.get("copy"))
        self.copy_round = None if missing else rnd
        self.no_copy = None
        if missing:
            self.no_copy = (
                f"round {rnd}'s checkpoint holds no copy of worker-{missing[0]}'s state "
                "(state_copy off, SecAgg, a private home layer, or over the copy limit: see "
                "its log); a handover restarts from an earlier copy or round 0"
            )

    def status(self, waiting: list[str]) -> dict[str, Any]:
        """Status's ``standby`` block (:class:`~mobius_fed.coordinator.status_model.
        StandbyStatusModel`)."""
        sync = self.plan.sync_every
        every = self.rounds_with_standby * sync or None
        note, rnd = None, self.copy_round
        if not self.copies:
            note = "state_copy is off: a standby has no copy to take a group from"
        elif every is None:
            note = "standby_checkpoint_every and checkpoint_every are 0: no copy before the end"
        elif self.no_copy:
            note = self.no_copy
        return {
            "waiting": waiting,
            "checkpoint_every": every,
            "redo_steps": None if note else every,
            "copy_step": None if rnd is None else self.plan.steps_of(rnd)[1],
            "note": note,
        }
