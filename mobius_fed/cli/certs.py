"""``mobius-fed certs``: the CA, node keys and certificates (see docs/keys.md).

Keys that never leave their site: ``ca`` (admin, once), ``request`` (at the site: key and
signing request), ``sign`` (admin: checks the request, returns a certificate), ``check`` (at
the site: the bundle the daemon will use). ``init`` makes every key in one place, for labs
and ``mobius-fed up``; ``renew`` and ``rotate`` work on what ``init`` made.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from mobius_fed.cli.common import CliError


def cmd_certs_init(args: argparse.Namespace) -> int:
    from mobius_fed.transport.certs import init_certs

    if args.if_missing and (Path(args.out) / "ca.crt").is_file():
        print(f"certificates already in {args.out}; nothing to do")
        return 0
    layout = init_certs(
        Path(args.out),
        args.workers,
        args.host or (),
        overwrite=args.overwrite,
        standbys=args.standbys,
    )
    extra = f", {args.standbys} standby site(s)" if args.standbys else ""
    print(
        f"CA and certificates for {args.workers} workers, coordinator, operator{extra} in "
        f"{layout.root}"
    )
    return 0


def cmd_certs_renew(args: argparse.Namespace) -> int:
    from mobius_fed.transport.certs import identity_of, renew_node
    from mobius_fed.transport.tls import certificate_serial

    old = Path(args.out) / f"{args.node}.crt"
    serial = certificate_serial(old.read_bytes()) if old.is_file() else None
    try:
        node = renew_node(Path(args.out), args.node, args.host or (), days=args.days)
    except KeyError as exc:
        raise CliError(str(exc)) from None
    print(
        f"new key and certificate for {args.node} ({identity_of(args.node)}) in "
        f"{node.cert.parent}: deploy it to that node only. Its old certificate (serial "
        f"{serial}) stays valid until it expires; `mobius-fed certs revoke {serial} --ca "
        f'{args.out}` cuts it off now (docs/security.md "Revocation").'
    )
    return 0


def cmd_certs_rotate(args: argparse.Namespace) -> int:
    from mobius_fed.transport.certs import rotate_ca

    layout = rotate_ca(Path(args.out), args.host or (), days=args.days)
    print(
        f"new CA and certificates for {layout.workers} workers, coordinator, operator in "
        f"{layout.root}: deploy every nodes/<node>/ bundle and restart every node"
    )
    return 0


def cmd_certs_ca(args: argparse.Namespace) -> int:
    from mobius_fed.transport.enroll import make_ca

    out = Path(args.out)
    if args.if_missing and (out / "ca.crt").is_file() and (out / "ca.key").is_file():
        print(f"a CA is already in {out}; nothing to do")
        return 0
    make_ca(out, days=args.days, overwrite=args.overwrite)
    print(
        f"CA in {out} (ca.key stays on this machine) and the operator's client certificate "
        f"(operator.crt/.key, for `mobius-fed status --certs {out}`). Sign each node's "
        f"request: mobius-fed certs sign NODE.csr --node NODE --ca {out}"
    )
    return 0


def cmd_certs_request(args: argparse.Namespace) -> int:
    from mobius_fed.transport.enroll import KEY_FILE, request_node

    out = Path(args.out or args.node)
    csr = Path(args.csr_dir or out) / f"{args.node}.csr"
    key = args.key
    if args.if_missing and (out / KEY_FILE).is_file():
        if csr.is_file():
            print(f"{out / KEY_FILE} and {csr} exist; nothing to do")
            return 0
        key = key or out / KEY_FILE  # the request went missing: ask again for the same key
    req = request_node(
        args.node,
        out,
        args.host or (),
        key=key,
        overwrite=args.overwrite,
        csr_dir=args.csr_dir,
        readable_key=args.allow_readable_key,
    )
    kept = "the key" if key else "a new key (mode 0600)"
    print(
        f"{kept} in {req.key} and a signing request for {req.identity} in {req.csr}. "
        f"Send {req.csr.name} to the admin (it holds no secret); keep {req.key.name} here. "
        f"Put the tls.crt and ca.crt that come back next to it, then: "
        f"mobius-fed certs check --node {args.node} --dir {req.key.parent}"
    )
    return 0


def cmd_certs_sign(args: argparse.Namespace) -> int:
    from mobius_fed.transport.enroll import sign_request

    if len(args.csr) != len(args.node):
        raise CliError(
            f"{len(args.csr)} request(s) but {len(args.node)} --node: give one --node per "
            "request, in the same order (the node each one must be for)"
        )
    for csr, node in zip(args.csr, args.node, strict=True):
        signed = sign_request(
            Path(csr), node, Path(args.ca), args.out, days=args.days, wildcards=args.allow_wildcard
        )
        print(
            f"signed {node} ({signed.identity}) until {signed.not_after:%Y-%m-%d}: send "
            f"{signed.cert} and {signed.ca} to its site"
        )
        # one a line, escaped: a name can never rewrite or hide a line of this terminal
        names = [h.encode("unicode_escape").decode("ascii") for h in signed.hosts]
        print(f"  extra names: {names[0] if names else 'none'}")
        for name in names[1:]:
            print(f"               {name}")
    return 0


def cmd_certs_check(args: argparse.Namespace) -> int:
    from mobius_fed.transport.enroll import CA_FILE, CERT_FILE, KEY_FILE, check_bundle
    from mobius_fed.transport.tls import NodeTLS

    d = Path(args.dir)
    tls = NodeTLS(
        Path(args.ca or d / CA_FILE),
        Path(args.cert or d / CERT_FILE),
        Path(args.key or d / KEY_FILE),
    )
    cert = check_bundle(args.node, tls, readable_key=args.allow_readable_key or None)
    print(
        f"ok: {tls.cert} is {args.node}'s, signed by the CA in {tls.ca}, valid until "
        f"{cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC, with its key {tls.key} and no "
        "other secret beside it"
    )
    return 0


def cmd_certs_revoke(args: argparse.Namespace) -> int:
    from mobius_fed.transport.revocation import CRL_FILE, RevocationError, revoke

    try:
        revoked = revoke(Path(args.ca), args.target)
    except RevocationError as exc:
        raise CliError(str(exc)) from None
    for serial, what in sorted(revoked.items()):
        print(f"revoked {what}: serial {serial}")
    print(
        f"signed list in {Path(args.ca) / CRL_FILE} (and every nodes/<node>/ bundle here): "
        "give it to the coordinator (beside its ca.crt); it hands it to every worker within "
        "one heartbeat"
    )
    return 0


NODE_HELP = "worker-<i>, standby-<n>, coordinator or operator"
READABLE_HELP = "only warn about a private key its group or others can read (docs/keys.md)"


def _add_lab_parsers(csub) -> None:
    c = csub.add_parser(
        "init", help="labs and `up`: a CA and every node's key and certificate in one place"
    )
    c.add_argument("--workers", type=int, required=True, help="P: one certificate per worker")
    c.add_argument(
        "--standbys",
        type=int,
        default=0,
        help="standby sites: one certificate each, standby-<n> (docs/recovery.md)",
    )
    c.add_argument("--out", type=Path, required=True, help="directory for the CA and bundles")
    c.add_argument("--host", action="append", help="extra DNS name or IP for every node")
    c.add_argument("--overwrite", action="store_true", help="replace existing certificates")
    c.add_argument(
        "--if-missing",
        action="store_true",
        help="do nothing when OUT/ca.crt exists (a one-shot init job)",
    )
    c.set_defaults(func=cmd_certs_init)
    c = csub.add_parser("renew", help="new key and certificate for one node, same identity")
    c.add_argument("--node", required=True, help=NODE_HELP)
    c.add_argument("--out", type=Path, required=True, help="the directory certs init wrote")
    c.add_argument("--host", action="append", help="extra DNS name or IP for the node")
    c.add_argument("--days", type=int, default=365, help="validity (default: 365)")
    c.set_defaults(func=cmd_certs_renew)
    c = csub.add_parser(
        "rotate", help="new CA and certificates for every node (old ones stop working)"
    )
    c.add_argument("--out", type=Path, required=True, help="the directory certs init wrote")
    c.add_argument("--host", action="append", help="extra DNS name or IP for every node")
    c.add_argument("--days", type=int, default=365, help="validity (default: 365)")
    c.set_defaults(func=cmd_certs_rotate)


def _add_enroll_parsers(csub) -> None:
    c = csub.add_parser("ca", help="admin, once: a CA and the operator's client certificate")
    c.add_argument("--out", type=Path, required=True, help="the CA directory (keep it private)")
    c.add_argument("--days", type=int, default=365, help="validity (default: 365)")
    c.add_argument("--overwrite", action="store_true", help="replace an existing CA")
    c.add_argument("--if-missing", action="store_true", help="do nothing when OUT has a CA")
    c.set_defaults(func=cmd_certs_ca)
    c = csub.add_parser(
        "request", help="at the site: this node's key (0600) and a signing request for it"
    )
    c.add_argument("--node", required=True, help=NODE_HELP)
    c.add_argument("--out", type=Path, help="directory for tls.key and NODE.csr (default: NODE)")
    c.add_argument("--host", action="append", help="extra DNS name or IP for this node")
    c.add_argument(
        "--key", type=Path, help="make the request for this key (your own PKI's; or to renew)"
    )
    c.add_argument("--csr-dir", type=Path, help="write NODE.csr there (default: OUT)")
    c.add_argument("--overwrite", action="store_true", help="replace an existing tls.key")
    c.add_argument(
        "--if-missing", action="store_true", help="do nothing when the key and request exist"
    )
    c.add_argument("--allow-readable-key", action="store_true", help=READABLE_HELP)
    c.set_defaults(func=cmd_certs_request)
    c = csub.add_parser("sign", help="admin: check a node's request and issue its certificate")
    c.add_argument("csr", nargs="+", help="NODE.csr from the site (several: one --node each)")
    c.add_argument(
        "--node", action="append", required=True, help="the node the request must be for"
    )
    c.add_argument("--ca", type=Path, required=True, help="the CA directory (certs ca or init)")
    c.add_argument("--out", type=Path, help="writes OUT/NODE/{tls.crt,ca.crt} (default: CA/signed)")
    c.add_argument("--days", type=int, default=365, help="validity (default: 365)")
    c.add_argument(
        "--allow-wildcard",
        action="store_true",
        help="sign an extra name whose whole first label is * (*.lab.example.org)",
    )
    c.set_defaults(func=cmd_certs_sign)
    c = csub.add_parser(
        "check", help="at the site: the bundle a daemon will use is this node's and sound"
    )
    c.add_argument("--node", required=True, help=NODE_HELP)
    c.add_argument("--dir", type=Path, default=Path("."), help="holds ca.crt, tls.crt, tls.key")
    c.add_argument("--ca", type=Path, help="CA certificate (default: DIR/ca.crt)")
    c.add_argument("--cert", type=Path, help="certificate (default: DIR/tls.crt)")
    c.add_argument("--key", type=Path, help="private key (default: DIR/tls.key)")
    c.add_argument("--allow-readable-key", action="store_true", help=READABLE_HELP)
    c.set_defaults(func=cmd_certs_check)
    c = csub.add_parser(
        "revoke", help="admin: revoke a node's certificates (or one serial): a signed list"
    )
    c.add_argument("target", nargs="+", help="a node name (all its certificates) or a serial")
    c.add_argument("--ca", type=Path, required=True, help="the CA directory (certs ca or init)")
    c.set_defaults(func=cmd_certs_revoke)


def register(sub) -> None:
    """Add ``certs`` to the ``mobius-fed`` subcommands."""
    p = sub.add_parser(
        "certs",
        help="certificate authority, node keys and certificates",
        description="Keys that never leave their site: `ca` at the admin, `request` at each "
        "site, `sign` at the admin, `check` at the site, `revoke` at the admin (docs/keys.md). "
        "`init` makes every "
        "key in one place, for labs and `mobius-fed up`.",
    )
    csub = p.add_subparsers(dest="certs_command", required=True, metavar="ACTION")
    _add_enroll_parsers(csub)
    _add_lab_parsers(csub)
