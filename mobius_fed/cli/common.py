"""Helpers shared by the command-line tools: errors, data resolution, progress."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console

if TYPE_CHECKING:  # torch-free at import: `mobius-fed health` runs as a frequent healthcheck
    from mobius_fed.config import TrainConfig
    from mobius_fed.data import SiteData

console = Console(stderr=True, soft_wrap=True)


# Training flags shared by the daemons: flag → (TrainConfig field, type).
DAEMON_TRAIN_FLAGS: dict[str, tuple[str, type]] = {
    "--preset": ("preset", str),
    "--workers": ("workers", int),
    "--loops": ("loops", int),
    "--order": ("order", str),
    "--seed": ("seed", int),
    "--steps": ("steps", int),
    "--wire-dtype": ("wire_dtype", str),
    "--batch-size": ("batch_size", int),
    "--micro-batches": ("micro_batches", int),
    "--optimizer": ("optimizer", str),
    "--sync-every": ("sync_every", int),
    "--eval-every": ("eval_every", int),
    "--eval-batches": ("eval_batches", int),
    "--lr-adam": ("lr_adam", float),
    "--lr-muon": ("lr_muon", float),
    "--encoding": ("encoding", str),
}


def add_flags(
    parser: argparse.ArgumentParser,
    flags: dict[str, tuple[str, type]],
    helps: dict[str, str] | None = None,
) -> None:
    for flag, (key, typ) in flags.items():
        parser.add_argument(flag, dest=key, type=typ, help=(helps or {}).get(flag))


def flag_values(args: argparse.Namespace, flags: dict[str, tuple[str, type]]) -> dict:
    return {key: getattr(args, key) for key, _ in flags.values()}


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


def add_resume_flag(parser: argparse.ArgumentParser, help_: str) -> None:
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


class CliError(Exception):
    """An error to print (without a traceback) before exiting with status 2."""


def fail(message: str) -> None:
    console.print(f"[bold red]error:[/] {message}", highlight=False)
    sys.exit(2)


def run_guarded(fn, *args, **kwargs) -> int:
    """Run a command, turning expected errors into one clear line and exit status 2."""
    try:
        return fn(*args, **kwargs) or 0
    except (CliError, ValueError, FileNotFoundError, FileExistsError) as exc:
        fail(str(exc))
    except RuntimeError as exc:  # PeerError and other run-time failures: one clear line
        fail(f"{type(exc).__name__}: {exc}")
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/]")
        return 130
    return 0


# ----------------------------------------------------------------------- stop signals
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class Terminated(SystemExit):
    """A stop signal, raised in the main thread so that its ``finally`` blocks run."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signum = signum

    @property
    def signame(self) -> str:
        return signal.Signals(self.signum).name


class GracefulStop:
    """SIGTERM, SIGINT and SIGHUP for a daemon: unwind, then exit within ``deadline`` seconds.

    The first stop signal raises :class:`Terminated` in the main thread, out of whatever it
    waits in (a Condition, a queue, ``time.sleep``, a blocking gRPC call), so the ``finally``
    blocks on the way out stop the gRPC servers and ring links. Further signals are ignored.

    A watcher thread learns of the signal through the wakeup fd, whichever thread the kernel
    delivered it to. It re-sends the signal to the main thread if the handler has not run
    within 0.3 s, and ends the process ``deadline`` seconds after the signal if the main
    thread is still not done (a gRPC server's grace period, a long torch op). A hard exit
    cannot tear a checkpoint: every checkpoint file and manifest is written to a temporary
    name and then renamed, so a manifest either exists complete or not at all.

    Exit status: 0 when ``finished()`` says the run had completed, else 128 + the signal
    (143 for SIGTERM, 130 for SIGINT, 129 for SIGHUP).
    """

    def __init__(
        self,
        prog: str,
        finished: Callable[[], bool] | None = None,
        deadline: float = 1.5,
        signals: Sequence[int] = STOP_SIGNALS,
    ) -> None:
        self.prog = prog
        self.finished: Callable[[], bool] = finished or (lambda: False)
        self.deadline = deadline
        self.signals = tuple(int(s) for s in signals)
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

    def _note(self, signum: int) -> bool:
        with self._lock:
            if self.signum is not None:
                return False
            self.signum, self.received_at = signum, time.monotonic()
            return True

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
        if not self._unwinding.wait(0.3):
            # The kernel gave the signal to another thread and the main thread sleeps in
            # a wait that only a signal of its own interrupts.
            with contextlib.suppress(OSError, ValueError):
                signal.pthread_kill(threading.main_thread().ident, self.signum)  # type: ignore[arg-type]
        left = self.deadline - (time.monotonic() - (self.received_at or time.monotonic()))
        if self._done.wait(max(0.0, left)):
            return
        print(
            f"{self.prog}: still stopping {self.deadline:.1f}s after "
            f"{signal.Signals(self.signum).name}; exiting now",  # type: ignore[arg-type]
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

    @property
    def stopping(self) -> bool:
        return self.signum is not None

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
        code = self.exit_code() if self.stopping or code is None else code
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        logging.shutdown()
        os._exit(code)


def run_daemon(prog: str, fn, args: argparse.Namespace, stop: GracefulStop) -> int:
    """:func:`run_guarded` for a daemon: once a stop signal arrived, the exit status is
    ``stop``'s (0 after a finished run, else 128 + signal), whatever the unwinding raised."""
    try:
        rc = run_guarded(fn, args, stop)
    except SystemExit as exc:  # fail(): status 2; Terminated: 128 + signal
        rc = exc.code if isinstance(exc.code, int) else 1
    if stop.installed:
        # Exit at once: interpreter shutdown would wait for gRPC's threads (about a second
        # after a finished run, much longer with a Register call still waiting), and a
        # signal in that window would find the default handlers back (exit -15, not 0).
        stop.exit_now(rc)
    return rc


def site_dirs(root: Path, P: int) -> list[Path]:
    """The P directories ``root/site-<i>``; a clear error when any is missing."""
    root = Path(root)
    if not root.is_dir():
        raise CliError(f"data directory not found: {root}")
    dirs = [root / f"site-{i}" for i in range(P)]
    missing = [str(d) for d in dirs if not d.is_dir()]
    if missing:
        raise CliError(f"data directory {root} lacks {', '.join(missing)} (P={P})")
    return dirs


def resolve_sites(cfg: TrainConfig, data: Sequence[Path] | None, out: Path) -> list[SiteData]:
    """Per-site datasets from a prepared directory, text files, or the embedded corpus."""
    from mobius_fed.data import SiteData, embedded_corpus, prepare_sites

    if data and len(data) == 1 and Path(data[0]).is_dir():
        dirs = site_dirs(Path(data[0]), cfg.P)
    elif data:
        for f in data:
            if not Path(f).exists():
                raise CliError(f"data path not found: {f}")
        dirs = prepare_sites(
            [Path(f) for f in data], out / "sites", cfg.P, cfg.encoding, overwrite=True
        )
    else:
        dirs = prepare_sites(
            None, out / "sites", cfg.P, cfg.encoding, text=embedded_corpus(), overwrite=True
        )
    seq_len = cfg.model().seq_len
    sites = [SiteData(d, seq_len, cfg.encoding) for d in dirs]
    vocab = cfg.model().vocab_size
    for site in sites:
        if site.max_token() >= vocab:
            raise CliError(f"{site.directory}: token id {site.max_token()} ≥ vocab {vocab}")
    return sites
