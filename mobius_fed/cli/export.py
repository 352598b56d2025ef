"""``mobius-fed export``, ``generate`` and ``eval``: the trained model out of the framework.

mobius-fed export runs/up --out models          # models/origin-<s>/ for every origin
mobius-fed generate models/origin-0 --prompt "Once upon a time"
mobius-fed eval models/origin-0 --data book.txt
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from mobius_fed.cli.common import CliError, add_threads_flag, apply_threads, console


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export",
        help="write each origin's model as model.safetensors + config.json (transformers-ready)",
        description="Export a trained run: for each origin s, its path of block groups, the "
        "averaged E/R and its home layer, as model.safetensors, config.json and the "
        "remote-code modeling_mobius.py (AutoModelForCausalLM, trust_remote_code=True).",
    )
    p.add_argument(
        "run",
        type=Path,
        help="an `up` root, a coordinator --out, a manifest.json, or a `local` run directory "
        "or checkpoint.pt",
    )
    p.add_argument("--out", type=Path, required=True, help="output directory")
    p.add_argument(
        "--origin",
        type=int,
        action="append",
        metavar="S",
        help="export origin S only (repeatable; one origin: written to OUT itself; "
        "default: every origin, to OUT/origin-<s>/)",
    )
    p.set_defaults(func=cmd_export)

    g = sub.add_parser("generate", help="sample text from an exported model (KV cache)")
    g.add_argument("model", type=Path, help="an export directory (holding config.json)")
    g.add_argument("--prompt", default="", help="text to continue (default: a new document)")
    g.add_argument("--max-new-tokens", type=int, default=200, help="default: %(default)s")
    g.add_argument(
        "--temperature", type=float, default=0.8, help="0: greedy (default: %(default)s)"
    )
    g.add_argument("--top-k", type=int, default=50, help="0: no cut (default: %(default)s)")
    g.add_argument("--seed", type=int, default=0, help="same seed, same text (default: 0)")
    g.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    add_threads_flag(g, "every core it may use", "generation runs on, in this process")
    g.set_defaults(func=cmd_generate)

    e = sub.add_parser("eval", help="loss and perplexity of an exported model on a text file")
    e.add_argument("model", type=Path, help="an export directory (holding config.json)")
    e.add_argument("--data", type=Path, required=True, help="a UTF-8 text file")
    e.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    e.add_argument("--json", action="store_true", help="print the result as JSON")
    add_threads_flag(e, "every core it may use", "the evaluation runs on, in this process")
    e.set_defaults(func=cmd_eval)


def cmd_export(args: argparse.Namespace) -> int:
    from mobius_fed.export import export_run

    for d in export_run(args.run, args.out, args.origin):
        conf = json.loads((d / "config.json").read_text())
        groups = " → ".join(f"F{i}" for i in conf["source_groups"])
        console.print(
            f"origin {conf['origin']}: {d} (path {groups}, L={conf['loops']}, "
            f"home layer {conf['home_layer']}, encoding {conf['encoding']})"
        )
    return 0


def _model(args: argparse.Namespace):
    from mobius_fed.export import load

    apply_threads(args)
    return load(args.model, device=args.device)


def cmd_generate(args: argparse.Namespace) -> int:
    from mobius_fed.export.generation import generate_text

    if args.max_new_tokens < 0 or args.temperature < 0 or args.top_k < 0:
        raise CliError("--max-new-tokens, --temperature and --top-k must be >= 0")
    text = generate_text(
        _model(args),
        args.prompt,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k or None,
        seed=args.seed,
    )
    print(args.prompt + text)
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from mobius_fed.export.generation import score_text

    try:
        text = args.data.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CliError(f"cannot read {args.data}: {exc}") from None
    score = score_text(_model(args), text)
    result = {
        "model": str(args.model),
        "data": str(args.data),
        "tokens": score.tokens,
        "loss": score.loss,
        "perplexity": score.perplexity,
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"{args.data}: {score.tokens} tokens, loss {score.loss:.4f} nats/token, "
            f"perplexity {score.perplexity:.2f}"
        )
    return 0
