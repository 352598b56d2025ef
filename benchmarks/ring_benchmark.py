"""Ring of real ``mobius-worker`` processes vs the single-process reference engine.

One run measures, on this machine, with the same preset / P / L / batch / wire dtype:

1. throughput: ring tokens/s ÷ reference-engine tokens/s           (target ≥ 0.9)
2. busy fraction compute_s / seconds per worker, cyclic vs ordered (target ≥ 0.95 cyclic)
3. bytes on the wire per step ÷ P·K·2·(B·T·d)·bytes(wire dtype)    (target ≤ 1.01 cyclic)

The ring is P worker processes on loopback with mTLS (certificates made for the run), each
started with ``--threads`` intra-op threads. Every figure excludes warm-up steps. Worker
rows come from ``<out-dir>/metrics.jsonl``; a monitor thread also notes when each row
appears and samples each worker's CPU time from ``/proc`` (wall clock and CPU share).

    python benchmarks/ring_benchmark.py            # ~3-4 min on 2 cores
    python benchmarks/ring_benchmark.py --quick    # ~1.5 min
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mobius_fed import schedule
from mobius_fed.config import TrainConfig
from mobius_fed.data import SiteData, embedded_corpus, prepare_sites
from mobius_fed.engine import ReferenceEngine
from mobius_fed.ops.ports import free_ports
from mobius_fed.transport.certs import init_certs
from mobius_fed.transport.codec import make_frame
from mobius_fed.worker.frames import BACKWARD, TRAIN

WORKER = [sys.executable, "-m", "mobius_fed.cli.worker"]
WIRE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
TARGET_THROUGHPUT = 0.9
TARGET_BUSY = 0.95
TARGET_BYTES = 1.01
CLK_TCK = os.sysconf("SC_CLK_TCK")


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def cpu_seconds(pid: int) -> float | None:
    """utime + stime of the whole process (all threads), or None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # fields 14, 15 of stat(5)


def machine_busy_seconds() -> float | None:
    """CPU-seconds all cores spent not idle since boot (``/proc/stat``), or None."""
    try:
        ticks = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
    return (sum(ticks[:8]) - idle) / CLK_TCK  # user..steal; guest is inside user


def train_config(args: argparse.Namespace, order: str, steps: int) -> TrainConfig:
    return TrainConfig(
        preset=args.preset,
        workers=args.workers,
        loops=args.loops,
        order=order,
        batch_size=args.batch_size,
        wire_dtype=args.wire_dtype,
        steps=steps,
        sync_every=0,  # the static ring keeps E/R local: the reference with sync_every = 0
        eval_every=0,
    )


# --------------------------------------------------------------------------- reference
def run_reference(
    cfg: TrainConfig, sites: list[SiteData], threads: int, warmup: int, timed: int
) -> dict:
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        engine = ReferenceEngine(cfg, sites)
        losses: dict[tuple[int, int], float] = {}
        times = []
        for n in range(warmup + timed):
            if n == warmup:
                w0, c0, m0 = time.perf_counter(), time.process_time(), machine_busy_seconds()
            r = engine.train_step()
            losses.update({(r.step, s): v for s, v in enumerate(r.origin_losses)})
            if n >= warmup:
                times.append(r.seconds)
        wall = time.perf_counter() - w0
        m1, own = machine_busy_seconds(), time.process_time() - c0
    finally:
        torch.set_num_threads(previous)
    other = None if m0 is None or m1 is None else max(0.0, (m1 - m0 - own) / wall)
    per_step = statistics.median(times)
    return {
        "threads": threads,
        "steps": timed,
        "s/step": per_step,
        "tokens/s": cfg.tokens_per_step / per_step,
        "losses": losses,
        "cpu": own / wall,
        "other": other,
    }


