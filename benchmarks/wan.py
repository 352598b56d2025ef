"""The ring at WAN speed: shaped links in the namespace testbed (root only).

Two parts, each printing one table with ratios measured in the same run:

``link``: one real ring link (``RingLinks``, mTLS gRPC, worker-0 → worker-1 in their own
namespaces) streaming 16 MiB fp32 tensors over each link shape; MB/s as the receiver
sees it (first to last tensor), against the shape's rate and against a raw TCP stream
probed over the same shaped link (``mobius_fed.testbed.wan.probe``).

``ring``: a static P = 4 ring of ``mobius-worker`` processes (cpu-base by default), one
namespace each, for each link shape and wire codec: tokens/s (steps × tokens per step /
seconds of the timed steps, the first ``--skip`` steps left out) and the busy fraction
(compute time / step time, mean over workers and timed steps), with ratios to the
loopback row of the same codec.

    python benchmarks/wan.py link --shapes loopback 1gbit/25ms 100mbit/50ms
    python benchmarks/wan.py ring --codecs none fwd=int8,bwd=int8 both=int3 --steps 8
    python benchmarks/wan.py project --compute 0.076 0.047 --rates 100mbit 1gbit 10gbit
    python benchmarks/wan.py check --preset cpu-small --shapes loopback 10mbit/5ms --micro 2

``project`` needs no testbed: from compute seconds per step (measured, or given for a GPU),
the bytes of a hop in each direction under a scheme (wire dtype, codec, subspace; exact
payload sizes), a link (rate, RTT) and the micro-batches per stream (``--micro M``) it
simulates one ring step (``ring_step_sim.py``) and prints the busy fraction and the ring's
tokens/s, with the overlapped and serial bounds beside them. ``check`` runs the ``ring``
part on shaped links and sets each run's tokens/s beside the projection made from that
run's own compute seconds per step (``--rows`` tabulates rows a run printed, again).

Shapes are RATE/DELAY per site and direction (``1gbit/25ms``: 1 Gbit/s each way, 25 ms
one way, so a 50 ms round trip); ``loopback`` is the testbed unshaped. Link tuning
(HTTP/2 windows, piece size, allocator) comes from the worker's ``link`` settings as
``MOBIUS_LINK__*`` variables, passed to every process (``MOBIUS_LINK__BDP_PROBE=false
python benchmarks/wan.py link …``; see mobius_fed/transport/link_tuning.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # the sibling benchmarks below
from compression import hop_bytes, parse_subspace, step_bytes
from ring_step_sim import StepCosts, simulate_step

REPO = Path(__file__).resolve().parents[1]
SHAPE = (8, 512, 1024)
NBYTES = 8 * 512 * 1024 * 4
RUN_ID = "wan-bench"


def parse_shape(text: str):
    from mobius_fed.testbed.wan import WanShape, parse_delay, parse_rate

    if text == "loopback":
        return WanShape()
    rate, _, delay = text.partition("/")
    return WanShape(parse_rate(rate), parse_delay(delay) if delay else 0.0)


def _env() -> dict[str, str]:
    from mobius_fed.transport.link_tuning import refuse_renamed_variables

    refuse_renamed_variables(os.environ)
    keep = {k: v for k, v in os.environ.items() if k.startswith(LINK_PREFIX)}
    return {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **keep}


LINK_PREFIX = "MOBIUS_LINK__"
"""The worker's ``link`` settings in the environment (every process gets them)."""


def link_config_from_env():
    """The ``link`` settings this process's ``MOBIUS_LINK__*`` variables give, validated
    as the worker validates them."""
    from mobius_fed.transport.link_tuning import LinkConfig
    from mobius_fed.worker.config import SETTINGS

    values = {
        s.path[1]: os.environ[s.env]
        for s in SETTINGS
        if s.path[0] == "link" and os.environ.get(s.env, "") != ""
    }
    return LinkConfig.model_validate(values)


