"""Flow control of ring links on long fat pipes: HTTP/2 windows, piece size, socket buffers.

A ring link must keep bandwidth × round-trip bytes in flight. gRPC's HTTP/2 transport
grows each stream's window by BDP probing (on by default), up to what the peer allows;
with probing off, a stream is capped at one window per round trip (64 KiB at 50 ms is
10 Mbit/s). :class:`LinkTuning` sizes everything from a path hint (``rate`` bits/s and
``rtt`` seconds) or takes explicit values:

* ``window``: the initial HTTP/2 stream window (``grpc.http2.lookahead_bytes``) — default
  2 × BDP when a path hint is given, else gRPC's own; BDP probing stays on unless
  ``bdp_probe`` is false;
* ``chunk``: the largest piece of a tensor per message (default 1 MiB, at most 4 MiB),
  so a window holds several pieces and each is validated and handed on while the next
  travels;
* ``socket_buffer``: fixed kernel socket buffers (``grpc.experimental.tcp_*_buffer_size``;
  default: kernel autotuning, which stops at ``tcp_rmem``'s maximum, 6 MiB by default —
  raise it with sysctl, or set this, on paths whose BDP is larger).

Every worker reads them from ``MOBIUS_LINK_RATE`` (e.g. ``1gbit``), ``MOBIUS_LINK_RTT``
(e.g. ``50ms``), ``MOBIUS_LINK_WINDOW``, ``MOBIUS_LINK_CHUNK``, ``MOBIUS_LINK_SOCKET_BUFFER``
(bytes) and ``MOBIUS_LINK_BDP_PROBE`` (0/1). They change no math: frames and their
order are the same whatever the tuning.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

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
    """A bad MOBIUS_LINK_* value; the message names the variable."""


@dataclass(frozen=True)
class LinkTuning:
    window: int | None = None
    chunk: int = CHUNK_BYTES
    socket_buffer: int | None = None
    bdp_probe: bool = True

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

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> LinkTuning:
        env = os.environ if environ is None else environ

        def number(name: str) -> int | None:
            text = env.get(f"MOBIUS_LINK_{name}")
            if text is None or text == "":
                return None
            try:
                value = int(text)
            except ValueError:
                raise LinkTuningError(f"MOBIUS_LINK_{name}={text!r}: expected bytes") from None
            if value <= 0:
                raise LinkTuningError(f"MOBIUS_LINK_{name}={text!r}: expected > 0")
            return value

        chunk = number("CHUNK")
        if chunk is not None and chunk > MAX_CHUNK:
            raise LinkTuningError(f"MOBIUS_LINK_CHUNK={chunk}: at most {MAX_CHUNK} bytes")
        explicit: dict = {
            "window": number("WINDOW"),
            "chunk": chunk,
            "socket_buffer": number("SOCKET_BUFFER"),
        }
        probe = env.get("MOBIUS_LINK_BDP_PROBE")
        if probe not in (None, ""):
            if probe not in ("0", "1"):
                raise LinkTuningError(f"MOBIUS_LINK_BDP_PROBE={probe!r}: expected 0 or 1")
            explicit["bdp_probe"] = probe == "1"
        rate, rtt = env.get("MOBIUS_LINK_RATE"), env.get("MOBIUS_LINK_RTT")
        try:
            if rate and rtt:
                return cls.for_path(parse_rate(rate), parse_delay(rtt), **explicit)
        except UnitError as exc:
            raise LinkTuningError(f"MOBIUS_LINK_RATE/RTT: {exc}") from exc
        return cls(**{k: v for k, v in explicit.items() if v is not None})

    def grpc_options(self) -> list[tuple[str, int]]:
        """Channel/server arguments (both ends of a link use the same)."""
        opts = [("grpc.http2.bdp_probe", int(self.bdp_probe))]
        if self.window is not None:
            opts.append(("grpc.http2.lookahead_bytes", self.window))
        if self.socket_buffer is not None:
            opts += [
                ("grpc.experimental.tcp_receive_buffer_size", self.socket_buffer),
                ("grpc.experimental.tcp_send_buffer_size", self.socket_buffer),  # type: ignore[list-item]
            ]
        return opts