# -------------------------------------------------------------------------------- ring
@dataclass
class RingRun:
    root: Path
    cfg: TrainConfig
    threads: int
    sites: Path
    certs: Path
    procs: list[subprocess.Popen] = field(default_factory=list)
    rows: list[dict[int, dict]] = field(default_factory=list)  # worker → step → row
    seen: list[dict[int, float]] = field(default_factory=list)  # worker → step → wall time
    cpu: list[tuple[float, list[float | None]]] = field(default_factory=list)
    machine: list[tuple[float, float | None]] = field(default_factory=list)
    started: float = 0.0

    def out(self, i: int) -> Path:
        return self.root / f"worker-{i}"

    def command(self, i: int, ports: list[int]) -> list[str]:
        c = self.cfg
        return [
            *WORKER,
            *("--rank", str(i), "--peers", ",".join(f"127.0.0.1:{p}" for p in ports)),
            *("--listen", f"127.0.0.1:{ports[i]}", "--data-dir", str(self.sites / f"site-{i}")),
            *("--out-dir", str(self.out(i))),  # the worker's own bundle only
            *("--ca", str(self.certs / "nodes" / f"worker-{i}" / "ca.crt")),
            *("--cert", str(self.certs / "nodes" / f"worker-{i}" / "tls.crt")),
            *("--key", str(self.certs / "nodes" / f"worker-{i}" / "tls.key")),
            *("--threads", str(self.threads), "--peer-timeout", "120"),
            *("--run-id", "ring-benchmark", "--log-level", "WARNING"),
            *("--preset", c.preset, "--workers", str(c.workers), "--loops", str(c.loops)),
            *("--order", c.order, "--steps", str(c.steps), "--batch-size", str(c.batch_size)),
            *("--wire-dtype", c.wire_dtype, "--micro-batches", str(c.micro_batches)),
            *("--optimizer", c.optimizer, "--sync-every", str(c.sync_every)),
            *("--eval-every", str(c.eval_every), "--seed", str(c.seed)),
        ]

    def run(self, timeout: float) -> None:
        P = self.cfg.P
        ports = free_ports(P)
        env = {
            **os.environ,
            "OMP_NUM_THREADS": str(self.threads),
            "MKL_NUM_THREADS": str(self.threads),
            "PYTHONUNBUFFERED": "1",
        }
        self.rows = [{} for _ in range(P)]
        self.seen = [{} for _ in range(P)]
        self.started = time.perf_counter()
        for i in range(P):
            log = open(self.root / f"worker-{i}.log", "w")  # noqa: SIM115
            self.procs.append(
                subprocess.Popen(
                    self.command(i, ports), stdout=log, stderr=subprocess.STDOUT, env=env
                )
            )
            log.close()
        done = threading.Event()
        monitor = threading.Thread(target=self._monitor, args=(done,), daemon=True)
        monitor.start()
        deadline = time.monotonic() + timeout
        try:
            for i, p in enumerate(self.procs):
                rc = p.wait(timeout=max(1.0, deadline - time.monotonic()))
                if rc != 0:
                    tail = (self.root / f"worker-{i}.log").read_text()[-3000:]
                    raise RuntimeError(f"worker-{i} exited {rc}:\n{tail}")
        except subprocess.TimeoutExpired as exc:
            raise RuntimeError(f"ring ({self.cfg.order}) did not finish in {timeout:.0f}s") from exc
        finally:
            done.set()
            monitor.join()
            for p in self.procs:  # only the processes this run started
                if p.poll() is None:
                    p.kill()
                    p.wait()
        self._read_rows(time.perf_counter())  # anything the monitor had not seen yet

    def _monitor(self, done: threading.Event) -> None:
        offsets = [0] * self.cfg.P
        while not done.is_set():
            now = time.perf_counter()
            self.cpu.append((now, [cpu_seconds(p.pid) for p in self.procs]))
            self.machine.append((now, machine_busy_seconds()))
            self._read_rows(now, offsets)
            done.wait(0.1)

    def _read_rows(self, now: float, offsets: list[int] | None = None) -> None:
        offsets = offsets if offsets is not None else [0] * self.cfg.P
        for i in range(self.cfg.P):
            path = self.out(i) / "metrics.jsonl"
            try:
                with path.open("rb") as f:
                    f.seek(offsets[i])
                    data = f.read()
            except OSError:
                continue
            end = data.rfind(b"\n") + 1
            offsets[i] += end
            for line in data[:end].splitlines():
                row = json.loads(line)
                if "compute_s" in row:
                    self.rows[i].setdefault(row["step"], row)
                    self.seen[i].setdefault(row["step"], now)

    # ------------------------------------------------------------------ figures
    def summarize(self, warmup: int) -> dict:
        cfg, P = self.cfg, self.cfg.P
        steady = range(warmup, cfg.steps)
        step_max = [max(self.rows[i][n]["seconds"] for i in range(P)) for n in steady]
        per_step = statistics.median(step_max)
        busy = [
            statistics.median(
                self.rows[i][n]["compute_s"] / self.rows[i][n]["seconds"] for n in steady
            )
            for i in range(P)
        ]
        first, last = warmup - 1, cfg.steps - 1
        sent = [
            self.rows[i][last]["bytes_sent"] - self.rows[i][first]["bytes_sent"] for i in range(P)
        ]
        # Wall clock between the moments the slowest worker's rows for `first` and `last`
        # appeared (monitor polls every 0.1 s), and CPU seconds each process used meanwhile.
        t_a = max(self.seen[i][first] for i in range(P))
        t_b = max(self.seen[i][last] for i in range(P))
        wall = (t_b - t_a) / len(steady)
        cpu_a, cpu_b = self._cpu_at(t_a), self._cpu_at(t_b)
        cpu_share = [(b - a) / (t_b - t_a) for a, b in zip(cpu_a, cpu_b)]
        m_a, m_b = self._sample_at(self.machine, t_a), self._sample_at(self.machine, t_b)
        machine = None if m_a is None or m_b is None else (m_b - m_a) / (t_b - t_a)
        startup = min(self.seen[i][0] - self.rows[i][0]["seconds"] for i in range(P))
        return {
            "order": cfg.order,
            "steps": len(steady),
            "s/step": per_step,
            "s/step sum": max(
                sum(self.rows[i][n]["seconds"] for n in steady) / len(steady) for i in range(P)
            ),
            "s/step wall": wall,
            "tokens/s": cfg.tokens_per_step / per_step,
            "busy": busy,
            "wait": [
                statistics.median(self.rows[i][n]["wait_s"] for n in steady) for i in range(P)
            ],
            "compute": [
                statistics.median(self.rows[i][n]["compute_s"] for n in steady) for i in range(P)
            ],
            "cpu_share": cpu_share,
            "machine": machine,
            "other": None if machine is None else max(0.0, machine - sum(cpu_share)),
            "bytes/step": [b / len(steady) for b in sent],
            "startup_s": startup - self.started,
            "losses": {(n, i): self.rows[i][n]["loss"] for i in range(P) for n in self.rows[i]},
        }

    @staticmethod
    def _sample_at(samples: list[tuple[float, float | None]], t: float) -> float | None:
        value = None
        for when, v in samples:
            if when > t + 0.05:
                break
            value = v if v is not None else value
        return value

    def _cpu_at(self, t: float) -> list[float]:
        """Each worker's CPU seconds at the sample nearest to (not after) wall time t."""
        best = [0.0] * self.cfg.P
        for when, values in self.cpu:
            if when > t + 0.05:
                break
            best = [v if v is not None else b for v, b in zip(values, best)]
        return best


