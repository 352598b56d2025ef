"""One settings system for every command: TOML file, then ``MOBIUS_*`` environment, then flags.

Every field of a pydantic config model is a setting with one name derived from the model
(``privacy.label_noise`` / ``MOBIUS_PRIVACY__LABEL_NOISE`` / ``--privacy-label-noise``;
docs/configuration.md, "Settings: one name, three places"). A daemon's ``train`` sub-model is
flattened (``--steps``). Unknown TOML keys are errors here; unknown ``MOBIUS_*`` variables are
checked by :mod:`mobius_fed.cli.variables`, which this generic module does not import.
"""

from __future__ import annotations

import difflib
import json
import tomllib
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Union

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

ENV_PREFIX = "MOBIUS_"
NEST = "__"

# Process-level variables that are not fields of a config model.
PROCESS_ENV = {
    "MOBIUS_CONFIG": "TOML file read before the environment and flags (--config)",
    "MOBIUS_THREADS": "torch intra-op threads of a process that trains (--threads); "
    "default: all cores, a process among N on one machine: cores // N",
    "MOBIUS_TIKTOKEN_TIMEOUT": "seconds to wait for tiktoken's gpt2 files (default 60)",
    "MOBIUS_LOG_LEVEL": "daemon log verbosity: DEBUG, INFO, WARNING or ERROR (--log-level)",
    "MOBIUS_IMAGE": "docker compose only: the image every service runs",
    "MOBIUS_ALLOW_READABLE_KEY": "1: only warn about a private key its group or others can "
    "read (--allow-readable-key); default: refuse to start (docs/keys.md)",
    "MOBIUS_WARM_START": "1: `up` and the test suite fork `python -m mobius_fed…` children "
    "from a server that has imported torch (mobius_fed/warmstart.py); default: fresh interpreters",
    "MOBIUS_WARM_PACKAGES": "with MOBIUS_WARM_START=1: more top-level packages (comma-separated) "
    "whose `python -m` modules start warm; the test suite names `tests`",
    "MOBIUS_KEEPALIVE_SCALE": "multiplies every gRPC keepalive time and timeout (control "
    "streams: a ping every 30 s, answered within 10 s; ring links: 5 s and 5 s), from 1 to "
    "10000; raise it where a link queues more than a few seconds of data (slower than about "
    "1 Mbit/s): a dead peer is then noticed that much later. Default 1",
    "MOBIUS_TRACKER": "also log metrics to tensorboard, mlflow or wandb (--tracker; an "
    "optional extra each); default none",
    # Former ring-link variables: a worker with one set refuses to start, naming the new one
    # (transport/link_tuning.py refuses them).
    **{
        f"MOBIUS_LINK_{x}": f"removed (a worker refuses to start): use MOBIUS_LINK__{x}"
        for x in ("RATE", "RTT", "WINDOW", "CHUNK", "SOCKET_BUFFER", "BDP_PROBE")
    },
}


class ConfigError(ValueError):
    """A configuration problem, phrased for the person who wrote the config."""


@dataclass(frozen=True)
class Setting:
    """One field of a config model, with where it lives and what it is called."""

    path: tuple[str, ...]  # location in the model's data, e.g. ("train", "privacy", "noise")
    name: tuple[str, ...]  # public name parts, e.g. ("privacy", "noise")
    info: FieldInfo

    @property
    def key(self) -> str:
        return ".".join(self.name)

    @property
    def env(self) -> str:
        return ENV_PREFIX + NEST.join(p.upper() for p in self.name)

    @property
    def flag(self) -> str:
        return "--" + "-".join(p.replace("_", "-") for p in self.name)

    @property
    def dest(self) -> str:
        return NEST.join(self.name)

    @property
    def annotation(self) -> Any:
        return self.info.annotation

    @property
    def default(self) -> Any:
        if self.info.default_factory is not None:
            return self.info.get_default(call_default_factory=True)
        return self.info.default

    @property
    def required(self) -> bool:
        return self.info.is_required()

    @property
    def description(self) -> str:
        return self.info.description or ""

    def choices(self) -> tuple[str, ...] | None:
        """The allowed values: a Literal's, or ``json_schema_extra={"choices": [...]}``."""
        extra = self.info.json_schema_extra
        choices = extra.get("choices") if isinstance(extra, dict) else None
        if isinstance(choices, list | tuple):
            return tuple(str(v) for v in choices)
        literals = [m for m in _members(self.annotation) if typing.get_origin(m) is Literal]
        values = [v for m in literals for v in typing.get_args(m)]
        if not values or has_type(self.annotation, bool):
            return None
        return tuple(str(v) for v in values)


