"""``mobius-fed status``: print a running coordinator's status as a table.

Reads the status document over the coordinator's mTLS gRPC control service (default) or
its REST API (``--rest URL``), both with the operator certificate; ``--rest`` also takes a
plain ``http://127.0.0.1:PORT`` URL of a coordinator serving REST in local mode.
Without ``--coordinator``/``--rest`` it finds the coordinator of ``--run DIR`` (default
``./runs/up``) from the ``endpoints.json`` that ``mobius-fed up`` writes there, and reports
that run like ``docker compose ps``: starting, answering, or dead/exited with its last known
state (docs/operations.md §3).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from rich.console import Console, OverflowMethod
from rich.table import Table

from mobius_fed.cli.common import CliError, add_run_flag, run_endpoints
from mobius_fed.coordinator.endpoints import Endpoints
from mobius_fed.coordinator.rest_client import get_status
from mobius_fed.machines import EdgeState as E
from mobius_fed.machines import IncidentState, Phase, RingState
from mobius_fed.machines import WorkerState as W
from mobius_fed.transport.tls import NodeTLS

DEFAULT_COORDINATOR = "127.0.0.1:7300"


def add_operator_flags(p: argparse.ArgumentParser, certs_help: str) -> None:
    """``--run``, ``--coordinator`` and ``--certs``: where an operator command finds the
    coordinator's control address and the operator's certificates."""
    add_run_flag(p)
    p.add_argument(
        "--coordinator",
        default=None,
        metavar="ADDR",
        help=f"coordinator gRPC control address (default: from --run, else {DEFAULT_COORDINATOR})",
    )
    p.add_argument("--certs", type=Path, default=None, metavar="DIR", help=certs_help)


def register(subparsers: Any) -> None:
    """Register ``status`` on an ``argparse`` subparsers object."""
    p = subparsers.add_parser(
        "status",
        help="show a running coordinator's status",
        description="Show run phase, round, step, losses and every worker's state. "
        "Finds the coordinator of --run DIR (default ./runs/up) unless --coordinator or "
        "--rest is given.",
    )
    add_operator_flags(
        p,
        "directory with ca.crt, operator.crt, operator.key, or the operator's bundle "
        "with ca.crt, tls.crt, tls.key (default: from --run, else certs)",
    )
    p.add_argument(
        "--rest",
        metavar="URL",
        help="read REST GET /v1/status at URL instead (https://HOST:PORT, or "
        "http://127.0.0.1:PORT for a coordinator in local mode)",
    )
    p.add_argument("--json", action="store_true", help="print the raw status document")
    p.add_argument(
        "--timeout",
        type=float,
        default=5.0,
        help="seconds to wait for an answer, also for a run still starting (default 5)",
    )
    p.set_defaults(func=status_main)


def status_main(args: argparse.Namespace) -> int:
    """Fetch and print the status; CliError (exit 2) when it cannot be read. A run found
    through its endpoints.json that is starting or no longer running is reported as such
    (:data:`EXIT_STARTING`, :data:`EXIT_NOT_RUNNING`)."""
    rest, addr, run = args.rest, args.coordinator, getattr(args, "run", None)
    timeout = float(args.timeout or 5.0)
    console = Console(soft_wrap=True)
    ep = None
    if run is not None or not (rest or addr):
        ep = run_endpoints(run)
        if ep is not None and not (rest or addr):
            return run_status(ep, args.certs, timeout, args.json, console)
    certs = Path(args.certs or (ep.certs_dir if ep else "certs"))
    if rest:
        doc = fetch_rest_status(rest, certs, timeout)
    else:
        doc = fetch_grpc_status(addr or (ep.grpc if ep else DEFAULT_COORDINATOR), certs, timeout)
    _print(doc, as_json=args.json, console=console)
    return 0


# --------------------------------------------------------------------------- a run's state
EXIT_NOT_RUNNING = 3  # the run has exited or died: its last known state was printed
EXIT_STARTING = 75  # EX_TEMPFAIL: starting, its coordinator did not answer within --timeout
POLL_S = 0.25


class Unreachable(CliError):
    """Nothing answered at the coordinator's address (yet)."""


