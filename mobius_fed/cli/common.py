"""Helpers shared by the command-line tools: errors, data resolution, progress."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from rich.console import Console
from rich.markup import escape

from mobius_fed import __version__
from mobius_fed.coordinator.endpoints import EndpointsError, find_endpoints
from mobius_fed.ops import OpsError
from mobius_fed.ops.local import default_threads, prepared_dir, site_dirs, split_sites

if TYPE_CHECKING:  # torch-free at import: `mobius-fed health` runs as a frequent healthcheck
    from mobius_fed.config import TrainConfig
    from mobius_fed.data import SiteData

console = Console(stderr=True, soft_wrap=True)


# ------------------------------------------------------------------ settings flags
def add_config_flag(parser: argparse.ArgumentParser, tables: str = "a [train] table") -> None:
    parser.add_argument(
        "--config",
        type=Path,
        default=None,
        metavar="FILE.toml",
        help=f"TOML file with {tables}, read before MOBIUS_* variables and flags "
        "(env MOBIUS_CONFIG)",
    )


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def print_config(cfg) -> int:
    """Print a config model as JSON (the resolved settings); exit status 0."""
    print(json.dumps(cfg.model_dump(mode="json"), indent=2))
    return 0


def config_path(args: argparse.Namespace) -> Path | None:
    """``--config``, else ``MOBIUS_CONFIG``, else None."""
    path = getattr(args, "config", None) or os.environ.get("MOBIUS_CONFIG") or None
    return Path(path) if path else None


def add_train_flags(parser: argparse.ArgumentParser, *, skip: Sequence[str] = ()) -> None:
    """``--config`` plus one flag per TrainConfig setting (nested ones as ``--<sub>-<field>``)
    except the keys in ``skip`` (a sub-config name skips all its fields)."""
    from mobius_fed.cli.flags import add_settings_flags
    from mobius_fed.config import TrainConfig

    if not any("--config" in a.option_strings for a in parser._actions):
        add_config_flag(parser)
    group = parser.add_argument_group("training (TrainConfig)")
    add_settings_flags(group, TrainConfig, skip=skip)
    if "tied" not in skip:
        group.add_argument("--untied", dest="tied", action="store_false", help="same as --no-tied")


def daemon_parser(prog: str, description: str, tables: str) -> argparse.ArgumentParser:
    """A daemon's parser with ``--version``, ``--config``, ``--log-level``, ``--print-config``
    and ``--allow-readable-key``."""
    p = argparse.ArgumentParser(
        prog=prog, description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    add_config_flag(p, tables)
    level = os.environ.get("MOBIUS_LOG_LEVEL", "").strip().upper() or "INFO"
    if level not in LOG_LEVELS:
        fail(f"MOBIUS_LOG_LEVEL={level!r}: expected one of {', '.join(LOG_LEVELS)}")
    p.add_argument(
        "--log-level",
        default=level,
        type=str.upper,
        choices=LOG_LEVELS,
        help="log verbosity (default: INFO; env MOBIUS_LOG_LEVEL)",
    )
    p.add_argument(
        "--print-config",
        action="store_true",
        help="print the configuration that --config, MOBIUS_* and the flags give (JSON), "
        "and exit without starting",
    )
    p.add_argument(
        "--allow-readable-key",
        action="store_true",
        help="only warn about a private key its group or others can read (default: refuse "
        "to start; env MOBIUS_ALLOW_READABLE_KEY=1; docs/keys.md)",
    )
    return p


def add_daemon_train_flags(parser: argparse.ArgumentParser, title: str, model, settings) -> None:
    """The ``[train]`` settings of a daemon's ``model`` (flattened) as their own flag group."""
    from mobius_fed.cli.flags import add_settings_flags

    train = parser.add_argument_group(title)
    own_keys = {s.key for s in settings if s.path[0] != "train"}
    add_settings_flags(train, model, flatten=("train",), skip=own_keys)
    train.add_argument("--untied", dest="tied", action="store_false", help="same as --no-tied")


