"""Revocation (docs/security.md "Revocation"): ``certs revoke`` writes a CA-signed X.509 CRL,
nodes verify it against their CA, and every incoming call checks it. The live test revokes
a running worker's certificate: the coordinator refuses it within one heartbeat and counts
it lost, its successor refuses its stream, and the run heals (the site comes back with a
renewed key) to the undisturbed run's losses.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from cryptography import x509

from mobius_fed.config import TrainConfig
from mobius_fed.transport.certs import init_certs, renew_node
from mobius_fed.transport.revocation import (
    CRL_FILE,
    CrlState,
    RevocationError,
    apply_crl,
    read_crl,
    revoke,
    verified_serials,
)
from mobius_fed.transport.tls import NodeTLS, open_channel, revoked_serials, set_revoked
from mobius_fed.worker.frames import FrameRules
from mobius_fed.worker.link import RingLinks

REPO = Path(__file__).resolve().parents[1]
RUN = "revocation-test"


@pytest.fixture(autouse=True)
def _no_revocations_left_over():
    """The revoked serials are process-wide: every test starts and ends with none."""
    set_revoked(())
    yield
    set_revoked(())


def _serial(tls: NodeTLS) -> int:
    return x509.load_pem_x509_certificate(tls.cert.read_bytes()).serial_number


def test_revoke_writes_a_signed_list_of_a_nodes_certificates(tmp_path: Path) -> None:
    layout = init_certs(tmp_path / "c", 3)
    first = _serial(layout.bundle("worker-1"))
    renew_node(layout.root, "worker-1")
    second = _serial(layout.bundle("worker-1"))
    done = revoke(layout.root, ["worker-1"])
    assert set(done) == {first, second}  # every certificate of worker-1 on record
    crl = read_crl((layout.root / CRL_FILE).read_bytes())
    assert verified_serials(crl, layout.ca_cert.read_bytes()) == {first, second}
    for node in layout.names():  # each bundle carries the list for its node
        assert (layout.bundle(node).ca.parent / CRL_FILE).read_bytes() == (
            layout.root / CRL_FILE
        ).read_bytes()
    w0 = _serial(layout.bundle("worker-0"))
    revoke(layout.root, [str(w0)])  # by serial; the earlier entries stay
    crl = read_crl((layout.root / CRL_FILE).read_bytes())
    assert {r.serial_number for r in crl} == {first, second, w0}
    with pytest.raises(RevocationError, match="neither a node name"):
        revoke(layout.root, ["worker-x"])
    with pytest.raises(RevocationError, match="no certificate of worker-7"):
        revoke(layout.root, ["worker-7"])


def test_a_list_from_another_ca_or_an_older_list_is_not_taken(tmp_path: Path) -> None:
    ours = init_certs(tmp_path / "ours", 2)
    theirs = init_certs(tmp_path / "theirs", 2)
    revoke(theirs.root, ["worker-0"])
    with pytest.raises(RevocationError, match="not signed by this node's CA"):
        verified_serials(read_crl((theirs.root / CRL_FILE).read_bytes()), ours.ca_cert.read_bytes())
    assert not apply_crl((theirs.root / CRL_FILE).read_bytes(), ours.bundle("worker-1"), "x")
    assert revoked_serials() == frozenset()
    revoke(ours.root, ["worker-0"])
    older = (ours.root / CRL_FILE).read_bytes()
    time.sleep(1.1)
    revoke(ours.root, ["worker-1"])
    newer = (ours.root / CRL_FILE).read_bytes()
    state = CrlState()
    assert state.apply(newer, ours.ca_cert.read_bytes(), "newer")
    assert len(revoked_serials()) == 2
    assert not state.apply(older, ours.ca_cert.read_bytes(), "older")  # no roll-back
    assert len(revoked_serials()) == 2


def _stream(addr: str, tls: NodeTLS) -> tuple[grpc.StatusCode, str]:
    with open_channel(addr, tls, target_name="worker-1") as ch:
        call = ch.stream_stream(
            "/mobius_fed.ring.v1.RingLink/Stream",
            request_serializer=None,
            response_deserializer=None,
        )
        it = call(iter(()), metadata=[("mobius-run", RUN), ("mobius-ack", "0")], timeout=10)
        try:
            if "mobius-session" in dict(it.initial_metadata() or ()):
                it.cancel()
                return grpc.StatusCode.OK, ""
            for _ in it:
                pass
        except grpc.RpcError as exc:
            return exc.code(), exc.details() or ""
        return it.code(), it.details() or ""


def test_a_ring_server_refuses_a_revoked_predecessor(tmp_path: Path) -> None:
    """Real ring server over mTLS: worker-0 is offered a session, then refused once its
    certificate is on the list the server enforces; the renewed worker-0 is offered one."""
    layout = init_certs(tmp_path / "c", 3)
    old = NodeTLS(*(tmp_path / "old" / f for f in ("ca.crt", "tls.crt", "tls.key")))
    shutil.copytree(layout.bundle("worker-0").cert.parent, old.cert.parent)
    cfg = TrainConfig(preset="cpu-base", batch_size=8, workers=3)
    w1 = RingLinks(
        FrameRules(cfg, 1, RUN, lambda: 0),
        listen="127.0.0.1:0",
        successor="127.0.0.1:9",
        tls=layout.bundle("worker-1"),
        peer_timeout=5,
    )
    addr = f"127.0.0.1:{w1.start_server()}"
    try:
        assert _stream(addr, old)[0] == grpc.StatusCode.OK
        renew_node(layout.root, "worker-0")
        revoke(layout.root, [str(_serial(old))])
        assert apply_crl((layout.root / CRL_FILE).read_bytes(), layout.bundle("worker-1"), "t")
        code, details = _stream(addr, old)
        assert code == grpc.StatusCode.PERMISSION_DENIED, (code, details)
        assert "is revoked" in details, details
        assert _stream(addr, layout.bundle("worker-0"))[0] == grpc.StatusCode.OK
    finally:
        w1.close()


def test_certs_revoke_on_the_command_line(tmp_path: Path) -> None:
    layout = init_certs(tmp_path / "c", 2)
    renewed = subprocess.run(
        [
            sys.executable,
            "-m",
            "mobius_fed.cli.main",
            "certs",
            "renew",
            "--node",
            "worker-1",
            "--out",
            str(layout.root),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert renewed.returncode == 0, renewed.stderr
    old = renewed.stdout.split("(serial ")[1].split(")")[0]
    assert f"certs revoke {old} --ca" in renewed.stdout
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "mobius_fed.cli.main",
            "certs",
            "revoke",
            old,
            "--ca",
            str(layout.root),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert done.returncode == 0 and f"serial {old}" in done.stdout, done.stderr
    crl = read_crl((layout.root / CRL_FILE).read_bytes())
    assert [r.serial_number for r in crl] == [int(old)]


# --------------------------------------------------------------------------- live ring
@pytest.mark.slow(reason="a ring revokes a live worker, waits for its heartbeat and heals")
def test_a_live_ring_refuses_a_revoked_worker_and_heals(tmp_path: Path) -> None:
    """Revoke worker-2's certificate while the ring trains (its site got a renewed key):
    within one heartbeat the coordinator refuses it and counts it lost, worker-3 refuses
    the old certificate's stream, the old process stops, the supervisor starts worker-2
    again with its renewed bundle, and the run ends with the undisturbed run's losses."""
    from tests.test_recovery import federation, finish, wait_for_step

    # long enough that the run is still training when the revocation lands (warm-started
    # daemons reach step 3 and finish 12 steps within the list's poll interval)
    fed = federation(tmp_path, steps=40).prepare().start()
    old = NodeTLS(*(tmp_path / "old" / f for f in ("ca.crt", "tls.crt", "tls.key")))
    shutil.copytree(fed.bundle("worker-2").cert.parent, old.cert.parent)
    try:
        doc = wait_for_step(fed, 2)
        w3 = doc["workers"][3]["address"]
        renew_node(fed.certs, "worker-2")
        revoke(fed.certs, [str(_serial(old))])
        t0 = time.monotonic()
        coordinator_log = fed.logs / "coordinator.log"
        while "certificate is revoked" not in coordinator_log.read_text():
            assert time.monotonic() - t0 < 10, fed.tail("coordinator", 40)
            time.sleep(0.1)
        assert time.monotonic() - t0 < 3.5  # one heartbeat (1 s) and the list's poll (1 s)
        # worker-3 re-listens once the ring re-forms (refused connections meanwhile)
        deadline = time.monotonic() + 90
        while (code := _stream_to(w3, old))[0] != grpc.StatusCode.PERMISSION_DENIED:
            assert code[0] == grpc.StatusCode.UNAVAILABLE, code  # never a session
            assert time.monotonic() < deadline, code
            fed.supervise()  # restarts worker-2, now with its renewed bundle
            time.sleep(0.2)
        assert "is revoked" in code[1], code
    except BaseException:
        fed.stop()
        raise
    final = finish(fed)
    inc = [i for i in final["incidents"] if i["rank"] == 2]
    assert inc and all(i["state"] == "recovered" for i in inc), final["incidents"]
    assert fed.restarts.get("worker-2", 0) >= 1
    assert "revoked" in (fed.logs / "worker-2.log").read_text()


def _stream_to(addr: str, tls: NodeTLS) -> tuple[grpc.StatusCode, str]:
    with open_channel(addr, tls, target_name="worker-3") as ch:
        call = ch.stream_stream(
            "/mobius_fed.ring.v1.RingLink/Stream",
            request_serializer=None,
            response_deserializer=None,
        )
        it = call(iter(()), metadata=[("mobius-run", "x"), ("mobius-ack", "0")], timeout=10)
        try:
            for _ in it:
                pass
        except grpc.RpcError as exc:
            return exc.code(), exc.details() or ""
        return it.code(), it.details() or ""
