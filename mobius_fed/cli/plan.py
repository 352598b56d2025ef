"""``mobius-fed plan --sites sites.yaml``: the split of the layers for sites of unequal speed.

mobius-fed plan --sites sites.yaml --preset cpu-small       # the split, its tokens/s
mobius-fed up --layers-per-group 4,4,2,2 …                  # run it
"""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path

from mobius_fed.cli.common import CliError, add_train_flags, train_config_from_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="propose --layers-per-group for sites of unequal speed (simulated step time)",
        description="Simulate one ring step for every split of the layers over the sites "
        "(their measured or declared speed and their links) and propose the split with the "
        "shortest step, with its predicted tokens/s next to the even split's. "
        "See docs/ring.md, 'Sites of unequal speed'.",
        epilog="sites file: sites: [{name, block_ms | tflops, rate, delay}, …], one per "
        "worker in ring order",
    )
    p.add_argument("--sites", type=Path, required=True, help="YAML file: one entry per worker")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    add_train_flags(p, skip=("layers_per_group",))
    p.set_defaults(func=cmd_plan)


def cmd_plan(args: argparse.Namespace) -> int:
    from mobius_fed.model.config import show_split
    from mobius_fed.ops.plan import PlanError, plan_split, read_sites

    try:
        # a site's speed in FLOP/s: the blocks' shape does not depend on the workers
        shape = train_config_from_args(args, workers=1, layers_per_group=None)
        sites = read_sites(args.sites, shape)
        given = args.workers
        if given is not None and given != len(sites):
            more = "more groups than sites" if given > len(sites) else "more sites than groups"
            raise PlanError(f"--workers {given} but {args.sites} lists {len(sites)} sites ({more})")
        cfg = train_config_from_args(args, workers=len(sites), layers_per_group=None)
        plan = plan_split(cfg, sites)
    except PlanError as exc:
        raise CliError(str(exc)) from None
    if args.json:
        print(json.dumps(plan.as_dict(), indent=2))
        return 0
    mc = cfg.model()
    print(
        f"plan: {cfg.preset} ({mc.n_layer} layers), P={cfg.P} L={cfg.loops} "
        f"M={cfg.micro_batches}, {cfg.order}, {cfg.tokens_per_step:,} tokens per step"
    )
    print(f"{'site':<16} {'speed':>16} {'link':>22} {'even':>5} {'planned':>8}")
    for i, s in enumerate(plan.sites):
        link = f"{s.rate_bps / 1e6:,.0f} Mbit/s, {s.delay_s * 1e3:g} ms"
        print(f"{s.name:<16} {s.declared:>16} {link:>22} {plan.even[i]:>5} {plan.split[i]:>8}")
    print(
        f"even split    {show_split(plan.even):<14} step {plan.even_step_s:.4g} s, "
        f"{plan.even_tokens_s:,.0f} tokens/s"
    )
    print(
        f"planned split {show_split(plan.split):<14} step {plan.step_s:.4g} s, "
        f"{plan.tokens_s:,.0f} tokens/s ({plan.speedup:.2f}× the even split)"
    )
    print(f"run it: mobius-fed up --layers-per-group {shlex.quote(show_split(plan.split))} …")
    return 0
