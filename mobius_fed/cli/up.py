"""``mobius-fed up``: a whole federation on this machine (:mod:`mobius_fed.ops.federation`),
with a progress bar, the final losses and checkpoint, and signals forwarded to its processes."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mobius_fed.cli import common
from mobius_fed.cli.common import (
    CliError,
    GracefulStop,
    Terminated,
    add_resume_flag,
    console,
    threads_from,
)
from mobius_fed.cli.status import ring_summary
from mobius_fed.machines import IncidentState, Phase
from mobius_fed.ops.federation import LocalFederation
from mobius_fed.tracking import add_tracker_flag, tracked

if TYPE_CHECKING:  # torch loads only when up runs, not when `mobius-fed` builds its parser
    from mobius_fed.config import TrainConfig


STOP_GRACE = 5.0  # seconds children get after a forwarded signal, before SIGKILL
STOP_DEADLINE = STOP_GRACE + 5.0  # up itself exits by then, whatever is left to unwind


def claim_out(out: Path, resume: bool | str | None, force: bool) -> None:
    """Refuse an ``--out`` that a live ``up`` runs in, or that holds an earlier run unless
    ``--resume`` (continue it) or ``--force`` (delete its outputs first): operations §3."""
    from mobius_fed.coordinator.endpoints import EndpointsError, read_endpoints
    from mobius_fed.coordinator.run_dir import clear_run, earlier_run

    with contextlib.suppress(EndpointsError):
        ep = read_endpoints(out)
        if ep.state != "exited" and ep.alive() and ep.pid != os.getpid():
            raise CliError(
                f"--out {out}: a `mobius-fed up` (pid {ep.pid}) is running there; stop it "
                f"first, or choose another --out (mobius-fed status --run {out})"
            )
    earlier = earlier_run(out)
    if earlier is None or resume:
        return
    if not force:
        raise CliError(
            f"--out {out} holds {earlier}. Continue it with `mobius-fed up --out {out} "
            f"--resume`, replace it with --force (deletes its checkpoints, metrics and logs), "
            "or choose another --out"
        )
    gone = clear_run(out)
    console.print(f"--force: deleted the earlier run's {', '.join(p.name for p in gone)}")


def up_main(args: argparse.Namespace) -> int:
    """``mobius-fed up``: build the train config from TOML/env/flags and run."""
    from mobius_fed.cli.coordinator import parse_options

    train = common.train_config_from_args(args)
    strategy_options = parse_options(args.strategy_option)
    from mobius_fed.strategies import sync_strategy

    try:  # --sync-outer against --strategy: refused before anything starts
        sync_strategy(args.strategy, strategy_options, train)
    except ValueError as exc:
        raise common.CliError(str(exc)) from None
    claim_out(Path(args.out), args.resume, getattr(args, "force", False))
    # The handler raises Terminated in this (main) thread; every child then gets the same
    # signal. The hard deadline is only a safety net beyond the children's grace.
    stop = GracefulStop("mobius-fed up", deadline=STOP_DEADLINE).install()
    fed = _federation(args, train, strategy_options)
    final: dict[str, Any] | None = None
    linger = linger_default(args.linger)
    try:
        final = _tracked_run(fed, args, train)
        _after_run(fed, final, linger)
    except (KeyboardInterrupt, Terminated) as exc:
        stop.ignore()  # a second signal changes nothing: every child is being stopped
        return _interrupted(fed, final, exc)
    finally:
        _wind_down(fed, stop)
    if fed.restarts:
        print("restarts: " + ", ".join(f"{n} {c}" for n, c in sorted(fed.restarts.items())))
    if final["phase"] != Phase.DONE:
        raise CliError(f"run {final['phase']}: {final['error']}")
    return 0


def _federation(
    args: argparse.Namespace, train: TrainConfig, strategy_options: dict[str, Any]
) -> LocalFederation:
    """The federation ``up`` runs, from its flags (nothing started yet)."""
    return LocalFederation(
        Path(args.out),
        train,
        strategy=args.strategy,
        strategy_options=strategy_options,
        checkpoint_every=args.checkpoint_every,
        resume=args.resume or False,
        threads=threads_from(args, train.workers),
        data=args.data,
        rejoin_timeout=args.rejoin_timeout,
        max_incidents=args.max_incidents,
        keep_checkpoints=args.keep_checkpoints,
        max_restarts=args.max_restarts,
        standbys=args.standbys,
    )


def _tracked_run(
    fed: LocalFederation, args: argparse.Namespace, train: TrainConfig
) -> dict[str, Any]:
    """Run to the end under the run's tracker, in up itself: one tracker across
    coordinator restarts. Returns the final status."""
    from mobius_fed.coordinator.recorder import METRICS_FILE

    metrics, config = fed.coordinator_out / METRICS_FILE, train.model_dump(mode="json")
    with tracked(args.tracker, metrics, run_name="up", config=config):
        return _up(fed, args, train)


def _after_run(fed: LocalFederation, final: dict[str, Any], linger: float) -> None:
    """Print the result, then keep the status service up for ``linger`` or say it ended."""
    _report(final)
    if linger:
        _linger(fed, linger)
    else:
        _served_note(fed)


def _interrupted(
    fed: LocalFederation,
    final: dict[str, Any] | None,
    exc: KeyboardInterrupt | Terminated,
) -> int:
    """SIGINT/SIGTERM: forward it to every process; the exit status to return."""
    signum = exc.signum if isinstance(exc, Terminated) else int(signal.SIGINT)
    if final is not None:  # the run had ended: this only ends the status service
        fed.stop(grace=STOP_GRACE, sig=signum)
        console.print(f"{signal.Signals(signum).name}: coordinator stopped")
        return 0 if final["phase"] == Phase.DONE else 1
    console.print(
        f"[yellow]{signal.Signals(signum).name}: forwarded to every process; "
        f"SIGKILL for any still running after {STOP_GRACE:.0f}s[/]"
    )
    codes = fed.stop(grace=STOP_GRACE, sig=signum)
    if codes:
        console.print("exit status: " + ", ".join(f"{n} {c}" for n, c in codes.items()))
    from mobius_fed.coordinator.manifests import latest_manifest

    manifest = latest_manifest(fed.coordinator_out)
    print(f"last complete checkpoint: {manifest or 'none'}")
    return 128 + signum


def _wind_down(fed: LocalFederation, stop: GracefulStop) -> None:
    """Whatever happened: nothing left running, and ``status`` told that the run ended."""
    stop.ignore()
    fed.stop(grace=STOP_GRACE)
    if (fed.root / "endpoints.json").is_file():
        with contextlib.suppress(OSError):  # `status`: the run has ended, nothing serves it
            fed.write_endpoints("exited")
    stop.settle()


def _report(final: dict[str, Any]) -> None:
    """The run's result, printed when it ends (before any linger)."""
    if final["phase"] != Phase.DONE:
        console.print(f"[red]run {final['phase']}[/]: {final['error']}")
        return
    per = ", ".join(f"s{s}={v:.4f}" for s, v in enumerate(final["eval_origin_losses"] or []))
    if final.get("eval_loss") is not None:
        print(f"final validation loss (Eq. 8): {final['eval_loss']:.4f}  per origin: {per}")
    print(f"checkpoint: {final['checkpoint']}", flush=True)


