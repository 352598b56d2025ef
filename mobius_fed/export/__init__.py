"""Trained models out of the framework: export, the torch-only loader, generation.

``mobius_fed.export.load(DIR)`` needs only torch and safetensors (the exporter itself and
the CLI use the rest of mobius-fed lazily).
"""

from __future__ import annotations

import json
from pathlib import Path

from mobius_fed.export.modeling_mobius import MobiusLM

__all__ = ["MobiusLM", "export_run", "load"]


def load(directory: Path, device: str = "cpu") -> MobiusLM:
    """The model an export wrote to ``directory`` (``model.safetensors`` + ``config.json``),
    in eval mode on ``device``; a missing or mismatched file is named."""
    from safetensors.torch import load_file

    directory = Path(directory)
    conf_file, weights = directory / "config.json", directory / "model.safetensors"
    for f in (conf_file, weights):
        if not f.is_file():
            raise FileNotFoundError(f"{f} not found: is {directory} a mobius-fed export?")
    try:
        conf = json.loads(conf_file.read_text())
    except ValueError as exc:
        raise ValueError(f"{conf_file}: not JSON: {exc}") from None
    if conf.get("model_type") != "mobius":
        raise ValueError(f"{conf_file}: model_type {conf.get('model_type')!r}, not 'mobius'")
    model = MobiusLM(conf)
    try:
        model.load_state_dict(load_file(weights))
    except RuntimeError as exc:
        raise ValueError(f"{weights} does not match {conf_file}: {exc}") from None
    return model.to(device).eval()


def export_run(run: Path, out: Path, origins: list[int] | None = None) -> list[Path]:
    """See :func:`mobius_fed.export.files.export_run`."""
    from mobius_fed.export.files import export_run as run_export

    return run_export(run, out, origins)
