"""Helpers shared by the command-line tools: errors, data resolution, progress."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console

from mobius_fed.config import TrainConfig
from mobius_fed.data import SiteData, embedded_corpus, prepare_sites

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


def add_flags(parser: argparse.ArgumentParser, flags: dict[str, tuple[str, type]]) -> None:
    for flag, (key, typ) in flags.items():
        parser.add_argument(flag, dest=key, type=typ)


def flag_values(args: argparse.Namespace, flags: dict[str, tuple[str, type]]) -> dict:
    return {key: getattr(args, key) for key, _ in flags.values()}


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
