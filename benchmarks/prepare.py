"""Data preparation at scale: text MB/s and peak RSS of ``prepare`` against the alternatives,
and loader batches/s over many shards against one (data §benchmark).

On generated JSON-lines text of each size (the embedded corpus's paragraphs shuffled with a
different seed per copy, written under ``--tmp``, never committed), each method runs in its
own process; the peak RSS is that process tree's (pool workers included), sampled from
/proc every 50 ms:

- ``prepare``: this package's streaming ``prepare --site 0`` (``--workers`` processes);
- ``old``: the one-array ``prepare`` of commit ``--old-commit`` (``git archive``d to a
  temporary directory), skipped above ``--old-max-gb`` because it holds ~18 bytes of RAM
  per byte of text;
- ``fineweb``: the well-known FineWeb recipe: ``multiprocessing.Pool(workers).imap`` of
  ``encode_ordinary`` + EOT per document into 100 M-token uint16 shards;
- ``ceiling``: tiktoken's raw ``encode_ordinary_batch`` on the same threads, nothing written.

    python benchmarks/prepare.py --sizes 0.1 1 --workers 2 --results out.jsonl
    python benchmarks/prepare.py --sizes 3 --methods prepare --workers 2   # long
    python benchmarks/prepare.py --loader-only --loader-rounds 31

Besides MB/s, each row has the CPU seconds of the method's process tree (MB per CPU
second moves less with other jobs on shared cores) and the load average around it.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

METHODS = ("ceiling", "prepare", "fineweb", "old")


# --- generated corpus ---------------------------------------------------------------------------


def generate(path: Path, gigabytes: float) -> Path:
    """JSON lines of ~4 kB documents until ``gigabytes`` of text (reused when present)."""
    want = int(gigabytes * 1e9)
    if path.is_file() and path.stat().st_size >= want:
        return path
    from mobius_fed.data import embedded_corpus

    paragraphs = [p for p in embedded_corpus().split("\n\n") if p.strip()]
    tmp = path.with_suffix(".tmp")
    written, seed = 0, 0
    with open(tmp, "w", encoding="utf-8") as f:
        while written < want:
            rng = random.Random(seed)
            order = paragraphs[:]
            rng.shuffle(order)
            doc: list[str] = []
            for p in order:
                doc.append(p)
                if sum(map(len, doc)) > 4000:
                    line = json.dumps({"text": "\n\n".join(doc)}) + "\n"
                    f.write(line)
                    written += len(line)
                    doc = []
                    if written >= want:
                        break
            seed += 1
    os.replace(tmp, path)
    return path


def documents(path: Path) -> Iterator[str]:
    with open(path, encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)["text"]


# --- the methods (each runs in its own process: `--run METHOD`) -----------------------------------


def run_prepare(src: Path, out: Path, workers: int, encoding: str) -> int:
    from mobius_fed.data.prepare import PrepareOptions, prepare_site

    with open(os.devnull, "w") as quiet:
        opts = PrepareOptions(encoding=encoding, workers=workers, progress=False, log=quiet)
        site = prepare_site([src], out, 0, options=opts)
    meta = json.loads((site / "meta.json").read_text())
    return int(meta["train_tokens"] + meta["val_tokens"])


def _old_package(commit: str, into: Path) -> None:
    """The data package of ``commit`` as the importable package ``old_data``."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", commit, "mobius_fed/data"],
        check=True,
        capture_output=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    (into / "mobius_fed" / "data").rename(into / "old_data")
    for py in (into / "old_data").glob("*.py"):
        text = py.read_text().replace("mobius_fed.data.", "old_data.")
        py.write_text(text.replace("from mobius_fed.data import", "from old_data import"))


def run_old(src: Path, out: Path, commit: str, encoding: str) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        _old_package(commit, Path(tmp))
        sys.path.insert(0, tmp)
        from old_data.prepare import prepare_sites  # type: ignore[import-not-found]

        dirs = prepare_sites([src], out, 1, encoding)
        meta = json.loads((dirs[0] / "meta.json").read_text())
        return int(meta["train_tokens"] + meta["val_tokens"])


_FW_ENC = None


def _fw_init(encoding: str) -> None:
    global _FW_ENC
    from mobius_fed.data.tokenizers import get_encoding

    _FW_ENC = get_encoding(encoding)


def _fw_tokenize(doc: str):
    import numpy as np

    assert _FW_ENC is not None
    tokens = [_FW_ENC.eot_token, *_FW_ENC.encode_ordinary(doc)]
    return np.array(tokens, dtype=np.uint16)


