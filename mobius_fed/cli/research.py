"""``mobius-fed experiment``, ``sweep`` and ``analyze``: the paper's comparison and beyond."""

from __future__ import annotations

import argparse
import contextlib
import math
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from mobius_fed.cli.common import (
    CliError,
    add_threads_flag,
    add_train_flags,
    apply_threads,
    console,
    resolve_sites,
    step_progress,
    train_config_from_args,
)
from mobius_fed.ops.local import prepared_dir, site_dirs, split_sites

if TYPE_CHECKING:
    from mobius_fed.config import TrainConfig
    from mobius_fed.engine.experiment import StepHooks
    from mobius_fed.research.sweep import Cell

GRID_FIELDS = ("workers", "loops", "order", "seed")


# ------------------------------------------------------------------------------- sweep
def _sweep_sites(cfg: TrainConfig, data: list[Path] | None, out: Path) -> Path:
    """Directory of P prepared sites for this P (prepared once, reused on resume)."""
    given = prepared_dir(data)
    if given is not None:
        site_dirs(given, cfg.P)  # raises naming what is missing
        return given
    root = out / f"sites-P{cfg.P}"
    if not all((root / f"site-{i}" / "meta.json").is_file() for i in range(cfg.P)):
        split_sites(data, root, cfg.P, cfg.encoding)
    return root


def _sweep_grids(args: argparse.Namespace) -> list[tuple[Path, list[Cell]]]:
    """(directory, cells) per training length: one grid, or one per ``--lengths`` value."""
    from mobius_fed.config import TrainConfig
    from mobius_fed.research.crossover import check_lengths, length_dir
    from mobius_fed.research.sweep import grid

    base = train_config_from_args(args)
    out = Path(args.out)
    seeds = args.seed_list or [base.seed + k for k in range(args.seeds)]
    if not args.lengths:
        return [(out, grid(base, args.grid_workers, args.grid_loops, args.grid_orders, seeds, out))]
    grids = []
    for n in check_lengths(args.lengths):
        cfg = TrainConfig.model_validate({**base.model_dump(), "steps": n})
        d = length_dir(out, n)
        grids.append((d, grid(cfg, args.grid_workers, args.grid_loops, args.grid_orders, seeds, d)))
    return grids


def _run_sweep(args: argparse.Namespace, grids: list[tuple[Path, list[Cell]]]) -> None:
    """Prepare every cell, then run the unfinished ones, the costliest first."""
    from mobius_fed.research.sweep import by_cost, prepare_cell, run_cells

    todo, total = [], 0
    for out, cells in grids:
        total += len(cells)
        for cell in cells:
            sites = _sweep_sites(cell.cfg, args.data, out)
            if prepare_cell(
                cell, sites, coupled=args.coupled_batches, checkpoint_every=args.checkpoint_every
            ):
                todo.append(cell)
    console.print(
        f"sweep: {total} cells ({total - len(todo)} finished already), "
        f"{min(args.threads, max(len(todo), 1))} at a time, 1 thread each → {args.out}"
    )
    done = [total - len(todo)]

    def on_done(d: Path, result: dict | None, seconds: float) -> None:
        done[0] += result is not None
        what = f"{result['final']:.4f}" if result else f"FAILED (see {d / 'cell.log'})"
        name = d.name if len(grids) == 1 else f"{d.parent.parent.name}/{d.name}"
        console.print(f"[{done[0]}/{total}] {name}: {what} ({seconds:.0f} s)")

    failed = run_cells([c.directory for c in by_cost(todo)], parallel=args.threads, on_done=on_done)
    if failed:
        console.print(f"[red]{len(failed)} cell(s) failed[/]; rerun the same command to retry")


def cmd_sweep(args: argparse.Namespace) -> int:
    from mobius_fed.research.cell import read_result
    from mobius_fed.research.crossover import write_crossover
    from mobius_fed.research.report import write_report

    grids = _sweep_grids(args)
    if not args.report_only:
        _run_sweep(args, grids)
    argv = [a for a in sys.argv[1:] if a != "--report-only"]
    command = shlex.join(["mobius-fed", *argv])
    by_length, finished, total = {}, 0, 0
    for out, cells in grids:
        results = [r for c in cells if (r := read_result(c.directory)) is not None]
        finished, total = finished + len(results), total + len(cells)
        if results:
            write_report(results, out, command=command)
            by_length[cells[0].cfg.steps] = results
            print(f"{out}:\n{(out / 'table.md').read_text()}")
    if not finished:
        raise CliError(f"no finished cells under {args.out}")
    if args.lengths:
        path = write_crossover(by_length, Path(args.out), command=command)
        print(f"crossover: {path}")
    else:
        print(f"report: {Path(args.out) / 'report.md'}")
    return 0 if finished == total else 1


# -------------------------------------------------------------------------- experiment
@contextlib.contextmanager
def _arm_bar(cfg: TrainConfig) -> Iterator[StepHooks]:
    """One experiment run's progress bar: step n/N, its loss and its last validation loss."""
    from mobius_fed.engine.experiment import StepHooks, arm_name

    fields = ("loss {task.fields[loss]:.4f}", "val {task.fields[val]}")
    with step_progress(*fields, out=console) as bar:
        task = bar.add_task(arm_name(cfg), total=cfg.steps, loss=math.nan, val="—")
        yield StepHooks(
            on_step=lambda r: bar.update(task, completed=r.step + 1, loss=r.loss),
            on_eval=lambda e: bar.update(task, val=f"{e.loss:.4f}"),
        )