def _linger(fed: LocalFederation, seconds: float) -> None:
    """Keep the coordinator serving the final status for ``seconds`` (< 0: until a signal)."""
    run = fed.root
    how = "until Ctrl-C / SIGTERM" if seconds < 0 else f"for {seconds:.0f}s (--linger)"
    console.print(
        f"run ended; the coordinator keeps serving its status {how}: "
        f"mobius-fed status --run {run} | mobius-fed dashboard --run {run}"
    )
    deadline = None if seconds < 0 else time.monotonic() + seconds
    while deadline is None or time.monotonic() < deadline:
        if fed.procs["coordinator"].poll() is not None:
            console.print("the coordinator exited; nothing left to serve")
            return
        time.sleep(0.2)


def linger_default(value: float | None) -> float:
    """``--linger`` when given; otherwise serve until a signal only where a person watches
    (standard output is a terminal), and exit at once in a script or CI job."""
    if value is not None:
        return value
    return -1.0 if sys.stdout.isatty() else 0.0


def _served_note(fed: LocalFederation) -> None:
    """Where the status was served, for a run that exits at once (a script, ``--linger 0``)."""
    ep = fed.endpoints()
    console.print(
        f"run ended; its status was served at {ep['rest']}/ (gRPC {ep['grpc']}); the "
        f"coordinator has stopped. To keep it serving after a run: mobius-fed up --linger "
        f"SECONDS|forever (then mobius-fed status --run {fed.root})",
        highlight=False,
    )