def run_fineweb(src: Path, out: Path, workers: int, encoding: str) -> int:
    """modded-nanogpt's data/fineweb.py, reading our JSON lines instead of a HF dataset."""
    import numpy as np

    from mobius_fed.data.shards import write_shard

    shard_size, total, index = 10**8, 0, 0
    out.mkdir(parents=True, exist_ok=True)
    with multiprocessing.get_context("spawn").Pool(
        workers, initializer=_fw_init, initargs=(encoding,)
    ) as pool:
        buf = np.empty((shard_size,), dtype=np.uint16)
        count = 0
        for tokens in pool.imap(_fw_tokenize, documents(src), chunksize=16):
            if count + len(tokens) < shard_size:
                buf[count : count + len(tokens)] = tokens
                count += len(tokens)
            else:
                room = shard_size - count
                buf[count:] = tokens[:room]
                write_shard(out / f"fineweb_{index:06d}.bin", buf)
                index, total = index + 1, total + shard_size
                count = len(tokens) - room
                buf[:count] = tokens[room:]
        if count:
            write_shard(out / f"fineweb_{index:06d}.bin", buf[:count])
            total += count
    return total


def run_ceiling(src: Path, workers: int, encoding: str) -> int:
    from mobius_fed.data.tokenizers import get_encoding

    enc = get_encoding(encoding)
    total, batch = 0, []
    for doc in documents(src):
        batch.append(doc)
        if len(batch) == 512:
            total += sum(map(len, enc.encode_ordinary_batch(batch, num_threads=workers)))
            batch = []
    if batch:
        total += sum(map(len, enc.encode_ordinary_batch(batch, num_threads=workers)))
    return total


# --- measuring -------------------------------------------------------------------------------


def _tree_rss(root: int) -> int:
    """Resident bytes of ``root`` and every descendant, from /proc."""
    parent: dict[int, int] = {}
    rss: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            parent[int(entry)] = int(fields[1])
            rss[int(entry)] = int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, IndexError, ValueError):
            continue
    tree, frontier = {root}, [root]
    while frontier:
        p = frontier.pop()
        for child, par in parent.items():
            if par == p and child not in tree:
                tree.add(child)
                frontier.append(child)
    return sum(rss.get(p, 0) for p in tree)


def measure(method: str, src: Path, out: Path, args: argparse.Namespace) -> dict:
    cmd = [
        sys.executable, __file__, "--run", method, "--src", str(src), "--out", str(out),
        "--workers", str(args.workers), "--encoding", args.encoding,
        "--old-commit", args.old_commit,
    ]  # fmt: skip
    load_before = os.getloadavg()[0]  # 1-minute load average: other jobs on the cores
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    peak = 0
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, _tree_rss(proc.pid))
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    stdout, _ = proc.communicate()
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)  # the method's tree, pool included
    cpu = (after.ru_utime - usage.ru_utime) + (after.ru_stime - usage.ru_stime)
    done.set()
    sampler.join()
    if proc.returncode != 0:
        raise SystemExit(f"{method} failed (exit {proc.returncode})")
    tokens = int(stdout.strip().splitlines()[-1])
    size = src.stat().st_size
    return {"method": method, "gb": size / 1e9, "mb_s": size / 1e6 / wall, "wall_s": wall,
            "cpu_s": cpu, "mb_per_cpu_s": size / 1e6 / cpu,
            "peak_rss_gb": peak / 1e9, "tokens": tokens, "workers": args.workers,
            "encoding": args.encoding, "load_before": load_before,
            "load_after": os.getloadavg()[0],
            "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}  # fmt: skip


def loader_bench(tmp: Path, total: int = 40_000_000, steps: int = 2000, rounds: int = 15) -> dict:
    """Batches/s of SiteData (seq_len 1024, batch 8) over 1 shard and over 20 of the same
    tokens: pages touched once first, then ``rounds`` rounds of ``steps`` steps, each step
    drawing the same batch from both in turn (which goes first alternates), so that both
    see the same state of the shared machine's caches. Timed in CPU seconds of this
    (single-threaded) process, so that time on other jobs does not count; the 20 ÷ 1
    ratio is taken within each round and reported as median, min and max over rounds."""
    import numpy as np
    import torch

    torch.set_num_threads(1)

    from mobius_fed.data import SiteData, write_shard

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 50257, total, dtype=np.uint16)
    sites = {}
    for shards in (1, 20):
        site = tmp / f"loader-{shards}"
        shutil.rmtree(site, ignore_errors=True)
        site.mkdir(parents=True)
        for k, piece in enumerate(np.array_split(tokens, shards)):
            write_shard(site / f"train_{k:06d}.bin", piece)
        write_shard(site / "val_000000.bin", tokens[:100_000])
        sites[shards] = SiteData(site, seq_len=1024, site=0)
        sites[shards].max_token()  # every page mapped once
    rates: dict[int, list[float]] = {1: [], 20: []}
    clock = time.process_time
    for _ in range(rounds):
        spent = dict.fromkeys(sites, 0.0)
        for step in range(steps):
            for shards in (1, 20) if step % 2 == 0 else (20, 1):
                start = clock()
                sites[shards].batch("train", seed=0, step=step, batch_size=8)
                spent[shards] += clock() - start
        for shards in sites:
            rates[shards].append(steps / spent[shards])
    ratios = sorted(b / a for a, b in zip(rates[1], rates[20], strict=True))
    return {
        "batches_s_1": statistics.median(rates[1]),
        "batches_s_20": statistics.median(rates[20]),
        "ratio": statistics.median(ratios),
        "ratio_min": ratios[0],
        "ratio_max": ratios[-1],
        "rounds": rounds,
        "steps": steps,
        "load": os.getloadavg()[0],
    }