def _print(doc: dict[str, Any], *, as_json: bool, console: Console) -> None:
    if as_json:
        console.print_json(json.dumps(doc, allow_nan=True))
    else:
        render_status(doc, console)


def run_status(
    ep: Endpoints, certs: Path | None, timeout: float, as_json: bool, console: Console
) -> int:
    """The status of the ``up`` run ``ep`` describes, like ``docker compose ps``: the
    coordinator's own while it answers; "starting" while ``up`` prepares (waiting up to
    ``timeout`` seconds for an answer); dead or exited, with the last known state from the
    run directory, once ``up`` is gone."""
    deadline = time.monotonic() + timeout
    while ep.state != "exited" and ep.alive() is not False:  # up still runs
        try:
            tls_dir = Path(certs or ep.certs_dir)
            remaining = max(0.5, deadline - time.monotonic())
            doc = fetch_grpc_status(ep.grpc, tls_dir, min(timeout, remaining))
        except CliError as exc:  # not answering (yet): starting, or restarting its coordinator
            if not (isinstance(exc, Unreachable) or ep.state == "starting"):
                raise
            if time.monotonic() >= deadline:
                if ep.state == "starting":
                    return _report_starting(ep, timeout, as_json, console)
                raise CliError(
                    f"{exc}. The `mobius-fed up` that runs it (pid {ep.pid}) is alive: its "
                    f"coordinator may be restarting; see {ep.path.parent / 'logs'}"
                ) from None
            time.sleep(POLL_S)
            ep = _reread(ep)
            continue
        _print(doc, as_json=as_json, console=console)
        return 0
    return _report_not_running(ep, as_json, console)


def _reread(ep: Endpoints) -> Endpoints:
    """endpoints.json again (``up`` rewrites it as its state moves on)."""
    from mobius_fed.coordinator.endpoints import EndpointsError, read_endpoints

    try:
        return read_endpoints(ep.path)
    except EndpointsError:  # replaced right now: keep what we had
        return ep


def _since(path: Path) -> float:
    try:
        return max(0.0, time.time() - path.stat().st_mtime)
    except OSError:
        return 0.0


def _report_starting(ep: Endpoints, timeout: float, as_json: bool, console: Console) -> int:
    run = ep.path.parent
    if as_json:
        doc = {"run": str(run), "state": "starting", "pid": ep.pid, "since_s": _since(ep.path)}
        console.print_json(json.dumps(doc))
        return EXIT_STARTING
    console.print(
        f"run {run}: [yellow]starting[/] (`mobius-fed up` pid {ep.pid}, "
        f"{_since(ep.path):.0f}s ago): certificates, site data and processes are being "
        f"prepared, and its coordinator did not answer within {timeout:g}s. Wait for it "
        f"with: mobius-fed status --run {run} --timeout 60",
        highlight=False,
    )
    return EXIT_STARTING


def _report_not_running(ep: Endpoints, as_json: bool, console: Console) -> int:
    """A run nobody serves any more: dead (``up`` gone without a clean stop) or exited,
    with its last known state from the coordinator's files."""
    from mobius_fed.coordinator.run_dir import last_known

    run = ep.path.parent
    state = "exited" if ep.state in ("exited", None) else "dead"
    known = last_known(ep.out_dir) if ep.out_dir else None
    if as_json:
        doc = {
            "run": str(run),
            "state": state,
            "pid": ep.pid,
            "last_known": known.status if known else None,
            "last_known_at": known.written_at if known else None,
            "checkpoint": str(known.checkpoint) if known and known.checkpoint else None,
        }
        console.print_json(json.dumps(doc, allow_nan=True))
        return EXIT_NOT_RUNNING
    up = f"its `mobius-fed up` (pid {ep.pid})"
    if state == "dead":
        what = (
            f"[bold red]dead[/]: {up} is gone without a clean stop (killed?), and its "
            "coordinator and workers with it"
        )
    else:
        what = f"[yellow]exited[/]: {up} has ended; nothing serves its status any more"
    console.print(f"run {run}: {what}", highlight=False)
    if known is None:
        console.print(f"last known state: none recorded in {ep.out_dir}", highlight=False)
    else:
        console.print(
            f"last known state: {known.summary()} ({known.source.name}, {known.age():.0f}s ago)",
            highlight=False,
        )
        checkpoint = known.checkpoint or "none"
        console.print(f"last complete checkpoint: {checkpoint}", highlight=False)
    if state == "dead" or (known and known.status.get("phase") != "done"):
        console.print(f"continue it with: mobius-fed up --out {run} --resume", highlight=False)
    return EXIT_NOT_RUNNING


