"""A node holds only its own secrets: check_node_secrets on real certificate layouts."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from mobius_fed.transport import CertLayout, NodeTLS, init_certs
from mobius_fed.transport.tls import COMPOSE_HINT, SecretsError, check_node_secrets
from tests.cert_util import sign_leaf


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> CertLayout:
    return init_certs(tmp_path_factory.mktemp("pki") / "certs", 2)


def _bundle(certs: CertLayout, name: str, tmp_path: Path) -> NodeTLS:
    """A private copy of node ``name``'s bundle to tamper with."""
    d = tmp_path / name
    shutil.copytree(certs.bundle(name).cert.parent, d)
    return NodeTLS(d / "ca.crt", d / "tls.crt", d / "tls.key")


def test_every_bundle_passes(certs: CertLayout) -> None:
    for name in certs.names():
        check_node_secrets(certs.bundle(name))


def test_flat_certs_directory_is_refused_naming_the_ca_key(certs: CertLayout) -> None:
    with pytest.raises(SecretsError) as err:
        check_node_secrets(certs.node("worker-0"))
    msg = str(err.value)
    assert str(certs.ca_key) in msg and "CA key" in msg
    assert COMPOSE_HINT in msg and "Engine >= 26" in msg
    assert isinstance(err.value, ValueError)


def test_ca_certificate_next_to_the_ca_key_is_refused(certs: CertLayout) -> None:
    b = certs.bundle("worker-1")
    with pytest.raises(SecretsError, match=r"ca\.key is the CA key"):
        check_node_secrets(NodeTLS(certs.ca_cert, b.cert, b.key))


def test_foreign_key_is_refused_naming_it(certs: CertLayout, tmp_path: Path) -> None:
    node = _bundle(certs, "worker-0", tmp_path)
    stolen = node.cert.parent / "backup.pem"  # not named *.key: found by content
    shutil.copy(certs.bundle("worker-1").key, stolen)
    with pytest.raises(SecretsError) as err:
        check_node_secrets(node)
    assert f"{stolen} holds another node's private key" in str(err.value)
    assert COMPOSE_HINT in str(err.value)


def test_ca_key_under_another_name_is_found_by_content(certs: CertLayout, tmp_path: Path) -> None:
    node = _bundle(certs, "coordinator", tmp_path)
    hidden = node.cert.parent / "extra.crt"  # a certificate file with the CA key appended
    hidden.write_bytes(certs.ca_cert.read_bytes() + certs.ca_key.read_bytes())
    with pytest.raises(SecretsError, match=rf"{hidden} holds the CA key"):
        check_node_secrets(node)


def test_key_not_matching_the_certificate_is_refused(certs: CertLayout, tmp_path: Path) -> None:
    node = _bundle(certs, "worker-0", tmp_path)
    shutil.copy(certs.bundle("worker-1").key, node.key)
    with pytest.raises(SecretsError, match=rf"{node.key} does not match certificate {node.cert}"):
        check_node_secrets(node)


def test_own_key_used_as_node_key_must_not_be_the_ca_key(certs: CertLayout, tmp_path: Path) -> None:
    d = tmp_path / "n"
    d.mkdir()
    shutil.copy(certs.ca_cert, d / "ca.crt")
    shutil.copy(certs.ca_cert, d / "tls.crt")
    shutil.copy(certs.ca_key, d / "tls.key")
    with pytest.raises(SecretsError, match=r"tls\.key is the CA key"):
        check_node_secrets(NodeTLS(d / "ca.crt", d / "tls.crt", d / "tls.key"))


def test_unidentifiable_keys_are_refused(certs: CertLayout, tmp_path: Path) -> None:
    node = _bundle(certs, "worker-0", tmp_path)
    key = ec.generate_private_key(ec.SECP256R1())
    enc = node.cert.parent / "old.key"
    enc.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"secret"),
        )
    )
    with pytest.raises(SecretsError, match=rf"{enc} holds a private key this node cannot identify"):
        check_node_secrets(node)
    enc.unlink()
    der = node.cert.parent / "other.key"  # a DER key is read too
    der.write_bytes(
        key.private_bytes(
            serialization.Encoding.DER,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    with pytest.raises(SecretsError, match=rf"{der} holds another node's private key"):
        check_node_secrets(node)


def test_own_key_copies_and_subdirectories_are_fine(certs: CertLayout, tmp_path: Path) -> None:
    node = _bundle(certs, "worker-1", tmp_path)
    shutil.copy(node.key, node.cert.parent / "tls.key.bak")  # the node's own key again
    (node.cert.parent / "README.txt").write_text("nothing secret")
    sub = node.cert.parent / "archive"  # only the directory itself is scanned
    sub.mkdir()
    shutil.copy(certs.ca_key, sub / "ca.key")
    check_node_secrets(node)


def test_kubernetes_style_symlinked_secret_passes(certs: CertLayout, tmp_path: Path) -> None:
    d = tmp_path / "mounted"
    data = d / "..2026_01_01_00_00_00.000000001"
    data.mkdir(parents=True)
    for f in ("ca.crt", "tls.crt", "tls.key"):
        shutil.copy(certs.bundle("worker-0").cert.parent / f, data / f)
    (d / "..data").symlink_to(data.name)
    for f in ("ca.crt", "tls.crt", "tls.key"):
        (d / f).symlink_to(f"..data/{f}")
    check_node_secrets(NodeTLS(d / "ca.crt", d / "tls.crt", d / "tls.key"))


def test_certificate_with_two_identities_is_refused(certs: CertLayout, tmp_path: Path) -> None:
    forged = sign_leaf(certs.root, tmp_path / "f", ["mobius://worker/0", "mobius://worker/1"], "w")
    d = tmp_path / "n"
    d.mkdir()
    shutil.copy(certs.ca_cert, d / "ca.crt")
    shutil.copy(forged.cert, d / "tls.crt")
    shutil.copy(forged.key, d / "tls.key")
    with pytest.raises(SecretsError, match="certificate carries 2 mobius:// URIs"):
        check_node_secrets(NodeTLS(d / "ca.crt", d / "tls.crt", d / "tls.key"))


def test_missing_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"CA certificate not found: .*ca\.crt"):
        check_node_secrets(NodeTLS(tmp_path / "ca.crt", tmp_path / "tls.crt", tmp_path / "k"))