def _compose(path: Path, services: dict[str, list[str]]) -> Path:
    lines = ["name: wanbench", "services:"]
    env = _env()
    for name, argv in services.items():
        lines.append(f"  {name}:")
        lines.append(f"    command: {json.dumps(argv)}")
        lines.append("    environment:")
        lines += [f"      {k}: {json.dumps(v)}" for k, v in env.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


# ------------------------------------------------------------------------------ link
def _link_links(rank: int, certs: Path, now):
    from mobius_fed.config import TrainConfig
    from mobius_fed.transport.certs import CertLayout
    from mobius_fed.worker.frames import FrameRules
    from mobius_fed.worker.link import RingLinks

    layout = CertLayout(root=certs, ca_cert=certs / "ca.crt", ca_key=certs / "ca.key", workers=2)
    cfg = TrainConfig(preset="cpu-base", workers=2, batch_size=8)
    rules = FrameRules(cfg, rank, RUN_ID, now)
    rules.shape = SHAPE
    return RingLinks(
        rules,
        listen="0.0.0.0:7000",
        successor=f"worker-{1 - rank}:7000",
        tls=layout.worker(rank),
        peer_timeout=120,
        tuning=link_config_from_env().tuning(),
    )


def link_worker(rank: int, certs: Path, count: int, out: Path) -> None:
    """worker-0 sends ``count`` tensors (at most two ahead of the receiver, as the frame
    rules' step window allows); worker-1 times them."""
    import torch

    from mobius_fed.worker.frames import FORWARD, TRAIN, FrameKey

    torch.set_num_threads(1)
    consumed = [0]
    links = _link_links(rank, certs, lambda: consumed[0])
    links.start_server()
    links.connect()
    key = lambda j: FrameKey(TRAIN, j, FORWARD, 0, 1, 0)  # noqa: E731
    if rank == 0:
        t = torch.randn(SHAPE)
        for j in range(count):
            while j > consumed[0] + 1:  # the receiver's window: its step and the next
                time.sleep(0.002)
                consumed[0] = _read_progress(out)
            links.send_tensor(key(j), t)
        links.finish(timeout=300)
        return
    stamps = []
    for j in range(count):
        links.inbox.get(key(j), 300, f"tensor {j}")
        stamps.append(time.perf_counter())
        consumed[0] = j + 1
        out.with_suffix(".progress").write_text(str(j + 1))
    links.finish(timeout=60)
    rate = (count - 1) * NBYTES / (stamps[-1] - stamps[0])
    out.write_text(json.dumps({"MB_s": rate / 1e6}))


def _read_progress(out: Path) -> int:
    try:
        return int(out.with_suffix(".progress").read_text() or 0)
    except (OSError, ValueError):
        return 0


def bench_link(shapes: list[str], count: int) -> list[dict]:
    from mobius_fed.testbed import Testbed
    from mobius_fed.transport.certs import init_certs

    rows = []
    for text in shapes:
        shape = parse_shape(text)
        with tempfile.TemporaryDirectory(prefix="wanbench") as tmp:
            root = Path(tmp)
            init_certs(root / "certs", 2)
            out = root / "result.json"
            me = [sys.executable, str(Path(__file__).resolve()), "_link"]
            services = {
                f"worker-{r}": [*me, str(r), str(root / "certs"), str(count), str(out)]
                for r in (1, 0)
            }
            services["probe"] = [sys.executable, "-m", "mobius_fed.testbed.wan", "probe-server"]
            services["probe"] += ["--port", "7100"]
            compose = _compose(root / "compose.yaml", services)
            wan = {s: shape for s in services}
            with Testbed(compose, root / "tb", wan=wan) as tb:
                tb.up(timeout=60)
                deadline = time.monotonic() + 600
                while not out.exists() and time.monotonic() < deadline:
                    if tb.failed():
                        raise RuntimeError(tb.describe_failure(tb.failed()))
                    time.sleep(0.5)
                got = json.loads(out.read_text())
                argv = [sys.executable, "-m", "mobius_fed.testbed.wan", "probe", "probe:7100"]
                r = tb.exec("worker-0", argv, env=_env(), timeout=120, check=True)
                tcp = json.loads(r.stdout)
        rate = shape.rate / 8 / 1e6 if shape.rate else None
        rows.append(
            {
                "shape": text,
                "link_MB_s": got["MB_s"],
                "tcp_MB_s": tcp["mbit_s"] / 8,
                "rtt_ms": tcp["rtt_ms"],
                "of_rate": got["MB_s"] / rate if rate else None,
                "of_tcp": got["MB_s"] / (tcp["mbit_s"] / 8),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


def link_table(rows: list[dict]) -> str:
    lines = [
        "| link (per site, each way) | RTT ms | raw TCP MB/s | ring link MB/s | link / rate "
        "| link / raw TCP |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        of_rate = f"{r['of_rate']:.2f}" if r["of_rate"] else "—"
        lines.append(
            f"| {r['shape']} | {r['rtt_ms']:.1f} | {r['tcp_MB_s']:.1f} | {r['link_MB_s']:.1f} "
            f"| {of_rate} | {r['of_tcp']:.2f} |"
        )
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------ ring
def static_worker_argv(root: Path, i: int, P: int, *extra: str) -> list[str]:
    """``mobius-worker`` rank ``i`` of a static P-ring in the testbed: its certificates
    under ``root/certs``, its site ``root/sites/site-<i>``, its output ``root/out``; one
    thread, 300 s for peers; then ``extra``."""
    node = root / "certs" / "nodes" / f"worker-{i}"
    peers = ",".join(f"worker-{r}:7000" for r in range(P))
    argv = [sys.executable, "-m", "mobius_fed.cli.worker", "--rank", str(i)]
    argv += ["--workers", str(P), "--peers", peers, "--listen", "0.0.0.0:7000"]
    argv += ["--data-dir", str(root / "sites" / f"site-{i}")]
    argv += ["--out-dir", str(root / "out" / f"worker-{i}")]
    argv += ["--ca", str(node / "ca.crt"), "--cert", str(node / "tls.crt")]
    argv += ["--key", str(node / "tls.key"), "--threads", "1"]
    return [*argv, "--run-id", RUN_ID, "--peer-timeout", "300", *extra]


def bench_ring(args: argparse.Namespace) -> list[dict]:
    from mobius_fed.data import embedded_corpus, prepare_sites
    from mobius_fed.testbed import Testbed
    from mobius_fed.transport.certs import init_certs

    P, rows = 4, []
    for wire in args.codecs:
        for text in args.shapes:
            shape = parse_shape(text)
            with tempfile.TemporaryDirectory(prefix="wanring") as tmp:
                root = Path(tmp)
                init_certs(root / "certs", P)
                prepare_sites(None, root / "sites", P, text=embedded_corpus())
                services = {}
                for i in range(P):
                    argv = static_worker_argv(root, i, P, "--preset", args.preset)
                    argv += ["--steps", str(args.steps), "--eval-every", "0"]
                    argv += ["--micro-batches", str(args.micro), "--order", args.order]
                    if wire != "none":
                        argv += ["--wire", wire]
                    services[f"worker-{i}"] = argv
                compose = _compose(root / "compose.yaml", services)
                wan = {s: shape for s in services}
                with Testbed(compose, root / "tb", wan=wan) as tb:
                    tb.up(timeout=60)
                    deadline = time.monotonic() + args.timeout
                    while not all(tb.finished(s) for s in services):
                        if time.monotonic() > deadline:
                            raise RuntimeError(f"ring {wire} {text} did not finish")
                        time.sleep(1)
                    if tb.failed():
                        raise RuntimeError(tb.describe_failure(tb.failed()))
                rows.append(_ring_row(root / "out", P, args, wire, text))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def _ring_row(out: Path, P: int, args, wire: str, shape: str) -> dict:
    from mobius_fed.config import TrainConfig

    tokens = TrainConfig(preset=args.preset, workers=P).tokens_per_step
    seconds, busy, compute = [], [], []
    for i in range(P):
        steps = [
            json.loads(line)
            for line in (out / f"worker-{i}" / "metrics.jsonl").read_text().splitlines()
        ]
        steps = [r for r in steps if "compute_s" in r][args.skip :]
        seconds.append(sum(r["seconds"] for r in steps))
        busy.append(statistics.mean(r["compute_s"] / r["seconds"] for r in steps))
        compute.append(statistics.mean(r["compute_s"] for r in steps))
    n = args.steps - args.skip
    return {
        "wire": wire,
        "shape": shape,
        "tokens_s": n * tokens / max(seconds),
        "busy": statistics.mean(busy),
        "compute_s": max(compute),  # the slowest worker's compute gates the ring's step
    }


def ring_table(rows: list[dict]) -> str:
    base = {r["wire"]: r for r in rows if r["shape"] == "loopback"}
    lines = [
        "| wire | link | tokens/s | vs loopback | busy fraction |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        b = base.get(r["wire"])
        ratio = f"{r['tokens_s'] / b['tokens_s']:.2f}" if b else "—"
        lines.append(
            f"| {r['wire']} | {r['shape']} | {r['tokens_s']:.0f} | {ratio} | {r['busy']:.2f} |"
        )
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------ projection

RATES = {"mbit": 1e6, "gbit": 1e9, "kbit": 1e3}


def parse_rate_bps(text: str) -> float:
    """``100mbit``, ``1gbit``, ``10gbit`` → bits per second."""
    for unit, scale in RATES.items():
        if text.lower().endswith(unit):
            return float(text[: -len(unit)]) * scale
    raise ValueError(f"link rate {text!r}: expected a number and kbit, mbit or gbit (1gbit)")


def parse_scheme(text: str) -> dict:
    """A scheme for :func:`scheme_config`: ``bf16`` / ``fp32`` (the wire dtype alone) or
    ``;``-separated ``dtype=…``, ``wire=<--wire spec>``, ``subspace=rank=K[,mode=…]``."""
    if text in ("fp32", "bf16", "fp16"):
        return {"wire_dtype": text}
    out: dict = {}
    for part in filter(None, text.split(";")):
        key, _, value = part.partition("=")
        if key == "dtype":
            out["wire_dtype"] = value
        elif key == "wire":
            from mobius_fed.transport.wire_config import WireConfig

            out["wire"] = WireConfig.parse_flag(value)
        elif key == "subspace":
            out["subspace"] = parse_subspace(value)
        else:
            raise ValueError(f"scheme {text!r}: unknown part {key!r} (dtype, wire, subspace)")
    return out


def with_scheme(cfg, scheme: str):
    """``cfg`` with a scheme's wire dtype, codec and subspace (validated anew)."""
    from mobius_fed.config import TrainConfig

    return TrainConfig.model_validate({**cfg.model_dump(), **parse_scheme(scheme)})


def worker_bytes(preset: str, P: int, loops: int, batch: int, scheme: str) -> float:
    """Bytes one worker sends per training step (cyclic: the ring's total over P)."""
    from mobius_fed.config import TrainConfig

    cfg = TrainConfig(
        preset=preset, workers=P, loops=loops, batch_size=batch, **parse_scheme(scheme)
    )
    return step_bytes(cfg)[0] / P


def project(compute_s: float, nbytes: float, rate_bps: float, rtt_s: float, K: int) -> dict:
    """Step time, busy fraction of one worker and the ring's step rate on a link.

    The worker sends ``nbytes`` per step (its hidden states forward, its gradients
    backward, each direction on its own link direction). Transfers overlap compute (the
    ring streams frames while the next application runs), so a step takes the longer of
    compute and transfer; the dependency chain of a step crosses K hops forward and K
    back, each a one-way delay, which nothing inside a step hides: + K·RTT. ``serial``
    is the bound without any overlap: compute + transfer + K·RTT.
    """
    transfer = 8 * nbytes / rate_bps
    step = max(compute_s, transfer) + K * rtt_s
    serial = compute_s + transfer + K * rtt_s
    return {
        "transfer_s": transfer,
        "step_s": step,
        "busy": compute_s / step,
        "serial_busy": compute_s / serial,
    }


BACKWARD_OVER_FORWARD = 2.0
"""FLOPs of a backward pass over its forward: one matmul for the input gradient and one
for the weight gradient per forward matmul. Used only where compute shares are not
measured (``project`` without ``--measure-shares``)."""


def flop_shares(cfg) -> dict[str, float]:
    """Shares of one worker's step compute by FLOP count: all K·M applications forward,
    all backward, the head (R and the loss, forward and backward), the rest at home (taken
    as 0: the embedding is a lookup, the optimizer's cost is per parameter, not per token)."""
    mc = cfg.model()
    per_group = mc.n_layer // mc.groups
    app = 2 * (4 + 2 * mc.mlp_ratio) * mc.d_model**2 * per_group  # weights, per token
    app += 4 * mc.seq_len * mc.d_model * per_group  # attention scores and mixing
    head = (1 + BACKWARD_OVER_FORWARD) * 2 * mc.vocab_size * mc.d_model
    total = cfg.K * app * (1 + BACKWARD_OVER_FORWARD) + head
    return {
        "fwd": cfg.K * app / total,
        "bwd": cfg.K * app * BACKWARD_OVER_FORWARD / total,
        "head": head / total,
        "home": 0.0,
    }


def measure_shares(cfg, repeats: int = 9) -> dict[str, float]:
    """Shares of one worker's step compute, timed on this machine (one thread, the fastest
    of ``repeats``: the one least disturbed by other load): F_i on one micro-batch forward
    and backward (× K·M), R and the loss forward and backward (× M), and the home rest
    (embedding both ways, optimizer steps; once)."""
    import torch

    from mobius_fed.defences.site_layers import build_site_replica
    from mobius_fed.model import build_group
    from mobius_fed.model.training import make_optimizers, step_optimizers

    torch.set_num_threads(1)
    mc, M = cfg.model(), cfg.micro_batches
    group, replica = build_group(mc, 0, cfg.seed), build_site_replica(cfg, 0, "ring")
    opts = make_optimizers(group, cfg, blocks=True) + make_optimizers(replica, cfg, blocks=False)
    idx = torch.randint(0, mc.vocab_size, (cfg.batch_size // M, mc.seq_len))
    x = torch.randn(*idx.shape, mc.d_model)
    laps: dict[str, list[float]] = {"fwd": [], "bwd": [], "head": [], "home": []}
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = group(x.clone().requires_grad_(), 0)
        t1 = time.perf_counter()
        out.backward(torch.ones_like(out))
        t2 = time.perf_counter()
        replica.loss(x.clone().requires_grad_(), idx).backward()
        t3 = time.perf_counter()
        e = replica.embed(idx)
        e.backward(torch.ones_like(e))
        step_optimizers(opts, cfg, 0)
        t4 = time.perf_counter()
        for name, lap in zip(laps, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            laps[name].append(lap)
    per = {k: min(v) for k, v in laps.items()}
    total = {"fwd": cfg.K * M, "bwd": cfg.K * M, "head": M, "home": 1}
    seconds = {k: per[k] * n for k, n in total.items()}
    return {k: v / sum(seconds.values()) for k, v in seconds.items()}


def project_micro(
    cfg, compute_s: float, shares: dict, rate_bps: float, delay_s: float, burst: float = 0.0
) -> dict:
    """The simulated ring step (benchmarks/ring_step_sim.py) for ``cfg`` (its P, L, order,
    micro-batches and wire), ``compute_s`` of one worker per step split by ``shares``, each
    site's egress ``rate_bps`` (a token bucket of ``burst`` bytes) and one-way ``delay_s``."""
    KM, M = cfg.K * cfg.micro_batches, cfg.micro_batches
    fwd_b, bwd_b = hop_bytes(cfg)
    costs = StepCosts(
        fwd_s=compute_s * shares["fwd"] / KM,
        bwd_s=compute_s * shares["bwd"] / KM,
        head_s=compute_s * shares["head"] / M,
        home_s=compute_s * shares["home"],
        fwd_bytes=fwd_b,
        bwd_bytes=bwd_b,
        rate_bps=rate_bps,
        delay_s=delay_s,
        burst_bytes=burst,
    )
    sim = simulate_step(cfg.order, cfg.P, cfg.loops, M, costs)
    return {
        **sim,
        "busy": compute_s / sim["step_s"],
        "tokens_s": cfg.tokens_per_step / sim["step_s"],
    }


def _shares_text(shares: dict) -> str:
    return ", ".join(f"{k} {v:.2f}" for k, v in shares.items())


def _shares(args: argparse.Namespace, cfg, measure: bool) -> dict[str, float]:
    """``--shares`` as given, else measured here (``check``) or by FLOPs (``project``)."""
    if args.shares:
        if len(args.shares) != 4 or min(args.shares) < 0 or sum(args.shares) <= 0:
            raise ValueError(f"--shares {args.shares}: four values ≥ 0: fwd bwd head home")
        return {k: v / sum(args.shares) for k, v in zip(SHARES, args.shares)}
    return measure_shares(cfg) if measure else flop_shares(cfg)


SHARES = ("fwd", "bwd", "head", "home")


def project_table(args: argparse.Namespace) -> str:
    from mobius_fed.config import TrainConfig

    cfg = TrainConfig(
        preset=args.preset,
        workers=args.workers,
        loops=args.loops,
        batch_size=args.batch,
        micro_batches=args.micro,
    )
    shares = _shares(args, cfg, args.measure_shares)
    tokens = cfg.tokens_per_step
    rtt = float(args.rtt_ms) / 1000
    head = " | ".join(f"{r}: busy [overlapped, serial] / tokens/s" for r in args.rates)
    lines = [
        f"{args.preset}, P = {args.workers}, L = {args.loops}, batch {args.batch} per origin, "
        f"M = {args.micro} micro-batches, {tokens} tokens per ring step, RTT {args.rtt_ms} ms; "
        f"busy = compute / step of the simulated ring step (the two bounds in brackets); "
        f"compute shares: {_shares_text(shares)}",
        "",
        f"| scheme | MB sent per worker-step | compute s/step | {head} |",
        "|---|---|---|" + "---|" * len(args.rates),
    ]
    for scheme in args.schemes:
        nbytes = worker_bytes(args.preset, args.workers, args.loops, args.batch, scheme)
        scfg = with_scheme(cfg, scheme)
        for compute in args.compute:
            cells = []
            for rate in args.rates:
                bounds = project(compute, nbytes, parse_rate_bps(rate), rtt, cfg.K)
                sim = project_micro(scfg, compute, shares, parse_rate_bps(rate), rtt / 2)
                cells.append(
                    f"{sim['busy']:.2f} [{bounds['busy']:.2f}, {bounds['serial_busy']:.2f}] "
                    f"/ {sim['tokens_s']:,.0f}"
                )
            lines.append(
                f"| {scheme} | {nbytes / 1e6:.1f} | {compute} | " + " | ".join(cells) + " |"
            )
    return "\n".join(lines) + "\n"


def check_table(rows: list[dict], args: argparse.Namespace, shares: dict) -> str:
    """Each ring run against the projection from its own compute s/step, the bytes of its
    codec and its link: the simulated step at the run's M (``project_micro``, with compute
    split by ``shares``) and, for reference, the overlapped and serial bounds. The
    projection holds where measured ÷ projected is near 1; on a loopback row (no link cost)
    that ratio is what the ring loses besides its link."""
    from mobius_fed.config import TrainConfig

    cfg = TrainConfig(preset=args.preset, workers=4, micro_batches=args.micro)
    lines = [
        f"{args.preset}, P = 4, L = 1, batch {cfg.batch_size} per origin, M = {args.micro}, "
        f"{args.steps} steps ({args.skip} untimed); projected from each run's own compute "
        f"s/step (slowest worker); compute shares: {_shares_text(shares)}; each site's link "
        "a token bucket as the testbed's tc tbf sets it (128 KiB or 4 ms of burst)",
        "",
        "| wire | link | compute s/step | MB per worker-step | projected transfer s | "
        "projected tokens/s: model [overlapped, serial] | measured tokens/s | "
        "measured ÷ model [÷ overlapped, ÷ serial] | κ: measured ÷ model at κ·compute |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    kappa = loopback_kappa(rows, cfg.tokens_per_step)
    lines += [_check_row(r, cfg, shares, args.preset, kappa.get(r["wire"])) for r in rows]
    return "\n".join(lines) + "\n"


def loopback_kappa(rows: list[dict], tokens: int) -> dict[str, float]:
    """κ per wire from its loopback row: the unshaped ring's step over its slowest worker's
    compute s/step. The model has no link cost there, so κ is what the ring's critical path
    takes beyond that compute (workers that are slow at different slots, frames handled on
    other threads); its column projects each shaped run from κ · its compute."""
    return {
        r["wire"]: tokens / r["tokens_s"] / r["compute_s"] for r in rows if r["shape"] == "loopback"
    }


UNSHAPED_BPS = 1e15
"""An unshaped (loopback) link in the model: no transfer time, no burst, no delay."""


def _check_row(r: dict, cfg, shares: dict, preset: str, kappa: float | None) -> str:
    shape = parse_shape(r["shape"])
    rate = float(shape.rate or UNSHAPED_BPS)
    scheme = cfg.wire_dtype if r["wire"] == "none" else f"wire={r['wire']}"
    nbytes = worker_bytes(preset, 4, 1, cfg.batch_size, scheme)
    proj = project(r["compute_s"], nbytes, rate, 2 * shape.delay, cfg.K)
    fast = cfg.tokens_per_step / proj["step_s"]
    slow = fast * proj["serial_busy"] / proj["busy"]  # same compute, serial step
    burst = testbed_burst(int(shape.rate)) if shape.rate else 0.0
    scfg, got = with_scheme(cfg, scheme), r["tokens_s"]
    sim = project_micro(scfg, r["compute_s"], shares, rate, shape.delay, burst)
    at_kappa = "—"
    if kappa is not None:
        k = project_micro(scfg, kappa * r["compute_s"], shares, rate, shape.delay, burst)
        at_kappa = f"{kappa:.2f}: {got / k['tokens_s']:.2f}"
    return (
        f"| {r['wire']} | {r['shape']} | {r['compute_s']:.3f} | {nbytes / 1e6:.2f} | "
        f"{proj['transfer_s']:.3f} | {sim['tokens_s']:,.0f} [{fast:,.0f}, {slow:,.0f}] | "
        f"{got:,.0f} | **{got / sim['tokens_s']:.2f}** [{got / fast:.2f}, {got / slow:.2f}] | "
        f"{at_kappa} |"
    )


def testbed_burst(rate: int) -> float:
    """Bytes the testbed's ``tc tbf`` on a site's link passes at once (its token bucket, as
    ``mobius_fed.testbed.wan.tbf_args`` sets it: 128 KiB or 4 ms of the rate)."""
    from mobius_fed.testbed.wan import tbf_args

    args = tbf_args(rate)
    return float(args[args.index("burst") + 1])


def read_rows(path: Path) -> list[dict]:
    """The rows a ``ring``/``check`` run printed (one JSON object a line; other lines
    skipped), to tabulate them again."""
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.startswith("{")]
    if not rows:
        raise ValueError(f"{path}: no JSON rows (the lines a ring or check run prints)")
    return rows


PROJECT_SCHEMES = [
    "bf16",
    "wire=fwd=int6,bwd=int4,rounding=stochastic",
    "subspace=rank=96,mode=home;dtype=bf16",
    "subspace=rank=96,mode=home;wire=fwd=int8,bwd=int4,rounding=stochastic",
    "subspace=rank=48,mode=home;wire=fwd=int8,bwd=int4,rounding=stochastic",
]


SHARES_HELP = (
    "shares of a worker's step compute: all forward applications, all backward, the head, "
    "the home rest (default: check times them here, project counts FLOPs)"
)


def _ring_parser(p: argparse.ArgumentParser, shapes: list, codecs: list, preset: str) -> None:
    """The flags of a static-ring run in the testbed (``ring`` and ``check``)."""
    p.add_argument("--shapes", nargs="+", default=shapes)
    p.add_argument("--codecs", nargs="+", default=codecs)
    p.add_argument("--preset", default=preset)
    p.add_argument("--order", default="cyclic")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--skip", type=int, default=2, help="untimed first steps")
    p.add_argument("--micro", type=int, default=1, help="micro-batches per stream")
    p.add_argument("--timeout", type=float, default=1800)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_link":
        rank, certs, count, out = argv[1:5]
        link_worker(int(rank), Path(certs), int(count), Path(out))
        return 0
    p = argparse.ArgumentParser(
        description=textwrap.dedent(__doc__ or ""), formatter_class=argparse.RawTextHelpFormatter
    )
    sub = p.add_subparsers(dest="part", required=True)
    lk = sub.add_parser("link", help="one ring link's throughput per link shape")
    lk.add_argument("--shapes", nargs="+", default=["loopback", "1gbit/25ms", "100mbit/50ms"])
    lk.add_argument("--count", type=int, default=24, help="16 MiB tensors per shape")
    _ring_parser(
        sub.add_parser("ring", help="P = 4 ring tokens/s and busy fraction"),
        ["loopback", "1gbit/25ms", "100mbit/50ms"],
        ["none", "both=int8", "fwd=int3,bwd=int4"],
        "cpu-base",
    )
    ck = sub.add_parser("check", help="shaped ring runs against the projection")
    _ring_parser(
        ck,
        ["2mbit/5ms", "10mbit/5ms", "100mbit/5ms"],
        ["none", "both=int8"],
        "cpu-small",
    )
    ck.add_argument(
        "--rows", type=Path, nargs="+", help="tabulate the rows runs printed; run nothing"
    )
    ck.add_argument("--shares", type=float, nargs=4, metavar=SHARES, help=SHARES_HELP)
    pj = sub.add_parser("project", help="projected busy fraction and tokens/s (no testbed)")
    pj.add_argument("--compute", type=float, nargs="+", default=[0.076, 0.047], help="s/step")
    pj.add_argument("--rates", nargs="+", default=["100mbit", "1gbit", "10gbit"])
    pj.add_argument("--rtt-ms", type=float, default=0.0, help="round trip of every ring link")
    pj.add_argument("--schemes", nargs="+", default=PROJECT_SCHEMES)
    pj.add_argument("--preset", default="gpt2-small")
    pj.add_argument("--workers", type=int, default=4)
    pj.add_argument("--loops", type=int, default=1)
    pj.add_argument("--batch", type=int, default=8)
    pj.add_argument("--micro", type=int, default=1, help="micro-batches per stream")
    pj.add_argument("--shares", type=float, nargs=4, metavar=SHARES, help=SHARES_HELP)
    pj.add_argument("--measure-shares", action="store_true", help="time them on this machine")
    args = p.parse_args(argv)
    if args.part == "project":
        print(project_table(args))
        return 0
    if args.part == "link":
        print(link_table(bench_link(args.shapes, args.count)))
    elif args.part == "check":
        from mobius_fed.config import TrainConfig

        if args.order != "cyclic":
            raise ValueError(f"check --order {args.order}: the projection models cyclic only")
        cfg = TrainConfig(preset=args.preset, workers=4, micro_batches=args.micro)
        shares = _shares(args, cfg, measure=True)  # before the ring loads the machine
        rows = [r for f in args.rows for r in read_rows(f)] if args.rows else bench_ring(args)
        print(check_table(rows, args, shares))
    else:
        print(ring_table(bench_ring(args)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