# --------------------------------------------------------------------------- fetching
def operator_tls(certs: Path) -> NodeTLS:
    """The operator's TLS files in ``certs``; CliError naming what is missing.

    ``certs`` is either the directory ``mobius-fed certs init`` wrote (``ca.crt``,
    ``operator.crt``, ``operator.key``) or the operator's bundle (``nodes/operator``:
    ``ca.crt``, ``tls.crt``, ``tls.key``).
    """
    tls = NodeTLS(ca=certs / "ca.crt", cert=certs / "operator.crt", key=certs / "operator.key")
    bundle = NodeTLS(ca=certs / "ca.crt", cert=certs / "tls.crt", key=certs / "tls.key")
    if not tls.cert.is_file() and bundle.cert.is_file():
        tls = bundle
    missing = [str(p) for p in (tls.ca, tls.cert, tls.key) if not p.is_file()]
    if missing:
        raise CliError(
            f"operator certificate files not found: {', '.join(missing)} "
            "(pass --certs DIR; make them with: mobius-fed certs init)"
        )
    return tls


def fetch_grpc_status(addr: str, certs: Path, timeout: float) -> dict[str, Any]:
    """``GetStatus`` over mTLS gRPC as the operator."""
    import grpc

    try:
        text = get_status(addr, operator_tls(certs), timeout)
    except grpc.RpcError as exc:
        code = exc.code() if hasattr(exc, "code") else None
        detail = exc.details() if hasattr(exc, "details") else str(exc)
        if code in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED):
            raise CliError(f"coordinator at {addr} refused the status request: {detail}") from None
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            raise Unreachable(
                f"cannot reach coordinator at {addr} ({code.name.lower()}): {detail}"
            ) from None
        name = code.name if code is not None else type(exc).__name__
        raise CliError(f"status request to {addr} failed ({name}): {detail}") from None
    try:
        return json.loads(text)
    except ValueError as exc:
        raise CliError(f"coordinator at {addr} sent an unreadable status document: {exc}") from None


def fetch_rest_status(url: str, certs: Path, timeout: float) -> dict[str, Any]:
    """``GET /v1/status`` over mutual TLS (operator cert), or plain local-mode HTTP."""
    import httpx

    from mobius_fed.coordinator.rest_client import RestClientError, base_url, client_options

    try:
        scheme, _, base = base_url(url)
        verify, extensions = client_options(url, operator_tls(certs) if scheme == "https" else None)
    except RestClientError as exc:
        raise CliError(f"--rest: {exc}") from None
    base += urlsplit(url if "://" in url else f"https://{url}").path.rstrip("/")
    target = base if base.endswith("/v1/status") else f"{base}/v1/status"
    try:
        with httpx.Client(verify=verify, timeout=timeout) as client:
            resp = client.get(target, extensions=extensions)
    except httpx.ConnectError as exc:
        raise CliError(f"cannot reach coordinator REST at {target}: {exc}") from None
    except httpx.TimeoutException as exc:
        raise CliError(f"coordinator REST at {target} timed out: {exc}") from None
    except httpx.TransportError as exc:  # e.g. mTLS rejection seen as a dropped connection
        raise CliError(
            f"coordinator REST at {target} dropped the connection ({type(exc).__name__}: "
            f"{exc}); is the operator certificate from this run's CA?"
        ) from None
    if resp.status_code != 200:
        try:
            detail = resp.json().get("detail", resp.text)
        except ValueError:
            detail = resp.text.strip()[:200]
        what = "refused the status request" if resp.status_code in (401, 403) else "answered"
        raise CliError(f"coordinator REST at {target} {what}: HTTP {resp.status_code} {detail}")
    try:
        return resp.json()
    except ValueError as exc:
        raise CliError(f"coordinator REST at {target} sent unreadable JSON: {exc}") from None


