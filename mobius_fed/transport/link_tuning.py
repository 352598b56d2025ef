"""Flow control of ring links on long fat pipes: HTTP/2 windows, piece size, socket buffers
(settings and defaults: docs/link.md "Settings"; why: docs/wan.md §3).

:class:`LinkTuning` sizes them from a path hint (``rate`` bits/s, ``rtt`` seconds) or takes
explicit values. ``socket_buffer`` sets ``grpc.experimental.tcp_*_buffer_size``; without it
kernel autotuning stops at ``tcp_rmem``'s maximum (6 MiB by default): raise that by sysctl, or
set this, on paths whose BDP is larger. Tuning changes no math.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from mobius_fed.settings import ENV_PREFIX, NEST
from mobius_fed.transport.codec import CHUNK_BYTES

MAX_CHUNK = 4 << 20
MAX_WINDOW = (1 << 31) - 1


_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
_DELAY_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}


class UnitError(ValueError):
    """A bad rate or delay: the message names the value."""


def parse_rate(text: str) -> int:
    """``"1gbit"``, ``"100mbit"``, ``"500kbit"`` or plain bits/s → bits per second."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*", text.lower())
    if not m or m.group(2) not in ("", *_RATE_UNITS):
        raise UnitError(f"rate {text!r}: expected e.g. 1gbit, 100mbit, 500kbit")
    bits = float(m.group(1)) * _RATE_UNITS.get(m.group(2) or "bit", 1)
    if bits < 8_000:
        raise UnitError(f"rate {text!r}: at least 8kbit")
    return int(bits)


def parse_delay(text: str) -> float:
    """``"25ms"``, ``"0.5s"``, ``"300us"`` → seconds (one way)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(us|ms|s)\s*", text.lower())
    if not m:
        raise UnitError(f"delay {text!r}: expected e.g. 25ms, 0.1s, 300us")
    delay = float(m.group(1)) * _DELAY_UNITS[m.group(2)]
    if delay > 10:
        raise UnitError(f"delay {text!r}: at most 10s")
    return delay


class LinkTuningError(ValueError):
    """A link setting that was removed or renamed; the message names the new one."""


@dataclass(frozen=True)
class LinkTuning:
    """The gRPC arguments both ends of a ring link use (built by :class:`LinkConfig`)."""

    window: int | None = None
    chunk: int = CHUNK_BYTES
    socket_buffer: int | None = None
    bdp_probe: bool = True
    allocator: bool = True  # tune glibc malloc for the link's buffers (transport.allocator)

    @classmethod
    def for_path(cls, rate: int, rtt: float, **explicit) -> LinkTuning:
        """Sized for a path of ``rate`` bits/s and ``rtt`` seconds: the stream window starts
        at 2 × BDP (BDP probing may still grow it); explicit values win. Pieces and
        socket buffers keep their defaults unless given: on the shaped testbed link smaller
        pieces and fixed socket buffers measured slower than 1 MiB pieces and kernel
        autotuning (benchmarks/wan.py link)."""
        bdp = max(1, int(rate / 8 * rtt))
        sized: dict = {"window": min(MAX_WINDOW, 2 * bdp)}
        sized.update({k: v for k, v in explicit.items() if v is not None})
        return cls(**sized)

    def grpc_options(self) -> list[tuple[str, int]]:
        """Channel/server arguments (both ends of a link use the same)."""
        opts: list[tuple[str, int]] = [("grpc.http2.bdp_probe", int(self.bdp_probe))]
        if self.window is not None:
            opts.append(("grpc.http2.lookahead_bytes", self.window))
        if self.socket_buffer is not None:
            opts += [
                ("grpc.experimental.tcp_receive_buffer_size", self.socket_buffer),
                ("grpc.experimental.tcp_send_buffer_size", self.socket_buffer),
            ]
        return opts


class LinkConfig(BaseModel):
    """A worker's ring-link tuning: ``[worker.link]`` in TOML, ``MOBIUS_LINK__*``
    variables, ``--link-*`` flags. Changes no math."""

    model_config = ConfigDict(extra="forbid")

    rate: str | None = Field(
        None,
        description="path rate hint (e.g. 1gbit, 100mbit); with rtt, the HTTP/2 stream "
        "window starts at 2 × rate × rtt",
    )
    rtt: str | None = Field(None, description="path round-trip time hint (e.g. 50ms)")
    window: int | None = Field(
        None,
        gt=0,
        le=MAX_WINDOW,
        description="initial HTTP/2 stream window, bytes (unset: 2 × BDP with a path hint, "
        "else gRPC's)",
    )
    chunk: int = Field(
        CHUNK_BYTES,
        gt=0,
        le=MAX_CHUNK,
        description="largest tensor piece per message, bytes; every worker of a ring must "
        "use the same value",
    )
    socket_buffer: int | None = Field(
        None, gt=0, description="fixed kernel socket buffers, bytes (unset: autotuning)"
    )
    bdp_probe: bool = Field(
        True, description="gRPC's BDP probing, which grows the HTTP/2 window to the path"
    )
    allocator: Literal["tuned", "system"] = Field(
        "tuned",
        description="tuned: this process keeps buffers below 32 MiB on the malloc heap "
        "(fewer page faults per frame, glibc only); system: malloc as configured",
    )

    @field_validator("rate", "rtt")
    @classmethod
    def _parses(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v is not None:
            {"rate": parse_rate, "rtt": parse_delay}[str(info.field_name)](v)
        return v

    @model_validator(mode="after")
    def _path(self) -> LinkConfig:
        if (self.rate is None) != (self.rtt is None):
            given, missing = ("rate", "rtt") if self.rtt is None else ("rtt", "rate")
            raise ValueError(f"{given} is set but {missing} is not: give both or neither")
        return self

    def tuning(self) -> LinkTuning:
        """The gRPC arguments these settings give."""
        explicit = self.model_dump(include={"window", "chunk", "socket_buffer", "bdp_probe"})
        explicit["allocator"] = self.allocator == "tuned"
        if self.rate is not None and self.rtt is not None:
            return LinkTuning.for_path(parse_rate(self.rate), parse_delay(self.rtt), **explicit)
        return LinkTuning(**{k: v for k, v in explicit.items() if v is not None})


_RENAMED = ("RATE", "RTT", "WINDOW", "CHUNK", "SOCKET_BUFFER", "BDP_PROBE")


def refuse_renamed_variables(environ: Mapping[str, str]) -> None:
    """The ``MOBIUS_LINK_<X>`` process variables became the ``link`` settings
    (``MOBIUS_LINK__<X>``): one still set is an error naming its replacement, so that a
    tuning does not silently stop applying."""
    for name in _RENAMED:
        old, new = f"{ENV_PREFIX}LINK_{name}", f"{ENV_PREFIX}LINK{NEST}{name}"
        if environ.get(old, "") != "":
            flag = "--link-" + name.lower().replace("_", "-")
            raise LinkTuningError(
                f"{old} is no longer read: use {new} (or {flag}, or "
                f"{name.lower()} in [worker.link])"
            )