# ---------------------------------------------------------------------------- wire math
def frame_overhead(cfg: TrainConfig) -> tuple[int, int]:
    """(payload bytes, header bytes) of one serialized activation/gradient frame."""
    mc = cfg.model()
    shape = (cfg.batch_size // cfg.micro_batches, mc.seq_len, mc.d_model)
    frame = make_frame(
        run_id="ring-benchmark",
        step=10_000,
        origin=cfg.P - 1,
        tick=cfg.K,
        micro=cfg.micro_batches - 1,
        direction=BACKWARD,
        tensor=torch.ones(shape),
        wire=cfg.wire_dtype,
    )
    frame.phase = TRAIN
    payload = shape[0] * shape[1] * shape[2] * WIRE_BYTES[cfg.wire_dtype]
    return payload, frame.ByteSize() - payload


def hop_frames(order: str, P: int, L: int) -> list[int]:
    """Frames each worker sends per step (per micro-batch), relays included: a forward
    hop a → a+1 is sent by a, the matching backward hop by a+1."""
    sent = [0] * P
    for s in range(P):
        for a, b in schedule.ring_hops(order, s, P, L):  # type: ignore[arg-type]
            sent[a] += 1
            sent[b] += 1
    return sent


# ------------------------------------------------------------------------------ output
def table(header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(r[c]) for r in [header, *rows]) for c in range(len(header))]
    print("  " + "  ".join(h.rjust(w) for h, w in zip(header, widths)))
    print("  " + "  ".join("-" * w for w in widths))
    for r in rows:
        print("  " + "  ".join(v.rjust(w) for v, w in zip(r, widths)))


def fmt_other(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}"


