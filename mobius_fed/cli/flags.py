"""Command-line flags generated from the config models (see :mod:`mobius_fed.settings`).

Every setting becomes ``--<name>`` with its help (the field's description), default, env
name and choices (a Literal's values); booleans get ``--<name>`` / ``--no-<name>``. A
sub-config class that defines ``parse_flag(text) -> dict`` also gets one compact flag,
``--<sub> TEXT``, whose values the per-field flags override. Flags default to None, so
that a value given nowhere on the command line leaves the file and environment in charge.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from mobius_fed.settings import Setting, has_type, settings_of, submodel

COMPACT_SUFFIX = "__compact"


def _show(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list | tuple):
        return ",".join(map(str, value)) or "none"
    if isinstance(value, dict):
        return ",".join(f"{k}={v}" for k, v in value.items()) or "none"
    return str(value)


ADDRESS_NAMES = ("listen", "advertise", "coordinator")


def _metavar(s: Setting) -> str:
    ann = s.annotation
    if s.name[-1].endswith(ADDRESS_NAMES):
        return "HOST:PORT"
    if has_type(ann, int) and not has_type(ann, bool):
        return "N"
    if has_type(ann, float):
        return "X"
    if has_type(ann, list):
        return "A,B,..."
    if has_type(ann, dict):
        return "K=V,..."
    if has_type(ann, Path):
        return "PATH"
    return s.name[-1].upper()


def value_type(s: Setting) -> type | None:
    """int or float for a numeric setting (argparse converts and names a bad value)."""
    members = {m for m in (int, float) if has_type(s.annotation, m)}
    if has_type(s.annotation, bool) or len(members) != 1:
        return None
    return members.pop()


def help_text(s: Setting) -> str:
    what = s.description.rstrip(".") or s.key.replace("_", " ")
    default = "required" if s.required else f"default: {_show(s.default)}"
    return f"{what} ({default}; env {s.env})".replace("%", "%%")


def add_settings_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    model: type[BaseModel],
    *,
    flatten: Iterable[str] = (),
    skip: Iterable[str] = (),
    only: Iterable[str] | None = None,
) -> list[Setting]:
    """One flag per setting of ``model`` (keys in ``skip`` left out; with ``only``, just
    those keys, e.g. a coordinator setting that ``up`` passes on); the settings added."""
    skip = set(skip)
    wanted = None if only is None else set(only)
    added: list[Setting] = []
    for s in settings_of(model, flatten=flatten):
        if s.key in skip or s.name[0] in skip:
            continue
        if wanted is not None and s.key not in wanted:
            continue
        kwargs: dict[str, Any] = {"dest": s.dest, "default": None, "help": help_text(s)}
        choices = s.choices()
        if has_type(s.annotation, bool) and not choices:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif choices:
            kwargs["choices"] = choices
        else:
            kwargs["metavar"] = _metavar(s)
            kind = value_type(s)
            if kind is not None:
                kwargs["type"] = kind
        parser.add_argument(s.flag, **kwargs)
        added.append(s)
    if wanted is None:
        _add_compact_flags(parser, model, flatten=tuple(flatten), skip=skip)
    return added


def _add_compact_flags(parser, model: type[BaseModel], *, flatten: tuple, skip: set) -> None:
    for field, info in model.model_fields.items():
        sub = submodel(info.annotation)
        if sub is None or field in skip:
            continue
        if field in flatten:
            _add_compact_flags(parser, sub, flatten=(), skip=skip)
        elif callable(parse_flag := getattr(sub, "parse_flag", None)):
            doc = " ".join((parse_flag.__doc__ or "").split())
            doc = doc.replace("``", "") or sub.__name__
            parser.add_argument(
                f"--{field.replace('_', '-')}",
                dest=field + COMPACT_SUFFIX,
                default=None,
                metavar="SPEC",
                help=(f"{doc} (the --{field}-* flags override it)").replace("%", "%%"),
            )


def flag_values(
    args: argparse.Namespace,
    model: type[BaseModel],
    *,
    flatten: Iterable[str] = (),
) -> dict[str, Any]:
    """``{dest: value}`` of the settings flags given on the command line (None elsewhere),
    compact ``--<sub> SPEC`` flags expanded into their fields."""
    flatten = tuple(flatten)
    settings = settings_of(model, flatten=flatten)
    values = {s.dest: getattr(args, s.dest, None) for s in settings}
    for s in settings:
        sub_dest = s.dest.rpartition("__")[0]  # "" for a top-level setting
        text = getattr(args, sub_dest + COMPACT_SUFFIX, None) if sub_dest else None
        if text is None:
            continue
        parsed = _compact(model, s.path[:-1], text)
        if values[s.dest] is None:
            values[s.dest] = parsed.get(s.name[-1])
    return values


@functools.cache
def _compact(model: type[BaseModel], path: tuple[str, ...], text: str) -> dict[str, Any]:
    """The fields a compact flag sets, via the sub-config's ``parse_flag`` (memoized)."""
    cls: Any = model
    for part in path:
        cls = submodel(cls.model_fields[part].annotation)
    return dict(cls.parse_flag(text))


def daemon_flags(settings: Iterable[Setting]) -> dict[str, tuple[str, type]]:
    """``{flag: (setting dest, value type)}`` of a daemon's own (non-training) settings."""
    return {x.flag: (x.dest, value_type(x) or str) for x in settings if x.path[0] != "train"}