def _members(annotation: Any) -> tuple[Any, ...]:
    """The members of a union (``X | None`` → ``(X,)``); a plain type is its own member."""
    origin = typing.get_origin(annotation)
    if origin in (Union, types.UnionType):
        return tuple(a for a in typing.get_args(annotation) if a is not type(None))
    return (annotation,)


def has_type(annotation: Any, kind: type) -> bool:
    """Whether ``annotation`` (or a union member, or a generic's origin) is ``kind``."""
    return any(m is kind or typing.get_origin(m) is kind for m in _members(annotation))


def submodel(annotation: Any) -> type[BaseModel] | None:
    members = _members(annotation)
    if len(members) == 1 and isinstance(members[0], type) and issubclass(members[0], BaseModel):
        return members[0]
    return None


def settings_of(
    model: type[BaseModel], *, flatten: Iterable[str] = (), _path: tuple = (), _name: tuple = ()
) -> list[Setting]:
    """Every leaf field of ``model`` (nested models included) as a :class:`Setting`; fields
    named in ``flatten`` are sub-models whose fields keep their own names."""
    flatten = tuple(flatten)
    out: list[Setting] = []
    for field, info in model.model_fields.items():
        sub = submodel(info.annotation)
        path = (*_path, field)
        name = _name if field in flatten else (*_name, field)
        if sub is not None:
            out.extend(settings_of(sub, _path=path, _name=name))
        else:
            out.append(Setting(path, name, info))
    names = [s.name for s in out]
    clash = {n for n in names if names.count(n) > 1}
    if clash:
        raise TypeError(f"{model.__name__}: settings share a name: {sorted(clash)}")
    return out


# ------------------------------------------------------------------------------- values
def parse_text(setting: Setting, text: str) -> Any:
    """A value from an environment variable or flag: lists are comma-separated (or JSON),
    mappings KEY=VALUE pairs (or JSON); everything else pydantic converts from the text."""
    text = text.strip()
    if has_type(setting.annotation, list) or has_type(setting.annotation, tuple):
        if text.startswith("["):
            return json.loads(text)
        return [p.strip() for p in text.split(",") if p.strip()]
    if has_type(setting.annotation, dict):
        if text.startswith("{"):
            return json.loads(text)
        out: dict[str, Any] = {}
        for item in filter(None, (p.strip() for p in text.split(","))):
            key, sep, value = item.partition("=")
            if not sep:
                raise ConfigError(f"{setting.key}: expected KEY=VALUE, got {item!r}")
            out[key.strip()] = json.loads(value)
        return out
    return text


