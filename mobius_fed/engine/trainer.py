"""Training loop around the reference engine: metrics, evaluation and checkpoints."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from mobius_fed.engine.metrics import MetricsLog
from mobius_fed.engine.reference import EvalResult, ReferenceEngine, StepResult

CHECKPOINT = "checkpoint.pt"
METRICS = "metrics.jsonl"


def train(
    engine: ReferenceEngine,
    out_dir: Path,
    *,
    checkpoint_every: int = 50,
    resume: bool = False,
    on_step: Callable[[StepResult], None] | None = None,
    on_eval: Callable[[EvalResult], None] | None = None,
) -> list[EvalResult]:
    """Train to ``cfg.steps``; evaluate every ``eval_every`` steps and at the end.

    With ``resume`` the newest ``out_dir/checkpoint.pt`` is loaded first, and the metrics
    log is cut back to the checkpoint's step so the resumed run continues it exactly.
    """
    cfg = engine.cfg
    out_dir = Path(out_dir)
    ckpt = out_dir / CHECKPOINT
    if resume:
        engine.load(ckpt)
    log = MetricsLog(out_dir / METRICS, start_step=engine.step)
    evals: list[EvalResult] = []
    while engine.step < cfg.steps:
        result = engine.train_step()
        log.write(
            {
                "step": result.step,
                "loss": result.loss,
                "origin_losses": result.origin_losses,
                "lr_mult": cfg.lr_multiplier(result.step),
                "seconds": result.seconds,
                "tokens": result.tokens,
            }
        )
        if on_step:
            on_step(result)
        done = engine.step == cfg.steps
        if done or (cfg.eval_every and engine.step % cfg.eval_every == 0):
            ev = engine.evaluate()
            evals.append(ev)
            log.write(
                {"step": ev.step, "eval_loss": ev.loss, "eval_origin_losses": ev.origin_losses}
            )
            if on_eval:
                on_eval(ev)
        if done or (checkpoint_every and engine.step % checkpoint_every == 0):
            engine.save(ckpt)
    return evals