def flag_values(args: argparse.Namespace, flags: dict[str, tuple[str, type]]) -> dict:
    """``{dest: value}`` for a ``{flag: (dest, type)}`` table such as the daemons' FLAGS."""
    return {dest: getattr(args, dest, None) for dest, _ in flags.values()}


def train_config_from_args(args: argparse.Namespace, **overrides) -> TrainConfig:
    """TrainConfig from ``--config``'s ``[train]`` table, then ``MOBIUS_*``, then flags
    (``overrides`` win over everything: values a command sets itself). Errors name the
    setting and where its value came from."""
    from mobius_fed.cli import flags as cli_flags
    from mobius_fed.cli.variables import refuse_unknown
    from mobius_fed.config import TrainConfig
    from mobius_fed.settings import layered_config

    refuse_unknown()
    flags = {**cli_flags.flag_values(args, TrainConfig), **overrides}
    return layered_config(
        TrainConfig,
        section="train",
        path=config_path(args),
        environ=os.environ,
        flags=flags,
        what="training configuration",
    )


def add_data_flag(parser: argparse.ArgumentParser) -> None:
    """``--data``: the same meaning in every command that trains on several sites."""
    parser.add_argument(
        "--data",
        type=Path,
        nargs="+",
        default=None,
        metavar="PATH",
        help="a prepared directory of site-<i>/ folders, or .txt/.jsonl/.parquet files split "
        "into P sites (default: the embedded corpus)",
    )


def add_checkpoint_flag(parser: argparse.ArgumentParser, default: int) -> None:
    """``--checkpoint-every``: counted in optimizer STEPS in every command."""
    parser.add_argument(
        "--checkpoint-every",
        type=int,
        default=default,
        metavar="STEPS",
        help="optimizer steps between checkpoints (0: at the end only; coordinated runs: a "
        f"multiple of --sync-every) (default: {default})",
    )


def step_progress(*fields: str, out: Console = console):
    """A rich progress bar: the task's name, the bar, step n/N, ``fields`` (text column
    formats), then the time elapsed."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("step {task.completed}/{task.total}"),
        *(TextColumn(f) for f in fields),
        TimeElapsedColumn(),
        console=out,
    )


# ------------------------------------------------------------------------- threads
def threads_value(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number ≥ 1, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number ≥ 1, got {n}")
    return n


def add_threads_flag(
    parser: argparse.ArgumentParser,
    default_help: str = "all cores",
    what: str = "per training process",
) -> None:
    parser.add_argument(
        "--threads",
        type=threads_value,
        default=None,
        metavar="N",
        help=f"torch intra-op threads {what} (default: {default_help}; env MOBIUS_THREADS)",
    )


def threads_from(args: argparse.Namespace | None = None, processes: int = 1) -> int:
    """``--threads``, else ``MOBIUS_THREADS``, else :func:`default_threads` (processes)."""
    n = getattr(args, "threads", None)
    if n is None and os.environ.get("MOBIUS_THREADS", "").strip():
        text = os.environ["MOBIUS_THREADS"]
        try:
            n = threads_value(text)
        except argparse.ArgumentTypeError as exc:
            raise CliError(f"MOBIUS_THREADS={text!r}: {exc}") from None
    return n if n is not None else default_threads(processes)


def apply_threads(args: argparse.Namespace | None = None, *, processes: int = 1) -> int:
    """Set this process's torch intra-op threads (see :func:`threads_from`) and return the
    number. ``OMP_NUM_THREADS`` is set first, for a torch not loaded yet."""
    n = threads_from(args, processes)
    os.environ["OMP_NUM_THREADS"] = str(n)
    import torch

    torch.set_num_threads(n)
    return n


def resume_value(text: str) -> bool | str:
    """``--resume`` values: ``auto`` (resume when a complete manifest exists, else start
    fresh), or a boolean (``true``/``false``, ``yes``/``no``, ``1``/``0``)."""
    value = text.strip().lower()
    if value == "auto":
        return "auto"
    if value in ("true", "yes", "1", "on"):
        return True
    if value in ("false", "no", "0", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected auto, true or false, got {text!r}")


def add_resume_flag(parser: argparse._ActionsContainer, help_: str) -> None:
    """``--resume`` alone means true; ``--resume auto`` / ``--resume false`` also work."""
    parser.add_argument(
        "--resume",
        nargs="?",
        const=True,
        default=None,
        type=resume_value,
        metavar="auto",
        help=help_,
    )


class CliError(OpsError):
    """An error to print (without a traceback) before exiting with status 2."""


def fail(message: str) -> NoReturn:
    console.print(f"[bold red]error:[/] {escape(message)}", highlight=False)
    sys.exit(2)


def run_guarded(fn, *args, **kwargs) -> int:
    """Run a command, turning expected errors into one clear line and exit status 2."""
    try:
        return fn(*args, **kwargs) or 0
    except (OpsError, ValueError, FileNotFoundError, FileExistsError) as exc:
        fail(str(exc))
    except RuntimeError as exc:  # PeerError and other run-time failures: one clear line
        fail(f"{type(exc).__name__}: {exc}")
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/]")
        return 130


# ----------------------------------------------------------------------- stop signals
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class Terminated(SystemExit):
    """A stop signal, raised in the main thread so that its ``finally`` blocks run."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signum = signum