def verdict(ok: bool) -> str:
    return "MET" if ok else "NOT MET"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps (~1.5 min)")
    parser.add_argument("--preset", default="cpu-base")
    parser.add_argument("--workers", type=int, default=4, help="P")
    parser.add_argument("--loops", type=int, default=1, help="L")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per origin")
    parser.add_argument("--wire-dtype", default="fp32", choices=tuple(WIRE_BYTES))
    parser.add_argument("--threads", type=int, default=1, help="torch threads per ring worker")
    parser.add_argument(
        "--ref-threads", type=int, default=None, help="reference threads (default: all cores)"
    )
    parser.add_argument("--warmup", type=int, default=None, help="untimed ring steps")
    parser.add_argument("--steps", type=int, default=None, help="timed cyclic ring steps")
    parser.add_argument("--ordered-steps", type=int, default=None, help="timed ordered steps")
    parser.add_argument("--ref-steps", type=int, default=None, help="timed reference steps")
    parser.add_argument("--keep", type=Path, default=None, help="keep worker dirs/logs here")
    args = parser.parse_args(argv)
    q = args.quick
    args.warmup = args.warmup if args.warmup is not None else (2 if q else 3)
    args.steps = args.steps if args.steps is not None else (4 if q else 10)
    args.ordered_steps = args.ordered_steps if args.ordered_steps is not None else (3 if q else 6)
    args.ref_steps = args.ref_steps if args.ref_steps is not None else (3 if q else 6)
    ncores = cores()
    args.ref_threads = args.ref_threads or ncores
    if args.warmup < 1 or min(args.steps, args.ordered_steps, args.ref_steps) < 1:
        parser.error("--warmup and every step count must be ≥ 1")

    t_start = time.perf_counter()
    cyc_cfg = train_config(args, "cyclic", args.warmup + args.steps)
    ord_cfg = train_config(args, "ordered", args.warmup + args.ordered_steps)
    mc, P, K, B = cyc_cfg.model(), cyc_cfg.P, cyc_cfg.K, cyc_cfg.batch_size
    tokens = cyc_cfg.tokens_per_step
    print(
        f"ring benchmark: preset {args.preset} ({mc.n_layer} layers, d={mc.d_model}, "
        f"T={mc.seq_len}), P={P} L={args.loops} K={K}, batch {B}/origin, "
        f"{tokens:,} tokens/step, wire {args.wire_dtype}, optimizer {cyc_cfg.optimizer}"
    )
    print(
        f"machine: {ncores} cores, torch {torch.__version__}; reference uses "
        f"{args.ref_threads} thread(s) (also 1); ring: {P} processes × {args.threads} "
        f"torch thread(s) = {P * args.threads} compute threads on {ncores} cores "
        f"(plus gRPC threads); warm-up {args.warmup} step(s) excluded"
    )
    print()

    tmp = tempfile.TemporaryDirectory(prefix="ring-bench-")
    root = args.keep or Path(tmp.name)
    root.mkdir(parents=True, exist_ok=True)
    try:
        sites_dir, certs = root / "sites", root / "certs"
        prepare_sites(None, sites_dir, P, cyc_cfg.encoding, text=embedded_corpus(), overwrite=True)
        init_certs(certs, P)
        sites = [SiteData(sites_dir / f"site-{i}", mc.seq_len, cyc_cfg.encoding) for i in range(P)]

        print(f"[reference, {args.ref_threads} thread(s)] ...", flush=True)
        ref = run_reference(cyc_cfg, sites, args.ref_threads, 2 if not q else 1, args.ref_steps)
        refs = [ref]
        if args.ref_threads != 1:
            print("[reference, 1 thread] ...", flush=True)
            refs.append(run_reference(cyc_cfg, sites, 1, 1, 2 if q else 3))
        ring: dict[str, dict] = {}
        for cfg in (cyc_cfg, ord_cfg):
            print(f"[ring {cfg.order}, {cfg.steps} steps] ...", flush=True)
            r = RingRun(root / f"ring-{cfg.order}", cfg, args.threads, sites_dir, certs)
            r.root.mkdir(parents=True, exist_ok=True)
            r.run(timeout=300)
            ring[cfg.order] = r.summarize(args.warmup)
    finally:
        tmp.cleanup()
    cyc, ordd = ring["cyclic"], ring["ordered"]
    print()

    # Sanity: the ring did the reference's math (same config, sync_every = 0).
    common = [k for k in ref["losses"] if k in cyc["losses"]]
    diff = max(abs(ref["losses"][k] - cyc["losses"][k]) for k in common)

    # ---------------------------------------------------------------- figure 1
    tput = cyc["tokens/s"] / ref["tokens/s"]
    print("1. Throughput (tokens/s = tokens/step ÷ median s/step of steady steps)")
    rows = [
        [
            f"reference {x['threads']} thr",
            str(x["steps"]),
            f"{x['s/step']:.3f}",
            "",
            "",
            f"{x['tokens/s']:,.0f}",
            f"{x['tokens/s'] / ref['tokens/s']:.3f}",
            f"{x['cpu']:.2f}",
            fmt_other(x["other"]),
        ]
        for x in refs
    ]
    for x in (cyc, ordd):
        rows.append(
            [
                f"ring {x['order']}",
                str(x["steps"]),
                f"{x['s/step']:.3f}",
                f"{x['s/step sum']:.3f}",
                f"{x['s/step wall']:.3f}",
                f"{x['tokens/s']:,.0f}",
                f"{x['tokens/s'] / ref['tokens/s']:.3f}",
                f"{sum(x['cpu_share']):.2f}",
                fmt_other(x["other"]),
            ]
        )
    table(
        [
            "run",
            "steps",
            "s/step",
            "Σs/n",
            "wall/n",
            "tokens/s",
            f"÷ ref {args.ref_threads} thr",
            "cores used",
            "others' cores",
        ],
        rows,
    )
    print(
        "  s/step: ring = median over steady steps of max over workers of 'seconds'; "
        "Σs/n = slowest worker's mean;\n  wall/n = wall clock between the slowest "
        "worker's first and last steady rows (0.1 s polling). cores used = CPU-s per wall s\n"
        "  of the run itself; others' cores = the rest of the machine's busy CPU (/proc/stat)."
    )
    print(
        f"  ring worker startup (spawn → first step begins): cyclic {cyc['startup_s']:.1f}s, "
        f"ordered {ordd['startup_s']:.1f}s (not timed)."
    )
    print(
        f"  loss check: ring cyclic vs reference, {len(common)} (step, origin) pairs, "
        f"max |Δloss| = {diff:.2e}"
    )
    print(
        f"  by wall clock (ring wall/n vs reference median): cyclic "
        f"{ref['s/step'] / cyc['s/step wall']:.3f}, "
        f"ordered {ref['s/step'] / ordd['s/step wall']:.3f}"
    )
    print(
        f"  ring cyclic ÷ reference {args.ref_threads} thr = {tput:.3f}  "
        f"(target ≥ {TARGET_THROUGHPUT}: {verdict(tput >= TARGET_THROUGHPUT)})"
    )
    print()

    # ---------------------------------------------------------------- figure 2
    print("2. Busy fraction per worker (median over steady steps of compute_s / seconds)")
    rows = []
    for i in range(P):
        rows.append(
            [
                str(i),
                *(
                    f"{x['busy'][i]:.3f} ({x['compute'][i]:.2f}/{x['wait'][i]:.2f}s, "
                    f"cpu {x['cpu_share'][i]:.2f})"
                    for x in (cyc, ordd)
                ),
            ]
        )
    mean_busy = {o: statistics.mean(x["busy"]) for o, x in ring.items()}
    cpu_total = {o: sum(x["cpu_share"]) for o, x in ring.items()}
    rows.append(["mean", *(f"{mean_busy[o]:.3f}" for o in ring)])
    rows.append(
        [
            "machine CPU",
            *(f"{cpu_total[o]:.2f} of {ncores} cores ({cpu_total[o] / ncores:.0%})" for o in ring),
        ]
    )
    rows.append(
        [
            "other procs",
            *(
                "n/a"
                if x["machine"] is None
                else f"{max(0.0, x['machine'] - cpu_total[o]):.2f} cores (whole machine "
                f"{x['machine']:.2f})"
                for o, x in ring.items()
            ),
        ]
    )
    table(["worker", "cyclic busy (compute/wait, cpu)", "ordered busy (compute/wait, cpu)"], rows)
    print(
        "  compute_s = seconds − wait_s; wait_s is only the time blocked on the inbox for a\n"
        "  peer's frame. compute_s therefore also contains frame encoding and any time the\n"
        f"  worker was runnable but had no core ({P}×{args.threads} compute threads + gRPC "
        f"threads on {ncores} cores),\n  so 'busy' = not blocked on a peer, not 'on a CPU'. "
        "cpu = CPU-seconds the process used per\n  wall second (all its threads, from /proc) "
        "over the steady window; 'other procs' = whole-machine busy\n  CPU (/proc/stat) minus "
        "the workers: this script, other users' jobs."
    )
    busy_ok = mean_busy["cyclic"] >= TARGET_BUSY
    print(
        f"  cyclic mean busy = {mean_busy['cyclic']:.3f} (min {min(cyc['busy']):.3f})  "
        f"(target ≥ {TARGET_BUSY}: {verdict(busy_ok)})"
    )
    print()

    # ---------------------------------------------------------------- figure 3
    elem_bytes = WIRE_BYTES[args.wire_dtype]
    act = B * mc.seq_len * mc.d_model * elem_bytes
    theory = P * K * 2 * act
    payload, header = frame_overhead(cyc_cfg)
    M = cyc_cfg.micro_batches
    print(
        f"3. Wire bytes per step (Δ cumulative bytes_sent over steady steps, summed over "
        f"workers)\n  theory P·K·2·(B·T·d)·{elem_bytes} = {P}·{K}·2·({B}·{mc.seq_len}·"
        f"{mc.d_model})·{elem_bytes} = {theory:,} B; one frame = {payload:,} B payload + "
        f"~{header} B header"
    )
    rows = []
    for x in (cyc, ordd):
        o = x["order"]
        hops = hop_frames(o, P, args.loops)
        relay_theory = sum(hops) * act
        measured = sum(x["bytes/step"])
        rows.append(
            [
                o,
                " ".join(f"{b / 1e6:.2f}" for b in x["bytes/step"]),
                " ".join(f"{h * M * (payload + header) / 1e6:.2f}" for h in hops),
                f"{measured:,.0f}",
                f"{relay_theory:,}",
                f"{measured / theory:.4f}",
                f"{measured / relay_theory:.4f}",
            ]
        )
    table(
        [
            "order",
            "per worker MB",
            "expected MB",
            "measured B",
            "hops theory B",
            "÷ P·K·2",
            "÷ hops",
        ],
        rows,
    )
    print(
        "  hops theory = frames on ring_hops (relays included) × B·T·d·bytes; expected MB per\n"
        "  worker includes headers. Window edges: frames still queued for gRPC when a row is\n"
        "  written count in the next step (cancels over the window in steady state)."
    )
    bytes_ratio = sum(cyc["bytes/step"]) / theory
    bytes_ok = bytes_ratio <= TARGET_BYTES
    print(
        f"  cyclic ratio = {bytes_ratio:.4f}  (target ≤ {TARGET_BYTES}: {verdict(bytes_ok)}); "
        f"ordered = {sum(ordd['bytes/step']) / theory:.4f} "
        f"(relay-inclusive theory {sum(hop_frames('ordered', P, args.loops)) / (P * K * 2):.2f}×)"
    )
    print()

    # ----------------------------------------------------------------- summary
    print("Summary")
    table(
        ["figure", "value", "target", "result"],
        [
            [
                f"ring cyclic ÷ reference ({args.ref_threads} thr) tokens/s",
                f"{tput:.3f}",
                f"≥ {TARGET_THROUGHPUT}",
                verdict(tput >= TARGET_THROUGHPUT),
            ],
            [
                "cyclic mean busy fraction",
                f"{mean_busy['cyclic']:.3f}",
                f"≥ {TARGET_BUSY}",
                verdict(busy_ok),
            ],
            ["ordered mean busy fraction", f"{mean_busy['ordered']:.3f}", "(info)", ""],
            [
                "cyclic wire bytes ÷ P·K·2·BTd·b",
                f"{bytes_ratio:.4f}",
                f"≤ {TARGET_BYTES}",
                verdict(bytes_ok),
            ],
            [
                "ordered wire bytes ÷ P·K·2·BTd·b",
                f"{sum(ordd['bytes/step']) / theory:.4f}",
                "(info)",
                "",
            ],
        ],
    )
    others = [x["other"] for x in [*refs, cyc, ordd] if x["other"] is not None]
    if others and max(others) > 0.15:
        print(
            f"  WARNING: other processes kept up to {max(others):.2f} of {ncores} cores busy "
            "during the timed phases; throughput and busy figures are depressed (and the\n"
            "  reference and ring may be affected unequally). Rerun on a quiet machine."
        )
    print(f"  total benchmark time {time.perf_counter() - t_start:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
