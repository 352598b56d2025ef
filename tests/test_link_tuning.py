"""Ring-link tuning as worker settings (``[worker.link]``, ``MOBIUS_LINK__*``, ``--link-*``):
values reach both ends of a real link, bad values and renamed variables are refused with
the setting's name, and the allocator lever applies."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mobius_fed.config import TrainConfig
from mobius_fed.settings import ENV_PREFIX, ConfigError
from mobius_fed.transport.allocator import allocator_tuned
from mobius_fed.transport.certs import CertLayout, init_certs
from mobius_fed.transport.codec import chunk_count, max_message_bytes
from mobius_fed.transport.link_tuning import LinkConfig, LinkTuningError
from mobius_fed.worker.config import load_worker_config
from mobius_fed.worker.daemon import make_links
from mobius_fed.worker.frames import FORWARD, TRAIN, FrameKey, FrameRules
from mobius_fed.worker.link import RingLinks

STATIC = {
    "MOBIUS_RANK": "0",
    "MOBIUS_PEERS": "127.0.0.1:7001,127.0.0.1:7002",
    "MOBIUS_WORKERS": "2",
    "MOBIUS_DATA_DIR": "site",
    "MOBIUS_INSECURE": "true",
}


def _load(environ: dict[str, str], flags: dict | None = None, path: Path | None = None):
    return load_worker_config(path, flags=flags, environ={**STATIC, **environ})


def test_toml_env_and_flags_set_the_link_settings(tmp_path: Path) -> None:
    toml = tmp_path / "worker.toml"
    toml.write_text('[worker.link]\nchunk = 262144\nrate = "100mbit"\nrtt = "20ms"\n')
    cfg = _load({}, path=toml)
    assert (cfg.link.chunk, cfg.link.rate, cfg.link.rtt) == (262144, "100mbit", "20ms")
    env = {"MOBIUS_LINK__RATE": "1gbit", "MOBIUS_LINK__RTT": "50ms", "MOBIUS_LINK__CHUNK": "524288"}
    cfg = _load(env, flags={"link__chunk": 131072, "link__bdp_probe": False}, path=toml)
    assert (cfg.link.rate, cfg.link.rtt) == ("1gbit", "50ms")  # env beats the file
    assert cfg.link.chunk == 131072 and cfg.link.bdp_probe is False  # flags beat env
    tuning = cfg.link.tuning()
    assert tuning.window == 2 * 6_250_000 and tuning.chunk == 131072
    assert ("grpc.http2.bdp_probe", 0) in tuning.grpc_options()


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"MOBIUS_LINK__CHUNK": "lots"}, "link.chunk (from MOBIUS_LINK__CHUNK='lots')"),
        ({"MOBIUS_LINK__CHUNK": str(8 << 20)}, "link.chunk (from MOBIUS_LINK__CHUNK="),
        ({"MOBIUS_LINK__WINDOW": "0"}, "link.window (from MOBIUS_LINK__WINDOW='0')"),
        ({"MOBIUS_LINK__RATE": "fast", "MOBIUS_LINK__RTT": "1ms"}, "rate 'fast'"),
        ({"MOBIUS_LINK__RTT": "50"}, "delay '50'"),
        ({"MOBIUS_LINK__RATE": "1gbit"}, "link: rate is set but rtt is not"),
        ({"MOBIUS_LINK__ALLOCATOR": "jemalloc"}, "link.allocator"),
        ({"MOBIUS_LINK__BDP_PROBE": "maybe"}, "link.bdp_probe"),
    ],
)
def test_bad_link_values_name_the_setting(env: dict[str, str], expected: str) -> None:
    with pytest.raises(ConfigError, match="invalid worker configuration") as err:
        _load(env)
    assert expected in str(err.value)


def test_renamed_variables_are_refused_with_the_new_name(monkeypatch) -> None:
    old = ENV_PREFIX + "LINK_CHUNK"  # the process variable read before the link settings
    with pytest.raises(ConfigError, match=f"{old} is no longer read: use MOBIUS_LINK__CHUNK"):
        _load({old: "262144"})
    monkeypatch.setenv(ENV_PREFIX + "LINK_RTT", "50ms")  # a link built without settings
    rules = FrameRules(TrainConfig(preset="cpu-tiny", workers=2), 0, "r", lambda: 0)
    with pytest.raises(LinkTuningError, match=r"use MOBIUS_LINK__RTT \(or --link-rtt"):
        RingLinks(rules, listen="127.0.0.1:0", successor="", tls=None, insecure=True)


def test_worker_flags_name_their_variables() -> None:
    from mobius_fed.cli.worker import build_parser

    helps = {o: a.help for a in build_parser()._actions for o in a.option_strings}
    for flag, var in (("--link-rate", "MOBIUS_LINK__RATE"), ("--link-chunk", "MOBIUS_LINK__CHUNK")):
        assert var in helps[flag]
    assert "--no-link-bdp-probe" in helps and "--link-grace" in helps


def test_set_values_reach_both_ends_of_the_link(tmp_path: Path) -> None:
    env = {
        "MOBIUS_LINK__RATE": "1gbit",
        "MOBIUS_LINK__RTT": "40ms",
        "MOBIUS_LINK__SOCKET_BUFFER": "4194304",
        "MOBIUS_LINK__CHUNK": "65536",
    }
    cfg = _load(env, flags={"link__bdp_probe": False})
    rules = FrameRules(cfg.train, 0, cfg.run_id, lambda: 0)
    links = make_links(cfg, SimpleNamespace(rules=rules, rank=0))  # what the daemon builds
    assert links is not None
    expected = {
        ("grpc.http2.lookahead_bytes", 2 * 5_000_000),
        ("grpc.http2.bdp_probe", 0),
        ("grpc.experimental.tcp_receive_buffer_size", 4 << 20),
        ("grpc.experimental.tcp_send_buffer_size", 4 << 20),
        ("grpc.max_receive_message_length", max_message_bytes(65536)),
    }
    assert expected <= set(links._channel_options())
    assert expected <= set(links._server_options())
    assert links.chunk_bytes == 65536


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> CertLayout:
    return init_certs(tmp_path_factory.mktemp("certs"), workers=2)


def test_a_tuned_link_carries_a_tensor_exactly_in_its_piece_size(certs: CertLayout) -> None:
    """Two real links over mTLS with a non-default tuning (small pieces, a path hint, BDP
    probing off): the tensor arrives bit for bit, in as many pieces as the setting says."""
    link_cfg = LinkConfig(chunk=2048, rate="100mbit", rtt="10ms", bdp_probe=False)
    train = TrainConfig(preset="cpu-tiny", workers=2, batch_size=2)
    links = [
        RingLinks(
            FrameRules(train, r, "tuned", lambda: 0),
            listen="127.0.0.1:0",
            successor="",
            tls=certs.bundle(f"worker-{r}"),
            peer_timeout=20,
            tuning=link_cfg.tuning(),
        )
        for r in range(2)
    ]
    ports = [link.start_server() for link in links]
    for r, link in enumerate(links):
        link.successor_addr = f"127.0.0.1:{ports[1 - r]}"
        link.connect()
    try:
        x = torch.randn(links[0].rules.shape, generator=torch.Generator().manual_seed(1))
        key = FrameKey(TRAIN, 0, FORWARD, 0, 1, 0)
        links[0].send_tensor(key, x)
        got = links[1].inbox.get(key, 20, "the tuned tensor")
        assert torch.equal(got.view(torch.int32), x.view(torch.int32))
        assert links[0].forward_out.frames_sent == chunk_count(x.numel(), 4, 2048) > 1
    finally:
        threads = [threading.Thread(target=link.close) for link in links]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert allocator_tuned()  # the default (tuned) allocator applied in this process


def test_allocator_setting_maps_to_the_tuning() -> None:
    assert LinkConfig().tuning().allocator is True
    assert LinkConfig(allocator="system").tuning().allocator is False