def _print_endpoints(fed: LocalFederation) -> None:
    ep = fed.endpoints()
    lines = [
        f"coordinator gRPC  {ep['grpc']}  (status, grpc.health.v1; mTLS)",
        f"REST + dashboard  {ep['rest']}/  (mutual TLS, operator cert {ep['certs']['cert']})",
    ]
    if ep["metrics"]:
        lines.append(f"metrics           {ep['metrics']}  (plain HTTP, also /healthz /readyz)")
    lines.append(f"endpoints file    {fed.root / 'endpoints.json'}")
    lines.append(
        f"look at it with   mobius-fed status --run {fed.root}  |  "
        f"mobius-fed dashboard --run {fed.root}"
    )
    for line in lines:
        console.print(line, highlight=False)


def _up(fed: LocalFederation, args, train: TrainConfig) -> dict[str, Any]:
    """Prepare, start and watch the federation; the final status."""
    from mobius_fed.strategies import sync_strategy

    fed.write_endpoints("starting")  # `status` finds the run before certs, data, processes
    fed.prepare()
    console.print(
        f"[bold]mobius-fed up[/]: coordinator + {train.workers} workers"
        + (f" ({train.rings} rings of {train.P})" if train.rings > 1 else "")
        + " on 127.0.0.1, "
        f"{train.preset}, L={train.loops} {train.order}, {train.steps} steps, "
        f"{sync_strategy(args.strategy, {}, train)[0]} every {train.sync_every} step(s)"
        + (f" ({train.sync.named()})" if train.sync.on_sites else "")
        + (
            f", groups synced across rings every {train.ring_sync_every} ({train.ring_outer}"
            + (f", {train.ring_aggregate})" if train.ring_aggregate != "mean" else ")")
            if train.rings > 1
            else ""
        )
        + f"; logs in {fed.logs}"
    )
    fed.start()
    fed.write_endpoints()
    _print_endpoints(fed)
    with common.step_progress("{task.fields[info]}") as bar:
        task = bar.add_task("train", total=train.steps, info="waiting for workers")
        told: dict[int, str] = {}  # incident id → the state already printed

        def show(doc: dict[str, Any]) -> None:
            for inc in doc.get("incidents", []):  # recovery, as it happens
                if told.get(inc["id"]) == inc["state"]:
                    continue
                told[inc["id"]] = inc["state"]
                if inc["state"] == IncidentState.OPEN:
                    bar.console.print(f"[yellow]incident {inc['id']}[/]: {inc['what']}")
                elif inc["state"] == IncidentState.RECOVERED:
                    bar.console.print(
                        f"[green]incident {inc['id']} recovered[/] in {inc['recovery_s']:.1f}s: "
                        f"rolled back to round {inc['rollback_round']}, "
                        f"{inc['steps_redone']} step(s) redone"
                    )
                else:
                    bar.console.print(f"[red]incident {inc['id']} {inc['state']}[/]")
            losses = [w["last_loss"] for w in doc["workers"] if w["last_loss"] is not None]
            info = doc["phase"]
            if losses:
                info += f"  loss {sum(losses) / len(losses):.4f}"
            if doc.get("eval_loss") is not None:
                info += f"  val {doc['eval_loss']:.4f}"
            if rings := ring_summary(doc):  # R > 1: which ring holds the run
                info += f"  {rings}"
            bar.update(task, completed=doc["step"], info=info)

        fed.on_event = bar.console.print
        return fed.wait(on_status=show)


