"""``mobius-worker`` without a coordinator: a static ring of peers trains together.

E/R replicas stay local in this mode (the reference engine with ``sync_every = 0``).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from mobius_fed.checkpoint import save_checkpoint
from mobius_fed.data import SiteData
from mobius_fed.relay.edges import EdgeTunnels
from mobius_fed.transport.revocation import CrlSource
from mobius_fed.transport.tls import check_node_secrets
from mobius_fed.worker.commitments import FrameLedger
from mobius_fed.worker.config import WorkerConfig
from mobius_fed.worker.executor import RingExecutor
from mobius_fed.worker.link import RingLinks

log = logging.getLogger("mobius.worker")


def make_links(
    cfg: WorkerConfig,
    executor: RingExecutor,
    run_key: bytes = b"",
    identities: Sequence[str] = (),
    ledger: FrameLedger | None = None,
) -> RingLinks | None:
    """The ring links of ``executor`` for ``cfg`` (not started; None when P = 1).

    Peers given as ring entries (relay/plan.py) get tunnels on the edges that need them;
    ``identities``: who holds each global rank after a handover (the coordinator's word);
    ``ledger``: where the links record each frame's digest (audit.commitments)."""
    if cfg.train.P == 1:
        return None
    tunnels = None
    if any(";" in p for p in cfg.peers):
        keys = cfg.tunnel_keys(run_key)
        tunnels = EdgeTunnels(
            cfg.peers, executor.rank, executor.rules.run_id, keys, cfg.tunnel_listen
        )
    return RingLinks(
        executor.rules,
        listen=cfg.listen_address,
        successor=cfg.successor,
        tls=cfg.tls(),
        insecure=cfg.insecure,
        peer_timeout=cfg.peer_timeout,
        capture=cfg.capture_frames,
        link_grace=cfg.link_grace,
        tuning=cfg.link.tuning(),
        tunnels=tunnels,
        ring_base=(cfg.rank or 0) - executor.rank,  # R rings: site r·P + i runs F_i
        identities=tuple(identities),  # after a handover: who holds each rank
        ledger=ledger,
    )


def run_static_ring(cfg: WorkerConfig) -> Path:
    """Train ``cfg.train.steps`` steps on a static ring; return the metrics file."""
    train = cfg.train
    if not cfg.insecure:
        check_node_secrets(cfg.node_tls(), role="worker")
        CrlSource(cfg.node_tls()).watch()  # crl.pem beside ca.crt
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    site = SiteData(cfg.data_dir, train.model().seq_len, train.encoding)
    if cfg.rank is None:  # the config's validator asks for it first
        raise ValueError("a static ring needs --rank")
    executor = RingExecutor(train, cfg.rank, site, cfg.run_id, cfg.peer_timeout)
    executor.slowdown = cfg.emulate_slowdown
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    metrics = out / "metrics.jsonl"
    metrics.write_text("")
    links = make_links(cfg, executor)
    if links is not None:  # serve the predecessor, connect to the successor
        links.start_server()
        links.connect()
        executor.links = links
    log.info(
        "worker-%d: %s, P=%d L=%d order=%s, %d steps",
        cfg.rank,
        train.preset,
        train.P,
        train.loops,
        train.order,
        train.steps,
    )
    start = time.perf_counter()
    try:
        with metrics.open("a") as f:
            while executor.step < train.steps:
                _train_step(cfg, executor, links, f)
        save_checkpoint(out / f"worker-{cfg.rank}.pt", executor.state_dict())
    except BaseException:
        if links is not None:
            links.close()  # no FIN: peers must see that this worker did not finish
        raise
    if links is not None:
        links.finish(timeout=cfg.peer_timeout)
    log.info("worker-%d done in %.1fs", cfg.rank, time.perf_counter() - start)
    if executor.bounds.peak:  # how close the run came to its bounds (docs/security.md)
        log.info("worker-%d: largest ratio to a sender's running median: %s", cfg.rank,
                 executor.bounds.margin())  # fmt: skip
    return metrics


def peak_bytes(device: torch.device) -> int | None:
    """This process's peak memory so far: CUDA's allocated peak, else the peak resident set
    (VmHWM, Linux); None where neither can be read."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _train_step(cfg: WorkerConfig, executor: RingExecutor, links: RingLinks | None, f) -> None:
    """One step on the static ring, its line in metrics.jsonl (and an evaluation's, when due)."""
    train, r = cfg.train, executor.train_step()
    row = {
        "step": r.step,
        "origin": cfg.rank,
        "loss": r.loss,
        "compute_s": r.compute_s,
        "wait_s": r.wait_s,
        "seconds": r.seconds,
        "bytes_sent": links.bytes_sent if links else 0,
        "peak_bytes": peak_bytes(executor.device),
        **executor.bounds.report(),  # refused frames per sender and suspects, once any
    }
    f.write(json.dumps(row) + "\n")
    f.flush()
    log.info(
        "worker-%d step %d loss %.4f (%.2fs, waited %.2fs)",
        cfg.rank,
        r.step,
        r.loss,
        r.seconds,
        r.wait_s,
    )
    last = executor.step == train.steps
    if last or (train.eval_every and executor.step % train.eval_every == 0):
        val = executor.evaluate()
        f.write(json.dumps({"step": executor.step, "origin": cfg.rank, "eval_loss": val}) + "\n")
        log.info("worker-%d validation loss (origin %d) %.4f", cfg.rank, cfg.rank, val)