def _put(data: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for part in path[:-1]:
        node = data.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{'.'.join(path)}: {part} is a table, not a value")
        data = node
    data[path[-1]] = value


def _merge(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in top.items():
        both = isinstance(value, Mapping) and isinstance(out.get(key), dict)
        out[key] = _merge(out[key], value) if both else value
    return out


# ---------------------------------------------------------------------------- sources
def read_toml(path: Path) -> dict[str, Any]:
    """Read a TOML file, with a clear error for a missing or malformed file."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from exc


# Top-level TOML tables a config file may hold; one file can serve every command.
TOML_TABLES = ("train", "worker", "coordinator")


def check_environ(environ: Mapping[str, str], known: Mapping[str, str]) -> None:
    """Refuse a ``MOBIUS_*`` variable that is not in ``known`` (a typo would be ignored).

    ``known`` is every name any command reads: the commands put it together
    (:mod:`mobius_fed.cli.variables`), since only they see every config model."""
    for var in sorted(environ):
        if var.startswith(ENV_PREFIX) and var not in known:
            close = difflib.get_close_matches(var, known, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ConfigError(
                f"unknown environment variable {var}{hint}; see docs/configuration.md "
                "for every MOBIUS_* setting"
            )


# ---------------------------------------------------------------------------- layering
def layered_config(
    model: type[BaseModel],
    *,
    section: str,
    path: Path | None = None,
    environ: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
    extra: Mapping[str, Any] | None = None,
    what: str = "configuration",
) -> Any:
    """``model`` from defaults, then TOML (``[section]``, plus ``[train]`` into a ``train``
    field), then ``MOBIUS_*`` variables, then ``flags`` ({dest: value}, None = not given).

    ``extra`` are values set by the program between the environment and the flags. A file
    that has none of the known tables is read as the section itself."""
    flatten = ("train",) if section != "train" else ()
    settings = settings_of(model, flatten=flatten)
    data: dict[str, Any] = {}
    origin: dict[tuple[str, ...], str] = {}
    if path is not None:
        data = _file_layer(model, section, path, flatten)
        origin[("<file>",)] = str(path)
        origin.update({s.path: str(path) for s in settings if _get(data, s.path) is not None})
    if environ is not None:
        for s in settings:
            text = environ.get(s.env)
            if text is not None and text.strip() != "":
                _put(data, s.path, _parsed(s, text, f"{s.env}={text!r}"))
                origin[s.path] = f"{s.env}={text!r}"
    for key, value in (extra or {}).items():
        if value is not None:
            _put(data, tuple(key.split(".")), value)
    by_dest = {s.dest: s for s in settings}
    for dest, value in (flags or {}).items():
        if value is None:
            continue
        if dest not in by_dest:
            raise ConfigError(f"no setting named {dest!r}")
        s = by_dest[dest]
        if isinstance(value, str):
            value = _parsed(s, value, f"{s.flag} {value!r}")
        if isinstance(value, dict) and isinstance(_get(data, s.path), dict):
            value = _merge(_get(data, s.path), value)
        _put(data, s.path, value)
        origin[s.path] = f"{s.flag} {value!r}"
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        hints = {s.path: f"{s.flag} or {s.env}" for s in settings}
        problem = describe_validation_error(exc, origin, hints)
        raise ConfigError(f"invalid {what}: {problem}") from exc


def _file_layer(
    model: type[BaseModel], section: str, path: Path, flatten: tuple[str, ...]
) -> dict[str, Any]:
    """The ``[section]`` table of the TOML file at ``path`` (with ``[train]`` merged into its
    ``train`` field when ``flatten``); a table the file should not have is refused."""
    doc = read_toml(path)
    nested = {f for f, i in model.model_fields.items() if submodel(i.annotation)}
    tables = {k for k, v in doc.items() if isinstance(v, dict)}
    if not tables & set(TOML_TABLES) and tables <= nested:  # a bare table of settings
        doc = {section: doc}
    expected = ", ".join(f"[{t}]" for t in TOML_TABLES)
    for table in doc:
        if not isinstance(doc[table], dict):
            raise ConfigError(f"{path}: {table} = … outside a table (put it in {expected})")
        if table not in TOML_TABLES:
            raise ConfigError(f"{path}: unknown table [{table}] (expected {expected})")
    data = dict(doc.get(section, {}))
    if flatten and "train" in doc:
        data["train"] = _merge(data.get("train", {}), doc["train"])
    return data


def _parsed(setting: Setting, text: str, source: str) -> Any:
    try:
        return parse_text(setting, text)
    except ValueError as exc:  # JSON, KEY=VALUE
        raise ConfigError(f"{setting.key} (from {source}): {exc}") from None


def _get(data: Mapping[str, Any], path: tuple[str, ...]) -> Any:
    for part in path:
        if not isinstance(data, Mapping) or part not in data:
            return None
        data = data[part]
    return data


def describe_validation_error(
    exc: Exception,
    origin: Mapping[tuple[str, ...], str] | None = None,
    hints: Mapping[tuple[str, ...], str] | None = None,
) -> str:
    """A pydantic ValidationError as 'field (from SOURCE): problem' parts; a missing
    setting names where to give it (``hints``: path → 'flag or variable')."""
    errors = getattr(exc, "errors", None)
    if errors is None:
        return str(exc)
    parts = []
    for err in errors():
        loc = tuple(str(x) for x in err.get("loc", ()))
        msg = str(err.get("msg", "")).removeprefix("Value error, ")
        source = (origin or {}).get(loc)
        if err.get("type") == "extra_forbidden":
            msg = "unknown setting"
            source = (origin or {}).get(("<file>",), source)
        elif err.get("type") == "missing" and loc in (hints or {}):
            msg = f"required: give {(hints or {})[loc]}"
        where = ".".join(loc) or "config"
        parts.append(f"{where} (from {source}): {msg}" if source else f"{where}: {msg}")
    return "; ".join(parts)