# --------------------------------------------------------------------------- the command
def linger_value(text: str) -> float:
    """``--linger`` values: seconds (0: exit at once), or ``forever`` / -1."""
    if text.strip().lower() in ("forever", "inf", "-1"):
        return -1.0
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds or 'forever', got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected seconds ≥ 0 or 'forever', got {text!r}")
    return value


def standby_count(text: str) -> int:
    """``--standbys``: a whole number ≥ 0."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number ≥ 0, got {text!r}")
    return value


class _LazyTrainFlagsParser(argparse.ArgumentParser):
    """``up``'s parser: the training flags are generated from TrainConfig (which loads
    torch) on first use — parsing or help — not when ``mobius-fed`` builds its parser, so
    ``mobius-fed health`` stays torch-free."""

    populated = True

    def _populate(self) -> None:
        if not self.populated:
            self.populated = True
            common.add_train_flags(self)

    def parse_known_args(self, args=None, namespace=None):
        self._populate()
        return super().parse_known_args(args, namespace)

    def format_help(self) -> str:
        self._populate()
        return super().format_help()


def register(sub) -> None:
    """Add ``up`` to the ``mobius-fed`` subcommands."""
    parser_class, sub._parser_class = sub._parser_class, _LazyTrainFlagsParser
    try:
        p = sub.add_parser(
            "up",
            help="coordinator + P workers as processes on this machine",
            description="A whole federation on 127.0.0.1: certificates, per-site data, the "
            "coordinator and P workers, supervised. Writes OUT/endpoints.json (addresses, "
            "operator certs) for `mobius-fed status|health|dashboard --run OUT`; after the "
            "run the coordinator keeps serving status until Ctrl-C when the output is a "
            "terminal, and exits at once in a script (see --linger).",
        )
    finally:
        sub._parser_class = parser_class
    p.populated = False  # the training flags come on first use
    p.add_argument(
        "--out", default="runs/up", help="certs, sites, logs, checkpoints (default runs/up)"
    )
    p.add_argument(
        "--strategy", default="fedavg", help="fedavg, fedavgm, fedadam, fedyogi, … (default fedavg)"
    )
    p.add_argument(
        "--strategy-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a strategy option (repeatable), e.g. server_learning_rate=0.5",
    )
    common.add_checkpoint_flag(p, 0)
    common.add_data_flag(p)
    common.add_threads_flag(p, "cores / P per worker")
    _add_recovery_flags(p)
    add_resume_flag(
        p,
        "continue from the newest complete manifest; --resume auto: only if there is one",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="start afresh in an --out that holds an earlier run, deleting its checkpoints, "
        "metrics and logs (certs and sites are kept); without it (or --resume) up refuses",
    )
    add_tracker_flag(p)
    p.set_defaults(func=up_main)


def _add_recovery_flags(p) -> None:
    """Retention, incident budget, restarts and the linger after the run."""
    p.add_argument(
        "--keep-checkpoints", type=int, help="complete manifests to keep (coordinator's default)"
    )
    p.add_argument(
        "--rejoin-timeout",
        type=float,
        help="seconds an incident waits for a lost worker to come back (coordinator's default)",
    )
    p.add_argument(
        "--max-incidents",
        type=int,
        help="incidents the run recovers from before it fails (coordinator's default)",
    )
    p.add_argument(
        "--max-restarts",
        type=int,
        default=5,
        help="times up restarts each crashed process (0: never); a worker comes back with the "
        "same command, the coordinator with --resume auto (default 5)",
    )
    p.add_argument(
        "--standbys",
        type=standby_count,
        default=0,
        metavar="S",
        help="also start S standby sites (standby-<k>, each with a site of its own) that "
        "take a lost or replaced worker's rank: docs/recovery.md (default 0)",
    )
    p.add_argument(
        "--linger",
        type=linger_value,
        default=None,
        metavar="SECONDS",
        help="after the run, keep the coordinator serving status, dashboard and metrics for "
        "SECONDS (0: exit at once; forever: until Ctrl-C / SIGTERM). Default: forever when "
        "standard output is a terminal, 0 in a script",
    )
