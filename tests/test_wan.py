"""Shaped WAN links in the namespace testbed: tbf holds the rate, the delay line the RTT."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from mobius_fed.testbed import Testbed, netns_available
from mobius_fed.testbed.wan import (
    WanError,
    WanShape,
    parse_delay,
    parse_rate,
    parse_site_shapes,
    send_buffer_bytes,
    tbf_args,
    wan_tools_missing,
)

REPO = Path(__file__).resolve().parents[1]
_REASON = netns_available()
_REASON = _REASON or wan_tools_missing([WanShape(10**8, 0.02)])
needs_netns = pytest.mark.skipif(_REASON is not None, reason=f"no namespace testbed: {_REASON}")


def test_parse_shapes_and_overrides():
    assert parse_rate("1gbit") == 10**9 and parse_rate("100mbit") == 10**8
    assert parse_delay("25ms") == pytest.approx(0.025) and parse_delay("1s") == 1.0
    base = WanShape(parse_rate("1gbit"), parse_delay("25ms"))
    shapes = parse_site_shapes(base, ["b:rate=100mbit,delay=50ms"], ["a", "b"])
    assert shapes == {"a": base, "b": WanShape(10**8, 0.05)}
    assert "burst" in tbf_args(10**9)
    for bad, call in (
        ("fast", lambda: parse_rate("fast")),
        ("25 parsecs", lambda: parse_delay("25 parsecs")),
        ("no service 'c'", lambda: parse_site_shapes(base, ["c:rate=1gbit"], ["a", "b"])),
        ("unknown key 'jitter'", lambda: parse_site_shapes(base, ["a:jitter=1ms"], ["a"])),
    ):
        with pytest.raises(WanError, match=bad):
            call()


def test_missing_wan_tools_are_named(monkeypatch):
    """A shaped testbed on a machine without tc/iptables names each tool and its package."""
    import mobius_fed.testbed.wan as wan

    monkeypatch.setattr(wan.shutil, "which", lambda tool: None)
    assert wan_tools_missing([WanShape()]) is None  # unshaped: nothing to exec
    only_rate = wan_tools_missing([WanShape(10**9, 0.0)])
    assert only_rate is not None and "tc," in only_rate and "iptables" not in only_rate
    both = wan_tools_missing([WanShape(10**9, 0.025)])
    assert both is not None and "tc and iptables" in both
    assert "apt-get install iproute2 iptables" in both


@needs_netns
def test_shaping_holds(tmp_path):
    """100 Mbit/s each way and 20 ms one way per site: one stream measures 100 Mbit/s
    and a round trip 40 ms, both within 10 %."""
    compose = tmp_path / "compose.yaml"
    compose.write_text(
        textwrap.dedent(
            f"""
            name: tbwan
            services:
              a:
                command: ["sleep", "300"]
              b:
                command: ["{sys.executable}", "-m", "mobius_fed.testbed.wan",
                          "probe-server", "--port", "7100"]
                environment:
                  PYTHONPATH: "{REPO}"
            """
        )
    )
    shape = WanShape(parse_rate("100mbit"), parse_delay("20ms"))
    with Testbed(compose, tmp_path / "root", wan={"a": shape, "b": shape}) as tb:
        tb.up(timeout=60)
        r = tb.exec(
            "a",
            [sys.executable, "-m", "mobius_fed.testbed.wan", "probe", "b:7100", "--seconds", "3"],
            timeout=60,
            env={"PYTHONPATH": str(REPO)},
            check=True,
        )
    got = json.loads(r.stdout)
    assert got["rtt_ms"] == pytest.approx(40.0, rel=0.10), got
    assert got["mbit_s"] == pytest.approx(100.0, rel=0.10), got


def test_send_buffers_hold_a_quarter_second_of_the_slowest_link():
    """A real host's 4 MiB send buffer is 32 ms at 1 Gbit/s; the testbed's slow links get
    buffers of the same order in time (SEND_BUFFER_S), so a keepalive ping's answer never
    queues behind 30 s of data on a 1 Mbit/s link."""
    slow, fast = WanShape(parse_rate("1mbit")), WanShape(parse_rate("1gbit"))
    assert send_buffer_bytes([fast, slow]) == 65536  # 31 kB: the 64 KiB floor
    assert send_buffer_bytes([fast]) == 10**9 // 8 // 4
    assert send_buffer_bytes([WanShape(parse_rate("8mbit"), 0.1)]) == 10**6 * 4 // 10  # 2 RTTs
    assert send_buffer_bytes([WanShape(None, 0.05)]) is None  # no rate: the host's default


@needs_netns
def test_every_namespace_of_a_shaped_testbed_has_the_send_buffer_cap(tmp_path):
    compose = tmp_path / "compose.yaml"
    compose.write_text('name: tbbuf\nservices:\n  a:\n    command: ["sleep", "60"]\n'
                       '  b:\n    command: ["sleep", "60"]\n')  # fmt: skip
    shape = WanShape(parse_rate("20mbit"))
    with Testbed(compose, tmp_path / "root", wan={"a": shape}) as tb:
        tb.up(timeout=30)
        for svc in ("a", "b"):  # b is unshaped, but its sends cross a's download
            got = tb.exec(svc, ["cat", "/proc/sys/net/ipv4/tcp_wmem"], timeout=10, check=True)
            assert got.stdout.split()[-1] == str(20_000_000 // 8 // 4), (svc, got.stdout)


def test_link_tuning_from_a_path_hint():
    """The path hint sizes the HTTP/2 window at 2 × BDP; explicit values win (the settings
    themselves: tests/test_link_tuning.py)."""
    from mobius_fed.transport.link_tuning import LinkConfig

    t = LinkConfig(rate="1gbit", rtt="50ms").tuning()
    assert t.window == 2 * 6_250_000 and t.bdp_probe and t.chunk == 1 << 20
    assert ("grpc.http2.lookahead_bytes", 12_500_000) in t.grpc_options()
    t = LinkConfig(rate="1gbit", rtt="50ms", window=1 << 20, chunk=262144).tuning()
    assert (t.window, t.chunk) == (1 << 20, 262144)
    off = LinkConfig(bdp_probe=False).tuning()
    assert off.grpc_options()[0] == ("grpc.http2.bdp_probe", 0) and off.window is None