# --------------------------------------------------------------------------- rendering
def _num(value: Any, fmt: str = "{:.4f}") -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return fmt.format(value)


def _age(worker: dict[str, Any], doc: dict[str, Any]) -> str:
    age = worker.get("heartbeat_age_s")
    if age is None and worker.get("last_heartbeat") is not None:
        now = doc.get("server_time") or time.time()
        age = max(0.0, now - worker["last_heartbeat"])
    return _num(age, "{:.1f}")


_STATE_STYLE = {
    W.LOST: "bold red",
    W.REJOINING: "yellow",
    W.RESTORING: "yellow",
    W.RECOVERED: "green",
    W.EXPECTED: "dim",
    W.DONE: "green",
    W.FINISHED: "green",
    W.STOPPED: "yellow",
    W.TRAINING: "cyan",
}
_PHASE_STYLE = {
    Phase.FAILED: "bold red",
    Phase.STOPPED: "yellow",
    Phase.RECOVERING: "bold yellow",
    Phase.DONE: "green",
    Phase.TRAINING: "cyan",
}
_RING_STYLE = {
    RingState.STALLED: "bold red",
    RingState.RESTORING: "yellow",
    RingState.RECONNECTING: "yellow",
    RingState.WAITING: "dim",
    RingState.HEALTHY: "green",
    RingState.ENDED: "dim",
}
_EDGE_STYLE = {E.DOWN: "bold red", E.RECONNECTING: "yellow", E.UP: "green", E.CLOSED: "dim"}
_INCIDENT_STYLE = {
    IncidentState.OPEN: "bold yellow",
    IncidentState.FAILED: "bold red",
    IncidentState.RECOVERED: "green",
}


def _styled(text: str, styles: Mapping[Any, str]) -> str:  # keys: a state enum's members
    style = styles.get(text)
    return f"[{style}]{text}[/]" if style else text


def render_status(doc: dict[str, Any], console: Console) -> None:
    """The run summary table, then one row per worker."""
    run = _table("mobius-fed run", ("run id", "phase", "round", "step", "eval loss", "error"))
    run.add_row(
        str(doc.get("run_id", "?")),
        _styled(str(doc.get("phase", "?")), _PHASE_STYLE),
        f"{doc.get('round', 0)}/{doc.get('num_rounds', 0)}",
        f"{doc.get('step', 0)}/{doc.get('steps', 0)}",
        _num(doc.get("eval_loss")),
        str(doc.get("error") or "-"),
    )
    console.print(run)
    rings = int(doc.get("rings") or 1)
    title = "workers" if rings == 1 else f"workers: {rings} rings"
    workers = Table(title=title, show_header=True, header_style="bold")
    cols = ("rank", "address", "state", "heartbeat age (s)", "last loss", "tokens/s")
    for col in ("ring", *cols) if rings > 1 else cols:
        workers.add_column(col, justify="left" if col in ("address", "state") else "right")
    for w in doc.get("workers", []):
        ring = [str(w.get("ring", "?"))] if rings > 1 else []
        workers.add_row(
            *ring,
            str(w.get("rank", "?")),
            str(w.get("address") or "-"),
            _styled(str(w.get("state", "?")), _STATE_STYLE),
            _age(w, doc),
            _num(w.get("last_loss")),
            _num(w.get("tokens_per_s"), "{:,.0f}"),
        )
    console.print(workers)
    if rings > 1 and doc.get("ring_health"):
        console.print(_rings_table(doc["ring_health"]))
    if pace := doc.get("pace"):
        console.print(_pace_table(doc.get("workers", [])))
        console.print(
            f"pace: {pace['summary']} (compute per step {pace['step_compute_s']:.3g} s, the "
            f"next slowest {pace['others_s']:.3g} s)",
            highlight=False,
        )
    if timeline := doc.get("timeline"):
        console.print(f"time per step, round {timeline['round']}: {timeline['summary']}",
                      highlight=False)  # fmt: skip
    if doc.get("ring"):
        console.print(_ring_table(doc["ring"]))
    if doc.get("incidents"):
        console.print(_incident_table(doc["incidents"]))
    if doc.get("handovers"):
        console.print(_handover_table(doc["handovers"]))
    if (standby := doc.get("standby") or {}).get("waiting"):
        console.print(_standby_line(standby), highlight=False)
    if doc.get("privacy"):
        console.print(_privacy_table(doc["privacy"]))
    if (commitments := doc.get("commitments") or {}).get("incidents"):
        console.print(_commitment_table(commitments))
    if (audits := doc.get("audits") or {}).get("incidents"):
        console.print(_audit_table(audits))


