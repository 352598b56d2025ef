"""Export a trained run as P standalone models, one per origin (``mobius-fed export``).

Origin s's model is its path φ_s of block groups, the averaged E/R (each origin's replica
for a reference-engine checkpoint, as its evaluation uses) and its private home and input
layers, if any. Each goes to a directory holding ``model.safetensors``, ``config.json`` and the
remote-code ``modeling_mobius.py`` that transformers loads with ``trust_remote_code``, and a
model card ``README.md``.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import stat
from pathlib import Path

import torch
from safetensors.torch import save_file

from mobius_fed import __version__, schedule
from mobius_fed.checkpoint import CheckpointError
from mobius_fed.run_reader import Model, NoCheckpoint, read_run

WEIGHTS, CONFIG, MODELING = "model.safetensors", "config.json", "modeling_mobius.py"
CARD = "README.md"
EOT = {"bytes": 256, "gpt2": 50256}  # <|endoftext|> of each encoding (no download needed)


class ExportError(ValueError):
    """A run cannot be exported; the message names the file or the problem."""


def origin_config(model: Model, s: int) -> dict:
    """config.json of origin s of ``model``, a run as :mod:`mobius_fed.run_reader` reads it."""
    from mobius_fed.model.knobs import residual_epsilon

    cfg, mc = model.cfg, model.mc
    route = schedule.path(cfg.order, s, cfg.P, cfg.loops)
    in_path = list(dict.fromkeys(route))  # the groups in the order the path first visits them
    return {
        "model_type": "mobius",
        "architectures": ["MobiusForCausalLM"],
        "auto_map": {
            "AutoConfig": "modeling_mobius.MobiusConfig",
            "AutoModelForCausalLM": "modeling_mobius.MobiusForCausalLM",
        },
        "vocab_size": mc.vocab_size,
        "d_model": mc.d_model,
        "n_head": mc.n_head,
        "head_dim": mc.head_dim,
        "seq_len": mc.seq_len,
        # an int when every group holds as many blocks, else one count per source group
        "layers_per_group": (
            mc.group_layers[0] if mc.even else [mc.group_layers[i] for i in in_path]
        ),
        "mlp_ratio": mc.mlp_ratio,
        "logit_cap": mc.logit_cap,
        "tied": mc.tied,
        "depth_embedding": mc.depth_embedding,
        "residual_epsilon": residual_epsilon(mc.residual_scale, mc.loops),
        "home_layer": cfg.privacy.home_layer or "off",
        "home_input": cfg.privacy.home_input or "off",
        # the shared subspace: every hop is projected, c = Uᵀ(h − b), h = U·c + b
        "subspace_rank": mc.subspace_rank,
        "subspace_mode": cfg.subspace.mode,
        "path": [in_path.index(i) for i in route],
        "groups_in_path": len(in_path),
        "source_groups": in_path,
        "origin": s,
        "workers": cfg.P,
        "loops": cfg.loops,
        "order": cfg.order,
        "encoding": cfg.encoding,
        "eos_token_id": EOT.get(cfg.encoding),
        "torch_dtype": "float32",
        "source": {
            "run": model.name,
            "mobius_fed": __version__,
            "train": cfg.model_dump(mode="json"),
        },
    }


def origin_state(model: Model, conf: dict) -> dict[str, torch.Tensor]:
    """The tensors of one origin: E/R and its private layers (``wte.``, ``lm_head.``, ``home.``,
    ``home_input.``), then ``groups.<j>.`` for the j-th group of its path."""
    from mobius_fed.model.groups import build_basis
    from mobius_fed.model.subspace import BasisLinear, orthonormal

    s = conf["origin"]
    replica = model.replicas[s]
    state = dict(replica.state_dict())
    U = build_basis(model.mc, model.cfg.seed) if conf["subspace_rank"] else None
    if replica.subspace is not None:  # a learned U: orth of the last barrier's averaged W
        U = orthonormal(state.pop("subspace.weight"))
    for j, i in enumerate(conf["source_groups"]):
        for k, v in model.groups[i].state_dict().items():
            state[f"groups.{j}.{k}"] = v
        for name, m in model.groups[i].named_modules():  # writes through U: W = U·W′
            if isinstance(m, BasisLinear):
                basis = m.basis if U is None else U
                state[f"groups.{j}.{name}.weight"] = basis @ m.weight
    if U is not None:  # U, as the engines use it (StreamMaps)
        state["subspace_basis"] = U
    return {k: v.detach().to("cpu").float().contiguous().clone() for k, v in state.items()}


def model_card(conf: dict) -> str:
    """README.md of an export: what the model is and the three ways to use it."""
    groups = " → ".join(f"F{i}" for i in conf["source_groups"])
    train = conf["source"]["train"]
    return f"""---