def _record(path: Path | None, row: dict) -> None:
    """Append one result as a JSON line (the run's rows stay if a later size is cut short)."""
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sizes", type=float, nargs="+", default=[0.1, 1.0], help="GB of text")
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    p.add_argument("--encoding", default="bytes")
    p.add_argument("--old-commit", default="8fbc54b", help="the one-array prepare's commit")
    p.add_argument("--old-max-gb", type=float, default=0.5, help="skip `old` above this")
    p.add_argument("--tmp", type=Path, default=Path(tempfile.gettempdir()) / "mobius-prepare")
    p.add_argument("--results", type=Path, help="append every row here as a JSON line")
    p.add_argument("--loader-rounds", type=int, default=15)
    p.add_argument("--keep-text", action="store_true", help="keep the generated text files")
    p.add_argument("--loader-only", action="store_true")
    p.add_argument("--no-loader", action="store_true")
    p.add_argument("--run", choices=METHODS, help=argparse.SUPPRESS)
    p.add_argument("--src", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.run:  # one measured method, in its own process
        shutil.rmtree(args.out, ignore_errors=True)
        if args.run == "prepare":
            n = run_prepare(args.src, args.out, args.workers, args.encoding)
        elif args.run == "old":
            n = run_old(args.src, args.out, args.old_commit, args.encoding)
        elif args.run == "fineweb":
            n = run_fineweb(args.src, args.out, args.workers, args.encoding)
        else:
            n = run_ceiling(args.src, args.workers, args.encoding)
        shutil.rmtree(args.out, ignore_errors=True)
        print(n)
        return
    args.tmp.mkdir(parents=True, exist_ok=True)
    if not args.loader_only:
        print(f"encoding {args.encoding}, {args.workers} worker(s), text in {args.tmp}")
        print("| GB | method | MB/s | × ceiling | MB per CPU s | peak RSS GB | tokens | load |")
        print("|---|---|---|---|---|---|---|---|")
        for gb in args.sizes:
            src = generate(args.tmp / f"text-{gb:g}GB.jsonl", gb)
            rows = {}
            for method in args.methods:
                if method == "old" and gb > args.old_max_gb:
                    print(
                        f"| {gb:g} | old | skipped: ~{18 * gb:.0f} GB of RAM |  |  |  |", flush=True
                    )
                    _record(args.results, {"method": "old", "gb": gb, "skipped": "RAM"})
                    continue
                rows[method] = r = measure(method, src, args.tmp / f"out-{method}", args)
                ratio = r["mb_s"] / rows["ceiling"]["mb_s"] if "ceiling" in rows else float("nan")
                _record(args.results, {**r, "x_ceiling": ratio})
                print(
                    f"| {gb:g} | {method} | {r['mb_s']:.2f} | {ratio:.2f} | "
                    f"{r['mb_per_cpu_s']:.1f} | {r['peak_rss_gb']:.2f} | {r['tokens']:,} | "
                    f"{r['load_before']:.1f}–{r['load_after']:.1f} |",
                    flush=True,
                )
            if not args.keep_text:
                src.unlink()
    if not args.no_loader:
        r = loader_bench(args.tmp, rounds=args.loader_rounds)
        _record(args.results, {"method": "loader", **r})
        print(
            f"loader (seq 1024, batch 8), median of {r['rounds']} rounds: 1 shard "
            f"{r['batches_s_1']:.0f} batches/s, 20 shards {r['batches_s_20']:.0f} batches/s, "
            f"ratio {r['ratio']:.3f} (min {r['ratio_min']:.3f}, max {r['ratio_max']:.3f})"
        )
        for shards in (1, 20):
            shutil.rmtree(args.tmp / f"loader-{shards}", ignore_errors=True)


if __name__ == "__main__":
    main()
