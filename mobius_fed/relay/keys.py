"""The relay's shared key: a secret file the relay and the sites that use it hold."""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

MIN_KEY_BYTES = 16


class RelayKeyError(ValueError):
    """A relay key file that cannot be used (the message names it and why)."""


def write_relay_key(path: Path) -> Path:
    """A new random key in ``path`` (hex, mode 0600); refuses to overwrite one."""
    path = Path(path)
    if path.exists():
        raise RelayKeyError(f"{path} exists; refusing to overwrite a relay key")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    return path


def read_relay_key(path: Path) -> bytes:
    """The key in ``path``; refused when missing, readable by others, or too short."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
        text = path.read_text().strip()
    except OSError as exc:
        raise RelayKeyError(f"relay key {path}: {exc.strerror or exc}") from exc
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise RelayKeyError(f"relay key {path} is readable by others (chmod 600 {path})")
    if len(text) < 2 * MIN_KEY_BYTES:
        raise RelayKeyError(
            f"relay key {path} holds {len(text)} characters; at least {2 * MIN_KEY_BYTES} "
            "(make one with: mobius-relay --init-key FILE)"
        )
    return text.encode()