def _pace_table(workers: list[dict[str, Any]]) -> Table:
    """Each site measured: its group's blocks, compute per step and per block application."""
    sites = _table("sites", ("rank", "blocks", "compute/step (s)", "ms/block"))
    for w in workers:
        block_s = w.get("block_s")
        sites.add_row(
            str(w.get("rank", "?")),
            str(w.get("layers") or "-"),
            _num(w.get("step_compute_s"), "{:.3g}"),
            _num(None if block_s is None else block_s * 1e3, "{:.3g}"),
        )
    return sites


def _table(title: str, columns: tuple[str, ...], overflow: OverflowMethod = "fold") -> Table:
    table = Table(title=title, show_header=True, header_style="bold")
    for col in columns:
        table.add_column(col, overflow=overflow)
    return table


def ring_summary(doc: dict[str, Any]) -> str:
    """With R > 1, the rings that are not healthy, e.g. 'ring 1 stalled (worker-3 lost)';
    '' with one ring, or when every ring is healthy (or the run ended)."""
    if int(doc.get("rings") or 1) < 2:
        return ""
    quiet = (RingState.HEALTHY, RingState.ENDED)
    return "; ".join(
        f"ring {h['ring']} {h['state']}" + (f" ({h['reason']})" if h.get("reason") else "")
        for h in doc.get("ring_health") or []
        if h.get("state") not in quiet
    )


def _rings_table(rings: list[dict[str, Any]]) -> Table:
    """Each ring's health (R > 1): its workers, state, least step, edges up, what holds it."""
    table = _table("rings", ("ring", "workers", "state", "step", "edges up", "why"))
    for h in rings:
        ranks = h.get("workers") or []
        table.add_row(
            str(h.get("ring", "?")),
            f"{ranks[0]}–{ranks[-1]}" if ranks else "-",
            _styled(str(h.get("state", "?")), _RING_STYLE),
            str(h.get("step", "-")),
            f"{h.get('edges_up', 0)}/{h.get('edges', 0)}",
            str(h.get("reason") or "-"),
        )
    return table


def _ring_table(edges: list[dict[str, Any]]) -> Table:
    ring = _table("ring edges", ("edge", "state", "reconnects", "down (s)"), "ellipsis")
    for e in edges:
        ring.add_row(
            str(e.get("edge", "?")),
            _styled(str(e.get("state", "?")), _EDGE_STYLE),
            str(e.get("reconnects", 0)),
            _num(e.get("down_s"), "{:.1f}"),
        )
    return ring