def cmd_experiment(args: argparse.Namespace) -> int:
    from mobius_fed.engine.experiment import markdown_table, plot_curves, run_experiment
    from mobius_fed.schedule import ORDERS

    cfg = train_config_from_args(args)
    apply_threads(args)
    for order in args.grid_orders:
        if order not in ORDERS:
            raise CliError(f"unknown order {order!r} (expected one of {', '.join(ORDERS)})")
    for L in args.grid_loops:
        if L < 1:
            raise CliError(f"--loops: L must be ≥ 1, got {L}")
    if args.seeds < 1:
        raise CliError(f"--seeds must be ≥ 1, got {args.seeds}")
    out = Path(args.out)
    sites = resolve_sites(cfg, args.data, out)
    arms = run_experiment(
        cfg, sites, args.grid_loops, args.grid_orders, out, seeds=args.seeds, progress=_arm_bar
    )
    table = markdown_table(arms, cfg.P)
    (out / "table.md").write_text(table)
    print(table)
    png = plot_curves(arms, out / "validation.png", cfg)
    print(f"table: {out / 'table.md'}; curves: {png or 'matplotlib not installed, no PNG'}")
    return 0


# ----------------------------------------------------------------------------- analyze
def cmd_analyze(args: argparse.Namespace) -> int:
    from mobius_fed.research.analyze import analyze_paths

    apply_threads(args)
    report = analyze_paths(
        [Path(p) for p in args.runs],
        Path(args.out) if args.out else None,
        data=args.data,
        batches=args.batches,
    )
    print(f"report: {report}")
    return 0


def _add_sweep_parser(sub: argparse._SubParsersAction) -> None:
    """``mobius-fed sweep``'s flags."""
    p = sub.add_parser(
        "sweep",
        help="grid over P, L, order and seeds as parallel processes (resumable)",
        description="Train every (P, L, order, seed) cell with the reference engine, one "
        "process and one thread per cell, and report Δ = Möbius − ordered with 95 % intervals.",
    )
    add_train_flags(p, skip=GRID_FIELDS)
    p.add_argument(
        "--workers", dest="grid_workers", type=int, nargs="+", default=[4], help="P values"
    )
    p.add_argument("--loops", dest="grid_loops", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--orders", dest="grid_orders", nargs="+", default=["ordered", "cyclic"])
    p.add_argument(
        "--seeds", type=int, default=3, help="seeds seed, seed+1, …, seed+N-1 (default 3)"
    )
    p.add_argument("--seed-list", type=int, nargs="+", help="explicit seeds instead of --seeds")
    p.add_argument("--threads", type=int, default=2, help="thread budget = cells run at once")
    p.add_argument("--data", type=Path, nargs="+", help="text files or a prepared directory")
    p.add_argument("--out", default="runs/sweep")
    p.add_argument(
        "--lengths",
        type=int,
        nargs="+",
        metavar="STEPS",
        help="several training lengths (replaces --steps): one sweep per length under "
        "OUT/n<STEPS>/, and OUT/crossover.md with Δ against tokens per parameter",
    )
    p.add_argument("--checkpoint-every", type=int, default=100, help="steps between checkpoints")
    p.add_argument(
        "--coupled-batches",
        action="store_true",
        help="every site draws the same window offsets (the old sampling, for comparison)",
    )
    p.add_argument("--report-only", action="store_true", help="only rewrite the report")
    p.set_defaults(func=cmd_sweep)


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``experiment``, ``sweep`` and ``analyze`` to ``mobius-fed``."""
    p = sub.add_parser("experiment", help="the paper's Table 1: ordered-loop vs Möbius")
    add_train_flags(p, skip=("loops", "order"))
    p.add_argument("--loops", dest="grid_loops", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--orders", dest="grid_orders", nargs="+", default=["ordered", "cyclic"])
    p.add_argument("--seeds", type=int, default=1, help="seeds per arm (seed, seed+1, …)")
    p.add_argument("--data", type=Path, nargs="+")
    p.add_argument("--out", default="runs/experiment")
    add_threads_flag(p)
    p.set_defaults(func=cmd_experiment)

    _add_sweep_parser(sub)

    p = sub.add_parser(
        "analyze",
        help="depth roles inside the block groups (logit lens, update sizes, CKA)",
    )
    p.add_argument(
        "runs",
        nargs="+",
        help="runs to compare (e.g. cyclic, ordered): a run directory or checkpoint file, or a "
        "coordinated run (an up root, a coordinator's --out, or a checkpoint manifest)",
    )
    p.add_argument("--data", type=Path, nargs="+", help="validation data (default: the run's)")
    p.add_argument("--batches", type=int, default=2, help="validation batches per origin")
    p.add_argument("--out", help="report directory (default: <first run>/analysis)")
    add_threads_flag(p)
    p.set_defaults(func=cmd_analyze)


def main(argv: list[str] | None = None) -> int:
    """``python -m mobius_fed.cli.research …``: ``mobius-fed …``, which loads only the module of
    the command it runs."""
    from mobius_fed.cli.main import main as fed_main

    return fed_main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
