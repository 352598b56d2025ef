"""``mobius-relay`` (also ``mobius-fed relay``): splice ring edges whose two workers both
only dial out. Torch-free. See docs/reachability.md."""

from __future__ import annotations

import argparse
import logging
import sys
import threading
from pathlib import Path

from mobius_fed.cli.common import CliError, run_guarded

DESCRIPTION = """\
Run a relay for ring edges where neither worker accepts connections (both --reachable no).
Both workers dial it; it pairs their tunnels per edge and forwards their end-to-end mTLS
bytes without terminating TLS. Tunnels must be signed with the key in --key-file, which the
workers that use this relay hold as --relay-key (MOBIUS_RELAY_KEY)."""


def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--listen",
        default="0.0.0.0:7100",
        help="where workers dial the relay (default 0.0.0.0:7100)",
    )
    p.add_argument(
        "--key-file",
        type=Path,
        default=None,
        help="the relay's shared key (mode 0600; make one with --init-key)",
    )
    p.add_argument(
        "--status-listen",
        default=None,
        metavar="HOST:PORT",
        help="plain HTTP GET /status (JSON: bytes per edge); default off",
    )
    p.add_argument(
        "--init-key",
        type=Path,
        default=None,
        metavar="FILE",
        help="write a new random key to FILE (0600) and exit",
    )
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])


def register(sub) -> None:
    """Add ``relay`` to the ``mobius-fed`` subcommands."""
    p = sub.add_parser(
        "relay", help="run a relay for ring edges nobody can dial", description=DESCRIPTION
    )
    add_flags(p)
    p.set_defaults(func=relay_main)


def relay_main(args: argparse.Namespace) -> int:
    from mobius_fed.relay.daemon import Relay
    from mobius_fed.relay.keys import RelayKeyError, read_relay_key, write_relay_key

    try:
        if args.init_key is not None:
            print(f"wrote {write_relay_key(args.init_key)}")
            return 0
        if args.key_file is None:
            raise CliError("--key-file is required (make one with --init-key FILE)")
        key = read_relay_key(args.key_file)
    except RelayKeyError as exc:
        raise CliError(str(exc)) from None
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        relay = Relay(args.listen, key)
    except OSError as exc:
        raise CliError(f"cannot listen on {args.listen}: {exc.strerror or exc}") from None
    logging.getLogger("mobius.relay").info("relay listening on port %d", relay.port)
    if args.status_listen:
        port = relay.serve_status(args.status_listen)
        logging.getLogger("mobius.relay").info("relay status on port %d /status", port)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        relay.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    return run_guarded(relay_main, build_parser().parse_args(argv))


def build_parser() -> argparse.ArgumentParser:
    """The ``mobius-relay`` parser."""
    p = argparse.ArgumentParser(prog="mobius-relay", description=DESCRIPTION)
    add_flags(p)
    return p


if __name__ == "__main__":
    raise SystemExit(main())
