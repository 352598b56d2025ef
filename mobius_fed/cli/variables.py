"""Every ``MOBIUS_*`` variable of every command, put together where the commands meet.

The settings system (:mod:`mobius_fed.settings`) derives each command's variables from its
config model; this module lists them all (the training, worker and coordinator models, and
the process variables), so that a command can refuse a name no command reads, and
``mobius-fed config env`` can print the reference table.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from mobius_fed.config import TrainConfig
from mobius_fed.coordinator.config import CoordinatorConfig
from mobius_fed.settings import PROCESS_ENV, ConfigError, check_environ, settings_of
from mobius_fed.transport.tls import keepalive_scale
from mobius_fed.worker.config import WorkerConfig


def known_env_names() -> dict[str, str]:
    """Every ``MOBIUS_*`` name any command reads → its description."""
    out = dict(PROCESS_ENV)
    for model in (TrainConfig, WorkerConfig, CoordinatorConfig):
        for s in settings_of(model, flatten=("train",)):
            out.setdefault(s.env, s.description)
    return out


def env_reference() -> list[tuple[str, str, str, str]]:
    """(variable, commands, default, description) for every ``MOBIUS_*`` name."""
    rows: dict[str, list[str]] = {}
    models = (
        ("local, up, experiment, coordinator, worker", TrainConfig, ()),
        ("worker", WorkerConfig, ("train",)),
        ("coordinator", CoordinatorConfig, ("train",)),
    )
    for where, model, flatten in models:
        for s in settings_of(model, flatten=flatten):
            if flatten and s.path[0] == "train":
                continue
            default = "(required)" if s.required else _text(s.default)
            if s.env in rows:
                rows[s.env][1] += f", {where}"
            else:
                rows[s.env] = [s.env, where, default, s.description]
    for name, text in PROCESS_ENV.items():
        rows.setdefault(name, [name, "process", "", text])
    return [(v, c, d, t) for v, c, d, t in rows.values()]


def env_markdown() -> str:
    """:func:`env_reference` as a Markdown table (``mobius-fed config env --markdown``)."""
    lines = ["| Variable | Read by | Default | Meaning |", "|---|---|---|---|"]
    for name, where, default, text in env_reference():
        cell = text.replace("|", "\\|")
        lines.append(f"| `{name}` | {where} | {f'`{default}`' if default else ''} | {cell} |")
    return "\n".join(lines) + "\n"


def _text(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list | tuple | dict):
        return json.dumps(value) if value else "none"
    return str(value)


def refuse_unknown(environ: Mapping[str, str] | None = None) -> None:
    """Raise ConfigError naming a ``MOBIUS_*`` variable (of ``environ``, default the
    process's) that no command reads, with the closest known name, or a process variable
    whose value the process cannot take."""
    env = os.environ if environ is None else environ
    check_environ(env, known_env_names())
    try:
        keepalive_scale(env)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
