"""Poisoning: what one lying site with a valid certificate does to the honest origins, with
the bounds off and on (docs/security.md, "Bounds on what a site sends").

A coordinator and P workers as processes on loopback over mTLS (``mobius-fed up``'s
LocalFederation); the last worker runs ``tests/evil_worker.py`` and, from step ``--from``
on, (a) scales the gradients it sends back ×10, (b) ×1000, (c) flips their sign, (d) sends
hidden states ×1e6, (e) scales its E/R update at every barrier ×1000, (f) reports its
losses ×0.1. Per attack and setting, against a clean run of the same seed and steps:

- Δ Eq. 8: the honest origins' mean held-out loss at the last evaluation the run reached,
  minus the clean run's at the same step (and the largest |Δ| over all evaluations);
- detected: the first step at which the liar was reported suspect, counted from the
  attack's first step (by a receiving worker for refused frames; in the coordinator's
  status for clipped E/R updates), or "no";
- the run's end: done, or failed (a refused frame fails its step; a coordinated run rolls
  back and retries, so a persistent liar fails the run after ``--max-incidents``);
- evicted: the step at which the liar's rank went to a standby, or "no".

Settings (``--bounds``): ``off``; ``on`` (the defaults, no standby); ``evict`` (the
defaults with ``bounds.suspect_after = 1``, a standby site waiting and the coordinator's
``--evict-suspects``: a liar caught once loses its rank, docs/security.md "Evicting a
suspect"); ``audit`` (``evict`` plus audits by recomputation at ``--audit-rate`` and
``--audit-window``, docs/audits.md; commitments are on in every setting, audits only in
this one). Under ``evict`` and ``audit`` the honest origins' Δ Eq. 8 includes the standby's
own data training origin 2 from the handover on.

``--bounds audit`` runs the widened attacks (``WIDENED``: a lie from the first frame,
scales below the bounds' factors, sign flips, noise at 1× RMS, a lie on 10 % of frames)
and reports, per attack over ``--seeds``, what detected it (bounds, commitment or audit),
the step by which the verdict was in (the coordinator's step at the first status poll
after it), the eviction, Δ Eq. 8 and the sites other than the liar made suspects (false
accusations; a clean run's suspects are all false).

    python benchmarks/poisoning.py                 # cpu-tiny, P = 3, 30 steps, ~15 min
    python benchmarks/poisoning.py --attacks grad-x1000,states-x1e6 --steps 20
    python benchmarks/poisoning.py --bounds evict --out benchmarks/results/poisoning/evict.json
    python benchmarks/poisoning.py --bounds audit --audit-rate 0.5 --seeds 0,1,2 \
        --out benchmarks/results/poisoning/audit-rate0.5.json
    python benchmarks/poisoning.py --bounds audit --attacks clean --seeds 3,4,5,6,7,8,9
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mobius_fed.config import AuditConfig, TrainConfig  # noqa: E402
from mobius_fed.ops import OpsError  # noqa: E402
from mobius_fed.ops.federation import LocalFederation  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "poisoning"
ATTACKS: dict[str, tuple[str, dict[str, str]]] = {
    "grad-x10": ("gradients ×10", {"EVIL_GRAD": "10"}),
    "grad-x1000": ("gradients ×1000", {"EVIL_GRAD": "1000"}),
    "grad-flip": ("gradients sign-flipped", {"EVIL_GRAD": "-1"}),
    "states-x1e6": ("hidden states ×1e6", {"EVIL_SCALE": "1e6"}),
    "er-x1000": ("E/R update ×1000", {"EVIL_ER": "1000"}),
    "loss-lie": ("losses reported ×0.1", {"EVIL_LOSS": "0.1"}),
    # the widened table (``--bounds audit``): lies the bounds alone let through
    "first-grad-x1000": ("gradients ×1000 from step 0", {"EVIL_GRAD": "1000", "EVIL_FROM": "0"}),
    "states-x2": ("hidden states ×2", {"EVIL_SCALE": "2"}),
    "states-x0.5": ("hidden states ×0.5", {"EVIL_SCALE": "0.5"}),
    "grad-x2": ("gradients ×2", {"EVIL_GRAD": "2"}),
    "grad-x0.5": ("gradients ×0.5", {"EVIL_GRAD": "0.5"}),
    "states-flip": ("hidden states sign-flipped", {"EVIL_SCALE": "-1"}),
    "noise-1x": ("noise at 1× RMS, states and gradients", {"EVIL_NOISE": "1"}),
    "flip-10pct": (
        "sign flips on 10 % of frames",
        {"EVIL_SCALE": "-1", "EVIL_GRAD": "-1", "EVIL_FRACTION": "0.1"},
    ),
}
CLASSIC = ("grad-x10", "grad-x1000", "grad-flip", "states-x1e6", "er-x1000", "loss-lie")
WIDENED = (
    "first-grad-x1000", "states-x2", "states-x0.5", "grad-x2", "grad-x0.5", "states-flip",
    "grad-flip", "noise-1x", "flip-10pct",
)  # fmt: skip
SETTINGS = ("off", "on", "evict", "audit")
OFF = {"frames": False, "er_clip_factor": 0}
SUSPECT = re.compile(r"worker-(\d+) is suspect: \d+ of its frames refused \(last: .*? step (\d+)")


class EvilFederation(LocalFederation):
    """A federation whose last worker lies (``tests/evil_worker.py``, ``EVIL_*`` in its env)."""

    evil_env: dict[str, str] = {}  # noqa: RUF012 (set per instance before start)

    def worker_cmd(self, i: int) -> list[str]:
        cmd = super().worker_cmd(i)
        if i == self.train.workers - 1 and self.evil_env:
            cmd[1:3] = ["-m", "tests.evil_worker"]
        return cmd

    def start(self, workers: bool = True) -> LocalFederation:
        saved = dict(os.environ)
        os.environ.update(self.evil_env)  # the honest workers' module ignores EVIL_*
        try:
            return super().start(workers)
        finally:
            os.environ.clear()
            os.environ.update(saved)


@dataclass
class Outcome:
    attack: str
    bounds: str
    phase: str
    last_step: int
    evals: list[tuple[int, list[float]]]
    incidents: int
    suspect_step: int | None = None  # the step of the frame or barrier that made it suspect
    er_clipped: int = 0
    error: str | None = None
    delta_last: float | None = None
    delta_max: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    start: int = 0  # the attack's first step
    detections: list[dict[str, Any]] = field(default_factory=list)  # see ``detections``
    false_accusations: list[str] = field(default_factory=list)  # suspects other than the liar
    audits: dict[str, Any] = field(default_factory=dict)  # status's audits counters


def train_config(
    args: argparse.Namespace, bounds: dict[str, Any], audit_rate: float = 0.0
) -> TrainConfig:
    audit = {"rate": audit_rate, "window": args.audit_window}
    return TrainConfig(
        preset=args.preset, workers=args.workers, batch_size=4, steps=args.steps,
        sync_every=args.sync_every, eval_every=args.eval_every, seed=args.seed, bounds=bounds,
        audit=audit,
    )  # fmt: skip


def frame_suspect(fed: LocalFederation, evil: int) -> int | None:
    """The step of the frame that made ``evil`` a suspect in some worker's log (None: none)."""
    steps = []
    for log in fed.logs.glob("worker-*.log"):
        for m in SUSPECT.finditer(log.read_text(errors="replace")):
            if int(m.group(1)) == evil:
                steps.append(int(m.group(2)))
    return min(steps) if steps else None