class GracefulStop:
    """SIGTERM, SIGINT and SIGHUP for a daemon: unwind, then exit within ``deadline`` seconds.

    The first signal raises :class:`Terminated` in the main thread, out of whatever it waits in,
    so the ``finally`` blocks stop the servers and links; further signals are ignored. A
    watcher thread (woken by the wakeup fd, whichever thread got the signal) re-sends it to the
    main thread if the handler has not run within 0.3 s, and ends the process ``deadline``
    seconds after the signal. Exit status (0 if ``finished()``, else 128 + signal) and why a
    hard exit cannot tear a checkpoint: docs/deployment.md "Stopping, restarting and healing".
    """

    def __init__(self, prog: str, deadline: float = 1.5) -> None:
        self.prog = prog
        self.finished: Callable[[], bool] = lambda: False  # the daemon sets its own
        self.deadline = deadline
        self.signals = tuple(int(s) for s in STOP_SIGNALS)
        self.signum: int | None = None
        self.received_at: float | None = None
        self._lock = threading.Lock()
        self._unwinding = threading.Event()
        self._done = threading.Event()
        self._wsock: socket.socket | None = None
        self.installed = False

    # ------------------------------------------------------------ install
    def install(self) -> GracefulStop:
        """Take over the stop signals (main thread only; elsewhere this does nothing)."""
        if threading.current_thread() is not threading.main_thread():
            return self
        self.installed = True
        rsock, self._wsock = socket.socketpair()
        self._wsock.setblocking(False)
        signal.set_wakeup_fd(self._wsock.fileno(), warn_on_full_buffer=False)
        for sig in self.signals:
            signal.signal(sig, self._handler)
        threading.Thread(target=self._watch, args=(rsock,), daemon=True, name="stop").start()
        return self

    def _note(self, signum: int) -> None:
        with self._lock:
            if self.signum is None:  # the first stop signal counts
                self.signum, self.received_at = signum, time.monotonic()

    def _handler(self, signum: int, frame) -> None:
        if self._unwinding.is_set():
            return  # already stopping: let the finally blocks finish
        self._note(signum)
        self._unwinding.set()
        logging.getLogger("mobius").warning(
            "%s: %s received; stopping (exit %d)",
            self.prog,
            signal.Signals(signum).name,
            self.exit_code(),
        )
        raise Terminated(signum)

    def _watch(self, rsock: socket.socket) -> None:
        signum = None
        while signum is None:
            try:
                data = rsock.recv(64)
            except OSError:
                return
            if not data:
                return
            signum = next((b for b in data if b in self.signals), None)
        self._note(signum)
        first = self.signum or signum  # the signal that counts (noted by now)
        main = threading.main_thread().ident
        if not self._unwinding.wait(0.3) and main is not None:
            # The kernel gave the signal to another thread and the main thread sleeps in
            # a wait that only a signal of its own interrupts.
            with contextlib.suppress(OSError, ValueError):
                signal.pthread_kill(main, first)
        left = self.deadline - (time.monotonic() - (self.received_at or time.monotonic()))
        if self._done.wait(max(0.0, left)):
            return
        print(
            f"{self.prog}: still stopping {self.deadline:.1f}s after "
            f"{signal.Signals(first).name}; exiting now",
            file=sys.stderr,
            flush=True,
        )
        self.exit_now()

    # ----------------------------------------------------------------- exit
    def ignore(self) -> None:
        """From now on a stop signal raises nothing (the caller is stopping anyway); the
        hard deadline still applies."""
        self._unwinding.set()

    def settle(self) -> None:
        """Stopping is complete: cancel the hard deadline."""
        self._done.set()

    def exit_code(self) -> int:
        if self.signum is None:
            return 0
        try:
            done = bool(self.finished())
        except Exception:
            done = False
        return 0 if done else 128 + self.signum

    def exit_now(self, code: int | None = None) -> None:
        """Flush and end the process now, without waiting for non-daemon threads (a gRPC
        handler blocked in a long wait would otherwise hold up the interpreter's exit).
        After a stop signal the status is :meth:`exit_code`'s, else ``code``."""
        self._done.set()
        code = self.exit_code() if self.signum is not None or code is None else code
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        logging.shutdown()
        os._exit(code)