library_name: transformers
tags: [mobius-fed, causal-lm]
---
# {conf["source"]["run"]}: origin {conf["origin"]}

A causal language model trained with Möbius Learning (cyclic depth folding) by mobius-fed
{conf["source"]["mobius_fed"]}: origin {conf["origin"]} of P = {conf["workers"]}, its path
{groups} applied L = {conf["loops"]} times ({conf["order"]} order), the averaged
embedding/head, home layer {conf["home_layer"]}, input layer {conf["home_input"]}.
Preset {train.get("preset")}, context {conf["seq_len"]} tokens, encoding
`{conf["encoding"]}`, {train.get("steps")} steps.

```python
from mobius_fed.export import load            # torch + safetensors only
model = load(".")

from transformers import AutoModelForCausalLM   # or transformers (remote code)
model = AutoModelForCausalLM.from_pretrained(".", trust_remote_code=True)
```

```bash
mobius-fed generate . --prompt "The"
mobius-fed eval . --data text.txt
```
"""


def write_origin(model: Model, s: int, directory: Path) -> Path:
    """Write origin s's model into ``directory`` (each file replaced atomically)."""
    conf = origin_config(model, s)
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".export-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        (tmp / CONFIG).write_text(json.dumps(conf, indent=2) + "\n")
        save_file(origin_state(model, conf), tmp / WEIGHTS, metadata={"format": "pt"})
        # safetensors creates its file 0600; every file of an export gets the mode a new
        # file gets here (0644 under the usual umask 022), as config.json: docs/export.md
        os.chmod(tmp / WEIGHTS, stat.S_IMODE((tmp / CONFIG).stat().st_mode))
        (tmp / CARD).write_text(model_card(conf))
        shutil.copyfile(Path(__file__).with_name(MODELING), tmp / MODELING)
        for name in (CARD, MODELING, CONFIG, WEIGHTS):
            os.replace(tmp / name, directory / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return directory


def export_run(run: Path, out: Path, origins: list[int] | None = None) -> list[Path]:
    """Export ``run`` (an ``up`` root, a coordinator ``--out``, a manifest or a
    reference-engine checkpoint / run directory) into ``out/origin-<s>`` (``out`` itself for
    one origin asked for); returns the directories.

    Every copy of every worker file a manifest names is checked against it first.
    """
    try:
        model = read_run(Path(run))
    except NoCheckpoint as exc:
        raise ExportError(f"export: {exc}") from exc
    except (CheckpointError, FileNotFoundError, ValueError) as exc:
        raise ExportError(f"export: cannot read {run}: {exc}") from exc
    sub = model.cfg.subspace
    if sub.bottleneck:
        raise ExportError(
            f"export: subspace mode {sub.mode!r} cannot be exported yet: the exported model "
            "applies a shared U between groups, and this run's groups each hold their own "
            "learned encoder and decoder instead"
        )
    P = model.cfg.P
    wanted = list(range(P)) if origins is None else origins
    bad = [s for s in wanted if not 0 <= s < P]
    if bad:
        raise ExportError(f"export: origin {bad[0]} does not exist (the run has P={P}: 0..{P - 1})")
    single = origins is not None and len(wanted) == 1
    out = Path(out)
    with torch.no_grad():
        return [write_origin(model, s, out if single else out / f"origin-{s}") for s in wanted]