def er_suspect(
    status: dict[str, Any], evil: int, args: argparse.Namespace, suspect_after: int
) -> int | None:
    """The step of the barrier at which the coordinator named ``evil`` a suspect (after
    ``suspect_after`` clipped updates)."""
    b = status.get("bounds") or {}
    name = f"worker-{evil}"
    if name not in b.get("suspects", []) or not (b.get("er_clipped") or {}).get(name):
        return None
    first = -(-(args.start + 1) // args.sync_every)  # the first poisoned barrier's round
    return (first + suspect_after - 1) * args.sync_every - 1


def step_at(polls: list[tuple[float, int]], when: float, last: int) -> int:
    """The coordinator's step at the first status poll at or after unix time ``when``
    (``last``, the run's last step, if none came after it): a verdict was in by then."""
    return next((step for t, step in polls if t >= when), last)


def detections(
    final: dict[str, Any],
    polls: list[tuple[float, int]],
    evil: int,
    frame_step: int | None = None,
    er_step: int | None = None,
) -> list[dict[str, Any]]:
    """What named the liar (``worker-<evil>``), earliest verdict first: ``by`` (bounds,
    commitment or audit), ``kind``, ``lie_step`` (the step the finding names) and
    ``verdict_step`` (the step by which it was in). A refused frame is refused as it
    arrives (verdict = its step); a clipped E/R update at its barrier."""
    name, last = f"worker-{evil}", final.get("step", 0)
    found: list[dict[str, Any]] = []
    if frame_step is not None:
        found.append(dict(by="bounds", kind="frame refused", lie_step=frame_step,
                          verdict_step=frame_step))  # fmt: skip
    if er_step is not None:
        found.append(dict(by="bounds", kind="E/R clipped", lie_step=er_step, verdict_step=er_step))
    for block, by in (("commitments", "commitment"), ("audits", "audit")):
        for inc in (final.get(block) or {}).get("incidents") or []:
            edge = inc.get("edge") or ""
            if inc.get("site") != name and name not in edge.split(" → ")[:1]:
                continue
            found.append(dict(by=by, kind=inc["kind"], lie_step=inc.get("step"),
                              verdict_step=step_at(polls, inc["detected_at"], last)))  # fmt: skip
            break  # the first of each block
    return sorted(found, key=lambda d: d["verdict_step"])


def accused(final: dict[str, Any], evil: int | None) -> list[str]:
    """Sites made suspects (by the bounds or an audit) other than the liar ``evil``."""
    liar = None if evil is None else f"worker-{evil}"
    named = set((final.get("bounds") or {}).get("suspects") or [])
    named |= set((final.get("audits") or {}).get("suspects") or [])
    return sorted(n for n in named if n != liar)


def run(
    args: argparse.Namespace, root: Path, attack: str | None, bounds: str, seed: int = 0
) -> Outcome:
    """One run of ``seed``: ``attack`` (None: clean) under the setting ``bounds``."""
    evict = bounds in ("evict", "audit")
    args.seed = seed
    rate = args.audit_rate if bounds == "audit" else 0.0
    cfg = train_config(
        args, OFF if bounds == "off" else {"suspect_after": 1} if evict else {}, rate
    )
    fed = EvilFederation(
        root, cfg, max_incidents=args.max_incidents, threads=1, standbys=int(evict),
        checkpoint_every=args.sync_every if evict else 0,
    )  # fmt: skip
    env = {"EVIL_FROM": str(args.start), "EVIL_ER_FROM": str(args.start)}
    fed.evil_env = {**env, **ATTACKS[attack][1]} if attack else {}
    if evict:
        fed.evil_env["MOBIUS_EVICT_SUSPECTS"] = "true"
    polls: list[tuple[float, int]] = []
    last: list[dict[str, Any]] = []

    def seen(doc: dict[str, Any]) -> None:
        polls.append((time.time(), doc["step"]))
        last[:] = [doc]

    t0 = time.monotonic()
    fed.prepare().start()
    hung = False
    try:
        try:
            final = fed.wait(on_status=seen, timeout=args.timeout)
        except OpsError:  # never ended: its last status, phase and all, is the outcome
            if not last:
                raise
            final, hung = last[0], True
        history = fed.rest("/v1/history")
    finally:
        fed.stop()
    evil = cfg.workers - 1
    seconds = round(time.monotonic() - t0, 1)
    out = Outcome(
        attack=attack or "clean", bounds=bounds, phase=final["phase"], last_step=final["step"],
        evals=[(e["step"], e["origin_losses"]) for e in history["evals"]],
        incidents=len(final.get("incidents") or []), error=final.get("error"), seed=seed,
        start=int(fed.evil_env.get("EVIL_FROM", args.start)),
    )  # fmt: skip
    out.extra["seconds"] = seconds
    if hung:
        out.extra["hung"] = f"phase {final['phase']} after {args.timeout:.0f} s"
    b = final.get("bounds") or {}
    out.er_clipped = (b.get("er_clipped") or {}).get(f"worker-{evil}", 0)
    er_step = er_suspect(final, evil, args, cfg.bounds.suspect_after)
    frame_step = frame_suspect(fed, evil)
    steps = [s for s in (frame_step, er_step) if s is not None]
    out.suspect_step = min(steps) if steps else None
    out.detections = detections(final, polls, evil, frame_step, er_step)
    out.false_accusations = accused(final, evil if attack else None)
    keys = ("rate", "asked", "passed", "frames_compared", "skipped", "by_kind")
    out.audits = {k: v for k, v in (final.get("audits") or {}).items() if k in keys}
    commits = (final.get("commitments") or {}).get("incidents") or []
    out.extra["commitment_incidents"] = [f"{c['kind']}: {c['what']}" for c in commits]
    handed = [h for h in final.get("handovers") or [] if h["rank"] == evil]
    if handed:  # the standby took the group from this round's end
        out.extra["evicted_step"] = fed.train.sync_every * (handed[0]["round"] or 0)
        out.extra["evicted_why"] = handed[0]["why"]
    return out


def honest_eq8(losses: list[float], evil: int) -> float:
    """Eq. 8 over the honest origins: the mean of their held-out losses."""
    honest = [v for s, v in enumerate(losses) if s != evil]
    return sum(honest) / len(honest)


def compare(out: Outcome, clean: Outcome, evil: int) -> None:
    """Fill ``out``'s Δ Eq. 8 against the clean run at the evaluations both reached."""
    ref = {step: honest_eq8(v, evil) for step, v in clean.evals}
    deltas = [(s, honest_eq8(v, evil) - ref[s]) for s, v in out.evals if s in ref]
    if deltas:
        out.delta_last = deltas[-1][1]
        out.delta_max = max(abs(d) for _, d in deltas)
        out.extra["last_eval_step"] = deltas[-1][0]


def cell(out: Outcome, args: argparse.Namespace) -> tuple[str, str, str]:
    """The table's Δ Eq. 8, detection and end columns for one run."""
    if out.delta_last is None:
        delta = "no evaluation"
    else:
        at = out.extra["last_eval_step"]
        short = "" if at == args.steps else f" (at step {at})"
        delta = f"{out.delta_last:+.3f}{short}"
    seen = "no" if out.suspect_step is None else f"step +{out.suspect_step - args.start}"
    end = "done" if out.phase == "done" else f"{out.phase} at step {out.last_step}"
    if out.incidents:
        end += f", {out.incidents} incidents"
    return delta, seen, end


def table(outcomes: list[Outcome], args: argparse.Namespace) -> str:
    who = f"worker-{args.workers - 1}, from step {args.start}"
    rows = [
        f"| attack ({who}) | bounds | Δ Eq. 8, honest | detected (suspect) | run | evicted |",
        "|---|---|---|---|---|---|",
    ]
    for out in outcomes:
        if out.attack == "clean" or out.bounds == "audit":
            continue
        delta, seen, end = cell(out, args)
        name = ATTACKS[out.attack][0]
        gone = out.extra.get("evicted_step")
        evicted = "no" if gone is None else f"yes (from step {gone})"
        rows.append(f"| {name} | {out.bounds} | {delta} | {seen} | {end} | {evicted} |")
    return "\n".join(rows) if len(rows) > 2 else ""


def widened_row(runs: list[Outcome], args: argparse.Namespace) -> dict[str, Any]:
    """One attack's figures over its seeds (``--bounds audit``)."""
    by: dict[str, int] = {}
    after, lied, evicted, deltas, ends = [], [], [], [], []
    for out in runs:
        first = out.detections[0] if out.detections else None
        if first is not None:
            by[first["by"]] = by.get(first["by"], 0) + 1
        after.append(None if first is None else first["verdict_step"] - out.start)
        lied.append(None if first is None or first["lie_step"] is None else first["lie_step"])
        evicted.append(out.extra.get("evicted_step"))
        at = out.extra.get("last_eval_step")
        deltas.append(None if out.delta_last is None or at != args.steps else out.delta_last)
        ends.append(out.phase)
    return {
        "attack": runs[0].attack, "name": ATTACKS[runs[0].attack][0] if runs[0].attack in
        ATTACKS else "clean", "start": runs[0].start, "seeds": [o.seed for o in runs],
        "detected_by": by, "verdict_after": after, "lie_step": lied, "evicted_step": evicted,
        "delta": deltas, "phase": ends,
        "false_accusations": sum(len(o.false_accusations) for o in runs),
        "asked": sum(o.audits.get("asked", 0) for o in runs),
        "passed": sum(o.audits.get("passed", 0) for o in runs),
    }  # fmt: skip


def _steps(values: list[int | None], sign: bool = True) -> str:
    return ", ".join("no" if v is None else f"+{v}" if sign else str(v) for v in values)


def widened_table(outcomes: list[Outcome], args: argparse.Namespace) -> tuple[str, list[dict]]:
    """The widened table (``--bounds audit``), one row per attack over its seeds; and the
    rows' figures."""
    groups: dict[str, list[Outcome]] = {}
    for out in outcomes:
        if out.bounds == "audit":
            groups.setdefault(out.attack, []).append(out)
    if not groups:
        return "", []
    rows = [
        f"| attack (worker-{args.workers - 1}) | from step | detected by | lie found at step | "
        "verdict, steps after the start | evicted at step | honest Δ Eq. 8 | runs | "
        "false accusations |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    figures = []
    for attack, runs in groups.items():
        f = widened_row(runs, args)
        figures.append(f)
        n = len(runs)
        by = ", ".join(f"{k} {v}/{n}" for k, v in sorted(f["detected_by"].items())) or "nothing"
        done = sum(p == "done" for p in f["phase"])
        delta = ", ".join("n/a" if d is None else f"{d:+.3f}" for d in f["delta"])
        if attack == "clean":
            by = f"{f['passed']} of {f['asked']} audits passed"
            delta = "(reference)"
        rows.append(
            f"| {f['name']} | {'—' if attack == 'clean' else f['start']} | {by} | "
            f"{_steps(f['lie_step'], False)} | {_steps(f['verdict_after'])} | "
            f"{_steps(f['evicted_step'], False)} | {delta} | "
            f"{done}/{n} done | {f['false_accusations']} |"
        )
    return "\n".join(rows), figures


def clean_setting(bounds: str) -> str:
    """The setting of the clean run an attack under ``bounds`` is compared with: P sites
    (off, on), or P + 1 (a standby's site splits the corpus one way more, so the honest
    origins' data differ) without or with audits."""
    return bounds if bounds in ("evict", "audit") else "off"


def tables(outcomes: list[Outcome], args: argparse.Namespace) -> tuple[str, list[dict]]:
    """The classic and the widened table as text, and the widened rows' figures."""
    widened, figures = widened_table(outcomes, args)
    return "\n\n".join(t for t in (table(outcomes, args), widened) if t), figures


def retable(path: Path) -> None:
    """Rebuild the tables of the runs kept in ``path`` (written by this script) in place."""
    doc = json.loads(path.read_text())
    args = argparse.Namespace(**doc["config"])
    outcomes = [Outcome(**r) for r in doc["runs"]]
    doc["table"], doc["widened"] = tables(outcomes, args)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print(doc["table"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="cpu-tiny")
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--sync-every", type=int, default=2)
    ap.add_argument("--eval-every", type=int, default=10)
    first = "the attack's first step (after the bounds' warmup of 8 frames)"
    ap.add_argument("--from", dest="start", type=int, default=10, help=first)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seeds", help="comma-separated seeds, each a clean run and every attack")
    ap.add_argument("--max-incidents", type=int, default=3)
    ap.add_argument("--attacks", help="comma-separated (default: the classic six, or the "
                    "widened nine with --bounds audit); 'clean': the clean runs alone")  # fmt: skip
    ap.add_argument("--bounds", default="off,on", help=f"comma-separated: {', '.join(SETTINGS)}")
    ap.add_argument("--audit-rate", type=float, default=AuditConfig().rate,
                    help="audit.rate under --bounds audit (the default: the config's)")  # fmt: skip
    ap.add_argument("--audit-window", type=int, default=AuditConfig().window)
    ap.add_argument("--timeout", type=float, default=300, help="seconds a run may take")
    ap.add_argument("--out", type=Path, default=RESULTS / "poisoning.json")
    ap.add_argument("--work", type=Path, help="keep the runs' directories here")
    ap.add_argument("--retable", type=Path, help="rebuild the tables of a kept JSON, run nothing")
    args = ap.parse_args()
    if args.retable:
        retable(args.retable)
        return
    settings = args.bounds.split(",")
    if bad := set(settings) - set(SETTINGS):
        ap.error(f"--bounds: {', '.join(sorted(bad))} is not one of {', '.join(SETTINGS)}")
    attacks = (args.attacks or ",".join(WIDENED if "audit" in settings else CLASSIC)).split(",")
    attacks = [] if attacks == ["clean"] else attacks
    if bad := set(attacks) - set(ATTACKS):
        ap.error(f"--attacks: {', '.join(sorted(bad))} unknown")
    seeds = [int(x) for x in args.seeds.split(",")] if args.seeds else [args.seed]
    os.chdir(ROOT)  # the lying worker is ``-m tests.evil_worker``
    t0 = time.monotonic()
    outcomes = []
    with tempfile.TemporaryDirectory(prefix="poisoning-") as scratch:
        tmp = Path(args.work or scratch)
        for seed in seeds:
            cleans: dict[str, Outcome] = {}
            for setting in dict.fromkeys(clean_setting(b) for b in settings):
                cleans[setting] = run(args, tmp / f"s{seed}-clean-{setting}", None, setting, seed)
                outcomes.append(cleans[setting])
                print(f"seed {seed} clean {setting}: accused {cleans[setting].false_accusations}",
                      file=sys.stderr, flush=True)  # fmt: skip
            for attack in attacks:
                for bounds in settings:
                    out = run(args, tmp / f"s{seed}-{attack}-{bounds}", attack, bounds, seed)
                    compare(out, cleans[clean_setting(bounds)], args.workers - 1)
                    outcomes.append(out)
                    print(f"seed {seed} {attack} bounds {bounds}: {cell(out, args)} "
                          f"{out.detections[:1]}", file=sys.stderr, flush=True)  # fmt: skip
    text, figures = tables(outcomes, args)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "seconds": round(time.monotonic() - t0, 1),
        "runs": [asdict(o) for o in outcomes],
        "widened": figures,
        "table": text,
    }
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out} ({doc['seconds']:.0f} s)", file=sys.stderr)


if __name__ == "__main__":
    main()