def daemon_main(prog: str, parser: argparse.ArgumentParser, run, argv: list[str] | None) -> int:
    """Parse ``argv``, set up logging and the stop signals, then :func:`run_guarded`: once a
    stop signal arrived, the exit status is the :class:`GracefulStop`'s (0 after a finished
    run, else 128 + signal), whatever the unwinding raised."""
    args = parser.parse_args(argv)
    if args.allow_readable_key:  # read where the key is checked (transport/tls.py)
        os.environ["MOBIUS_ALLOW_READABLE_KEY"] = "1"
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    stop = GracefulStop(prog).install()
    try:
        rc = run_guarded(run, args, stop)
    except SystemExit as exc:  # fail(): status 2; Terminated: 128 + signal
        rc = exc.code if isinstance(exc.code, int) else 1
    if stop.installed:
        # Exit at once: interpreter shutdown would wait for gRPC's threads (about a second
        # after a finished run, much longer with a Register call still waiting), and a
        # signal in that window would find the default handlers back (exit -15, not 0).
        stop.exit_now(rc)
    return rc


def resolve_sites(cfg: TrainConfig, data: Sequence[Path] | None, out: Path) -> list[SiteData]:
    """Per-site datasets from a prepared directory, text files, or the embedded corpus."""
    from mobius_fed.data import SiteData

    given = prepared_dir(data)
    if given is not None:
        dirs = site_dirs(given, cfg.P)
    else:
        dirs = split_sites(data, out / "sites", cfg.P, cfg.encoding)
    model = cfg.model()
    sites = [SiteData(d, model.seq_len, cfg.encoding) for d in dirs]
    vocab = model.vocab_size
    for site in sites:
        if site.max_token() >= vocab:
            raise CliError(f"{site.directory}: token id {site.max_token()} ≥ vocab {vocab}")
    return sites


def add_run_flag(parser: argparse.ArgumentParser) -> None:
    """``--run DIR``: find a ``mobius-fed up`` run's coordinator through its endpoints.json."""
    parser.add_argument(
        "--run",
        type=Path,
        default=None,
        metavar="DIR",
        help="a `mobius-fed up --out DIR` run: address and operator certs from "
        "DIR/endpoints.json (default: ./runs/up when it exists)",
    )


def run_endpoints(run: Path | None):  # -> Endpoints | None (torch-free import)
    """The endpoints of ``--run DIR`` (or ``./runs/up``); a bad file is a CliError naming it."""
    try:
        return find_endpoints(run)
    except EndpointsError as exc:
        raise CliError(str(exc)) from None