def _incident_table(incidents: list[dict[str, Any]]) -> Table:
    cols = ("#", "state", "what", "detected (s)", "recovered (s)", "rollback", "redone")
    log = _table("incidents", cols)
    for i in incidents:
        log.add_row(
            str(i.get("id", "?")),
            _styled(str(i.get("state", "?")), _INCIDENT_STYLE),
            str(i.get("what", "")),
            _num(i.get("detection_s"), "{:.2f}"),
            _num(i.get("recovery_s"), "{:.2f}"),
            "-" if i.get("rollback_round") is None else f"round {i['rollback_round']}",
            "-" if i.get("steps_redone") is None else f"{i['steps_redone']} steps",
        )
    return log


def _commitment_table(block: dict[str, Any]) -> Table:
    """What the sites' signed frame digests showed (docs/security.md "Commitments")."""
    title = f"commitments ({block.get('frames_checked', 0)} frame hops agree)"
    log = _table(title, ("round", "step", "kind", "hop or site", "what"))
    for i in block["incidents"]:
        log.add_row(
            str(i.get("round", "?")),
            "-" if i.get("step") is None else str(i["step"]),
            str(i.get("kind", "?")),
            str(i.get("edge") or i.get("site") or "-"),
            str(i.get("what", "")),
        )
    return log


def _audit_table(block: dict[str, Any]) -> Table:
    """What the audits by recomputation found (docs/audits.md)."""
    title = f"audits ({block.get('passed', 0)} of {block.get('asked', 0)} passed)"
    log = _table(title, ("round", "step", "kind", "site", "what"))
    for i in block["incidents"]:
        log.add_row(
            str(i.get("round", "?")),
            "-" if i.get("step") is None else str(i["step"]),
            str(i.get("kind", "?")),
            str(i.get("site") or "-"),
            str(i.get("what", "")),
        )
    return log


def _standby_line(standby: dict[str, Any]) -> str:
    """``standby-0 waits: a handover redoes at most 5 steps (from step 35)``, or why not."""
    redo, copied = standby.get("redo_steps"), standby.get("copy_step")
    if redo is None:
        bound = f"no bound on the steps a handover redoes: {standby.get('note')}"
    else:
        bound = f"a handover redoes at most {redo} steps" + (
            " once the first copy is taken (none yet: it would start from step 0)"
            if copied is None
            else f" (it starts from the newest copy, step {copied})"
        )
    return f"standby: {', '.join(standby['waiting'])} waiting; {bound}"


def _handover_table(handovers: list[dict[str, Any]]) -> Table:
    """Ranks handed to standby sites (docs/recovery.md "Handover to a standby")."""
    log = _table("handovers", ("rank", "replaced", "standby", "from round", "why"))
    for h in handovers:
        log.add_row(
            str(h.get("rank", "?")),
            str(h.get("replaced", "?")),
            str(h.get("standby", "?")),
            "pending" if h.get("round") is None else str(h["round"]),
            str(h.get("why", "")),
        )
    return log


def _privacy_table(block: dict[str, Any]) -> Table:
    """The defences on, the noise key and (ε, δ) spent: the label defence's per target
    occurrence, the clipped input noise's per position / per sequence, the E/R's DP-FedAvg
    per whole site."""
    cols = ("defences", "noise key", "ε (labels)", "ε (inputs)", "ε (E/R, per site)", "δ")
    table = _table("privacy", cols)
    er, inputs = block.get("er") or {}, block.get("input") or {}
    input_eps = "-"
    if inputs:
        position, sequence = inputs.get("epsilon_position"), inputs.get("epsilon_sequence")
        input_eps = f"{_num(position, '{:.3g}')} / {_num(sequence, '{:.3g}')} (position / sequence)"
    table.add_row(
        ", ".join(str(d.get("name", "?")) for d in block.get("defences", [])) or "-",
        str(block.get("noise_key", "-")),
        _num(block.get("epsilon"), "{:.3g}"),
        input_eps,
        _num(er.get("epsilon"), "{:.3g}") + (f" ({er['rounds']} barriers)" if er else ""),
        _num(block.get("delta"), "{:g}"),
    )
    if block.get("error"):
        table.caption = str(block["error"])
    return table
