"""Turn text into per-site train/val shards, streaming, in bounded memory (data §prepare).

Two modes:

- :func:`prepare_site`: one site from its own files (``mobius-fed prepare --site i``),
  the realistic case: a site prepares its private corpus on its own host.
- :func:`prepare_sites`: one corpus cut into P contiguous, disjoint slices (experiments).

Both run in two passes. Pass 1 streams documents from the inputs through a pool of
tokenizers (threads for tiktoken encodings, processes otherwise) into fixed-size *parts*
(``OUT/.prepare-*/part_*.bin``), each written atomically and recorded in
``progress.json`` with the input position it ends at, so ``resume=True`` continues after
the last complete part. Pass 2 cuts the token stream into train/val shards of
``shard_tokens`` (parts that already line up are hard-linked, not copied) and writes
``meta.json``, the manifest. Memory is bounded by ``shard_tokens``-free quantities: the
task size, the number of tasks in flight and the copy chunk.
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import hashlib
import multiprocessing
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import tiktoken

from mobius_fed.data.errors import DataError
from mobius_fed.data.manifest import write_json
from mobius_fed.data.shards import (
    HEADER_BYTES,
    ShardWriter,
    read_shard,
    token_dtype,
)
from mobius_fed.data.sources import BadInput, Skips, Unit, expand_inputs, read_units
from mobius_fed.data.tokenizers import EOT, get_encoding
from mobius_fed.data.vocab import encoding_identity, encoding_vocab

DEFAULT_SHARD_TOKENS = 100_000_000  # modded-nanogpt's FineWeb shard size
TASK_BYTES = 1 << 20  # text per tokenizer task
COPY_TOKENS = 1 << 22  # tokens per copy in pass 2
TEXT_SOURCE = "<text>"
PROGRESS = "progress.json"


@dataclass
class PrepareOptions:
    """How to prepare; every field has the CLI flag of the same name (data §prepare)."""

    encoding: str = "bytes"
    val_fraction: float = 0.1
    shard_tokens: int = DEFAULT_SHARD_TOKENS
    workers: int = 1
    text_field: str = "text"
    skip_bad: bool = False
    resume: bool = False
    overwrite: bool = False
    progress: bool | None = None  # None: a bar on a terminal, plain lines otherwise
    log: TextIO | None = None  # where progress goes (default: stderr)


@dataclass
class Part:
    """One complete part of the token stream and the input position after it."""

    file: str
    tokens: int
    sha256: str
    source: int  # resume: the input to restart at,
    unit: int  # the unit index inside it,
    skip: int  # and how many of that unit's tokens are already written
    skipped: int  # bad documents skipped so far
    text_bytes: int  # input bytes consumed so far


@dataclass
class Stream:
    """Pass 1's result: the parts in order and what went into them."""

    directory: Path
    parts: list[Part]
    sources: list[str]
    skips: Skips = field(default_factory=Skips)

    @property
    def total(self) -> int:
        return sum(p.tokens for p in self.parts)


# --- pass 1: tokenize -------------------------------------------------------------------------


def _init_worker(encoding: str) -> None:
    get_encoding(encoding)  # load once per process (cached), before the first task


_Task = tuple[str, list[str], list[bool], str]  # encoding, texts, ends, dtype


def _encode_task(task: _Task) -> tuple[np.ndarray, np.ndarray]:
    """Tokens of a list of units, concatenated, and each unit's token count (EOT included)."""
    encoding, texts, ends, dtype = task
    enc: Any = get_encoding(encoding)
    whole = _encode_whole(enc, texts, ends)
    if whole is not None:
        return whole[0].astype(dtype, copy=False), whole[1]
    counts = np.zeros(len(texts), dtype=np.int64)
    pieces = []
    eot = np.array([enc.eot_token], dtype=dtype)
    for i, (text, end) in enumerate(zip(texts, ends, strict=True)):
        if hasattr(enc, "encode_to_numpy"):  # tiktoken: straight into an array
            ids = enc.encode_to_numpy(text, allowed_special=set(), disallowed_special=())
            ids = ids.astype(dtype, copy=False)
        else:
            ids = np.asarray(enc.encode_ordinary(text), dtype=dtype)
        pieces.append(ids)
        if end:
            pieces.append(eot)
        counts[i] = len(ids) + int(end)
    return (np.concatenate(pieces) if pieces else np.zeros(0, dtype=dtype)), counts


def _encode_whole(
    enc: Any, texts: list[str], ends: list[bool]
) -> tuple[np.ndarray, np.ndarray] | None:
    """A task of whole documents in one tiktoken call: the texts joined by the end-of-text
    marker, which tiktoken splits on before its regex, so the ids are exactly each text's
    ``encode_ordinary`` + EOT. One call instead of one per document: the worker thread
    takes Python's lock once per task, not once per document. None when a text holds the
    marker as plain text, or a unit does not end its document (then: one call each)."""
    if not isinstance(enc, tiktoken.Encoding) or not texts or not all(ends):
        return None
    if enc.eot_token != enc._special_tokens.get(EOT) or any(EOT in t for t in texts):
        return None
    joined = EOT.join(texts) + EOT
    ids = enc.encode_to_numpy(joined, allowed_special={EOT}, disallowed_special=())
    marks = np.flatnonzero(ids == enc.eot_token)
    if len(marks) != len(texts):  # cannot happen (no text holds the marker): be safe
        return None
    return ids, np.diff(marks, prepend=-1).astype(np.int64)


class _Progress:
    """A bar (bytes, tokens, ETA) on a terminal; a plain line per part otherwise."""

    def __init__(self, total_bytes: int, done_bytes: int, opts: PrepareOptions) -> None:
        self.out = opts.log or sys.stderr
        bar = opts.progress if opts.progress is not None else self.out.isatty()
        self.start, self.base, self.total = time.monotonic(), done_bytes, total_bytes
        self.bar: Any = None  # a rich Progress on a terminal
        if bar:  # rich (a dependency already): bytes, rate, ETA and the token count
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
                TransferSpeedColumn,
            )

            self.bar = Progress(
                TextColumn("prepare"),
                BarColumn(),
                DownloadColumn(),
                TransferSpeedColumn(),
                TimeRemainingColumn(),
                TextColumn("{task.fields[tokens]} tokens"),
                console=Console(file=self.out),
            )
            self.task = self.bar.add_task(
                "prepare", total=total_bytes or None, completed=done_bytes, tokens="0"
            )
            self.bar.start()

    def advance(self, nbytes: int, tokens: int) -> None:
        if self.bar is not None:
            self.bar.update(self.task, advance=nbytes, tokens=f"{tokens:,}")

    def part(self, index: int, part: Part) -> None:
        if self.bar is not None:
            return
        wall = max(time.monotonic() - self.start, 1e-9)
        rate = (part.text_bytes - self.base) / wall
        eta = (self.total - part.text_bytes) / rate if rate > 0 and self.total else 0.0
        print(
            f"part {index}: {part.tokens:,} tokens, {part.text_bytes / 1e6:,.1f} MB read, "
            f"{rate / 1e6:.2f} MB/s, ETA {eta:,.0f} s",
            file=self.out,
            flush=True,
        )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None


def _request(inputs: list[Path], text: str | None, opts: PrepareOptions, mode: str) -> dict:
    """What a resumed run must share with the interrupted one."""
    files = [[str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] for p in inputs]
    return {
        "mode": mode,
        "inputs": files,
        "text_sha256": hashlib.sha256(text.encode()).hexdigest() if text is not None else None,
        "tokenizer": encoding_identity(opts.encoding),
        "shard_tokens": opts.shard_tokens,
        "text_field": opts.text_field,
        "skip_bad": opts.skip_bad,
    }


def _units(
    inputs: list[Path], text: str | None, start: Part | None, opts: PrepareOptions, skips: Skips
) -> Iterator[tuple[int, Unit]]:
    """(source index, unit) from the resume position on; bad files skipped or raised."""
    first = start.source if start else 0
    counted = skips if opts.skip_bad else None  # bad documents counted, not raised
    for k, path in enumerate(inputs[first:], first):
        begin = start.unit if start and k == start.source else 0
        try:
            units = read_units(path, text_field=opts.text_field, skips=counted, start=begin)
            yield from ((k, u) for u in units)
        except BadInput as exc:
            if not opts.skip_bad:
                raise
            skips.add(str(exc))
    if text is not None and len(inputs) >= first:
        k = len(inputs)
        if not (start and start.source == k and start.unit > 0):
            yield k, Unit(text, True, 0, len(text.encode()))


def _tasks(
    units: Iterator[tuple[int, Unit]],
) -> Iterator[list[tuple[int, Unit]]]:
    batch: list[tuple[int, Unit]] = []
    size = 0
    for item in units:
        batch.append(item)
        size += item[1].nbytes
        if size >= TASK_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _on_threads(name: str) -> bool:
    """tiktoken encodes with the GIL released, so its workers can be threads of this
    process: no text or tokens pickled between processes. Other tokenizers get processes."""
    return isinstance(get_encoding(name), tiktoken.Encoding)


def _encoded(
    tasks: Iterator[list[tuple[int, Unit]]], opts: PrepareOptions, dtype: str
) -> Iterator[tuple[list[tuple[int, Unit]], np.ndarray, np.ndarray]]:
    """Each task with its tokens, in input order; at most 2 tasks per worker in flight.

    The workers are threads for tiktoken encodings (the bytes encoding included) and
    spawned processes otherwise; either way this thread reads the inputs and writes the
    parts while they encode."""
    name = opts.encoding

    def payload(batch: list[tuple[int, Unit]]) -> _Task:
        return name, [u.text for _, u in batch], [u.end for _, u in batch], dtype

    pool: Any
    submit: Callable[[_Task], Any]
    if _on_threads(name):
        pool = concurrent.futures.ThreadPoolExecutor(opts.workers)
        submit = functools.partial(pool.submit, _encode_task)
    elif opts.workers <= 1:
        _init_worker(name)
        for batch in tasks:
            yield (batch, *_encode_task(payload(batch)))
        return
    else:
        ctx = multiprocessing.get_context("spawn")
        pool = ctx.Pool(opts.workers, initializer=_init_worker, initargs=(name,))

        def submit(task: _Task) -> Any:
            return pool.apply_async(_encode_task, (task,))

    pending: collections.deque = collections.deque()
    try:
        for batch in tasks:
            pending.append((batch, submit(payload(batch))))
            if len(pending) >= 2 * opts.workers:
                done, result = pending.popleft()
                yield (done, *_result(result))
        while pending:
            done, result = pending.popleft()
            yield (done, *_result(result))
    finally:  # tasks not started are dropped: cancelled (threads) or the pool terminated
        if isinstance(pool, concurrent.futures.ThreadPoolExecutor):
            pool.shutdown(wait=True, cancel_futures=True)
        else:
            pool.terminate()
            pool.join()


def _result(result: Any) -> tuple[np.ndarray, np.ndarray]:
    """A finished task's (tokens, counts), from a thread's future or a pool's AsyncResult."""
    return result.result() if isinstance(result, concurrent.futures.Future) else result.get()


def _load_progress(work: Path, request: dict, opts: PrepareOptions) -> tuple[list[Part], bool]:
    """Parts already complete (resume) or none (a fresh start, clearing ``work``)."""
    state = _read_progress(work)
    if opts.resume and state:
        if state.get("request") != request:
            raise DataError(
                f"{work}: cannot resume: the inputs, tokenizer or options differ from the "
                "interrupted run (pass --overwrite to start over)"
            )
        parts = [Part(**p) for p in state["parts"]]
        for p in parts:  # a part listed must be whole
            read_shard(work / p.file)
        listed = {p.file for p in parts}
        for stray in [*work.glob(".*.tmp"), *work.glob("part_*.bin")]:
            if stray.name not in listed:  # half-written, or whole but not yet recorded
                stray.unlink()
        return parts, bool(state.get("complete"))
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    return [], False


def _read_progress(work: Path) -> dict:
    path = work / PROGRESS
    if not path.is_file():
        return {}
    import json

    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise DataError(f"{path}: unreadable progress file: {exc}") from exc
    return state if isinstance(state, dict) else {}


def _save_progress(work: Path, request: dict, parts: list[Part], complete: bool) -> None:
    write_json(
        work / PROGRESS,
        {"request": request, "complete": complete, "parts": [vars(p) for p in parts]},
    )


def tokenize_stream(
    inputs: list[Path], text: str | None, work: Path, opts: PrepareOptions, mode: str
) -> Stream:
    """Pass 1: the inputs' tokens as parts of ``opts.shard_tokens`` in ``work`` (resumable)."""
    files = expand_inputs(inputs)
    sources = [str(p) for p in files] + ([TEXT_SOURCE] if text is not None else [])
    request = _request(files, text, opts, mode)
    parts, complete = _load_progress(work, request, opts)
    skips = Skips(count=parts[-1].skipped if parts else 0)
    stream = Stream(work, parts, sources, skips)
    if complete:
        return stream
    if not parts:
        _save_progress(work, request, parts, complete=False)
    out = _PartWriter.resuming(stream, request, files, text, opts)
    try:
        units = _units(files, text, parts[-1] if parts else None, opts, skips)
        for batch, tokens, counts in _encoded(_tasks(units), opts, out.dtype):
            out.write_task(batch, tokens, counts)
        out.finish(source=len(files) + 1)
    except BaseException:
        out.abort()
        out.progress.close()
        raise
    out.progress.close()
    _save_progress(work, request, parts, complete=True)
    return stream


@dataclass
class _PartWriter:
    """Pass 1's output: encoded tasks into ``part_*.bin`` files of ``shard_tokens`` each,
    each recorded in ``progress.json`` with the input position it ends at."""

    stream: Stream
    request: dict
    progress: _Progress
    dtype: str
    shard_tokens: int
    resume_at: Part | None  # the part the first task may continue
    read_before: int  # input bytes of the tasks written so far
    read_bytes: int  # input bytes up to the end of the part being written
    tokens_done: int
    writer: ShardWriter | None = None

    @classmethod
    def resuming(
        cls,
        stream: Stream,
        request: dict,
        files: list[Path],
        text: str | None,
        opts: PrepareOptions,
    ) -> _PartWriter:
        """A writer that continues after ``stream``'s parts (none: from the start)."""
        parts = stream.parts
        dtype = token_dtype(encoding_vocab(opts.encoding)).str
        total_bytes = sum(p.stat().st_size for p in files) + (len(text.encode()) if text else 0)
        done_bytes = parts[-1].text_bytes if parts else 0
        progress = _Progress(total_bytes, done_bytes, opts)
        resume_at = parts[-1] if parts else None
        return cls(
            stream,
            request,
            progress,
            dtype,
            opts.shard_tokens,
            resume_at,
            read_before=done_bytes,
            read_bytes=done_bytes,
            tokens_done=stream.total,
        )

    def write_task(
        self, batch: list[tuple[int, Unit]], tokens: np.ndarray, counts: np.ndarray
    ) -> None:
        """One task's tokens. Vectorised over the task: the tokens are written in at most one
        piece per part, and a full part is attributed to the unit it ends in (its resume
        point)."""
        ends = np.cumsum(counts)
        nbytes = np.cumsum([u.nbytes for _, u in batch])
        pos = self._resume_pos(batch, counts)
        while pos < len(tokens):
            pos = self._write_piece(batch, tokens, pos, ends, nbytes)
        self.read_before += int(nbytes[-1])
        self.read_bytes = self.read_before
        self.progress.advance(int(nbytes[-1]), self.tokens_done)

    def _resume_pos(self, batch: list[tuple[int, Unit]], counts: np.ndarray) -> int:
        """Tokens of the first unit already in the last part (0 but on a resume)."""
        pos = 0
        if self.resume_at is not None:
            source, unit = batch[0]
            if (source, unit.index) == (self.resume_at.source, self.resume_at.unit):
                pos = min(self.resume_at.skip, int(counts[0]))
            self.resume_at = None
        return pos

    def _write_piece(
        self,
        batch: list[tuple[int, Unit]],
        tokens: np.ndarray,
        pos: int,
        ends: np.ndarray,
        nbytes: np.ndarray,
    ) -> int:
        """Tokens from ``pos`` up to the end of the task or of the part; the new ``pos``."""
        if self.writer is None:
            name = f"part_{len(self.stream.parts):06d}.bin"
            path = self.stream.directory / name
            self.writer = ShardWriter(path, self.dtype, expect=self.shard_tokens)
        take = min(len(tokens) - pos, self.shard_tokens - self.writer.count)
        self.writer.write(tokens[pos : pos + take])
        pos += take
        self.tokens_done += take
        if self.writer.count == self.shard_tokens:
            i = int(np.searchsorted(ends, pos, side="left"))
            source, unit = batch[i]
            self.read_bytes = self.read_before + int(nbytes[i])
            self._close(source, unit.index, pos - (int(ends[i - 1]) if i else 0))
        return pos

    def _close(self, source: int, unit: int, skip: int) -> None:
        """Complete the part being written and record it, with where to resume after it."""
        writer, parts = self.writer, self.stream.parts
        assert writer is not None
        writer.close()
        skipped = self.stream.skips.count
        part = Part(
            writer.path.name,
            writer.count,
            writer.sha256,
            source,
            unit,
            skip,
            skipped,
            self.read_bytes,
        )
        parts.append(part)
        _save_progress(self.stream.directory, self.request, parts, complete=False)
        self.progress.part(len(parts) - 1, part)
        self.writer = None

    def finish(self, source: int) -> None:
        """The last, shorter part (its resume point: past every input)."""
        if self.writer is not None:
            self._close(source, 0, 0)

    def abort(self) -> None:
        """Drop the part being written (a failure or an interruption)."""
        if self.writer is not None:
            self.writer.abort()


# --- pass 2: cut into shards ------------------------------------------------------------------


def _emit(
    stream: Stream,
    start: int,
    stop: int,
    prefix: str,
    site_dir: Path,
    dtype: str,
    shard_tokens: int,
) -> list[dict]:
    """Shards ``prefix_NNNNNN.bin`` holding stream tokens ``[start, stop)``."""
    shards = []
    for k, lo in enumerate(range(start, stop, shard_tokens)):
        hi = min(lo + shard_tokens, stop)
        path = site_dir / f"{prefix}_{k:06d}.bin"
        part_index, rem = divmod(lo, shard_tokens)
        if (
            rem == 0
            and part_index < len(stream.parts)
            and stream.parts[part_index].tokens == hi - lo
        ):
            part = stream.parts[part_index]
            try:
                os.link(stream.directory / part.file, path)
            except OSError:
                shutil.copyfile(stream.directory / part.file, path)
            shards.append({"file": path.name, "tokens": part.tokens, "sha256": part.sha256})
            continue
        with ShardWriter(path, dtype, expect=hi - lo) as writer:
            _copy(stream, lo, hi, writer)
        shards.append({"file": path.name, "tokens": writer.count, "sha256": writer.sha256})
    return shards


def _copy(stream: Stream, lo: int, hi: int, writer: ShardWriter) -> None:
    """Append stream tokens ``[lo, hi)`` to ``writer`` by plain reads of the part files in
    chunks (no memory map, so the pages read do not count as this process's memory)."""
    start = 0
    for part in stream.parts:
        a, b = max(lo, start), min(hi, start + part.tokens)
        if a < b:
            with open(stream.directory / part.file, "rb") as f:
                width = (f.seek(0, os.SEEK_END) - HEADER_BYTES) // max(part.tokens, 1)
                dtype = np.dtype("<u2") if width == 2 else np.dtype("<u4")
                for c in range(a, b, COPY_TOKENS):
                    n = min(COPY_TOKENS, b - c)
                    f.seek(HEADER_BYTES + (c - start) * width)
                    writer.write(np.frombuffer(f.read(n * width), dtype=dtype))
        start += part.tokens


def _split(part: int, val_fraction: float, where: Path, what: str) -> tuple[int, int]:
    n_val = round(part * val_fraction)
    n_train = part - n_val
    if n_train < 2 or n_val < 2:
        raise DataError(
            f"{where}: too little text: {what} gives {n_train} train / {n_val} val tokens "
            "per site (need >= 2 each)"
        )
    return n_train, n_val


def _write_site(
    stream: Stream,
    site_dir: Path,
    lo: int,
    n_train: int,
    n_val: int,
    opts: PrepareOptions,
    meta: dict,
) -> Path:
    if site_dir.exists():
        shutil.rmtree(site_dir)
    site_dir.mkdir(parents=True)
    vocab = encoding_vocab(opts.encoding)
    dtype = token_dtype(vocab).str
    bounds = {"train": (lo, lo + n_train), "val": (lo + n_train, lo + n_train + n_val)}
    shards = {
        split: _emit(stream, a, b, split, site_dir, dtype, opts.shard_tokens)
        for split, (a, b) in bounds.items()
    }
    write_json(
        site_dir / "meta.json",
        {
            **meta,
            "encoding": opts.encoding,
            "tokenizer": encoding_identity(opts.encoding),
            "vocab_size": vocab,
            "dtype": "uint16" if dtype == "<u2" else "uint32",
            "train_tokens": n_train,
            "val_tokens": n_val,
            "sources": stream.sources,
            "skipped": stream.skips.count,
            "skipped_examples": stream.skips.examples,
            "shards": shards,
        },
    )
    return site_dir


def _checked_inputs(
    out: Path, inputs: Sequence[Path] | None, text: str | None, opts: PrepareOptions
) -> list[Path]:
    """The input files as paths, once the options are valid and there is something to read."""
    if not 0.0 < opts.val_fraction < 1.0:
        raise DataError(f"{out}: val_fraction must be in (0, 1) (got {opts.val_fraction})")
    if opts.shard_tokens < 1:
        raise DataError(f"{out}: shard_tokens must be >= 1 (got {opts.shard_tokens})")
    if opts.workers < 1:
        raise DataError(f"{out}: workers must be >= 1 (got {opts.workers})")
    files = [Path(p) for p in inputs or ()]
    if not files and text is None:
        raise DataError(f"{out}: no input files and no text given")
    return files


def _refuse_existing(site_dir: Path, opts: PrepareOptions) -> None:
    if site_dir.is_dir() and any(site_dir.iterdir()) and not (opts.overwrite or opts.resume):
        raise DataError(
            f"{site_dir}: site directory exists and is not empty "
            "(pass overwrite=True / --overwrite, or --resume)"
        )


def prepare_site(
    inputs: Sequence[Path] | None,
    out: Path,
    site: int,
    *,
    text: str | None = None,
    options: PrepareOptions | None = None,
) -> Path:
    """Prepare site ``site`` from its own files: ``out/site-<site>/`` with train shards (the
    first ``1 - val_fraction`` of its tokens) and val shards (the rest), and ``meta.json``
    recording ``site`` (which enters every batch seed), the tokenizer and every shard."""
    opts = options or PrepareOptions()
    out = Path(out)
    if site < 0:
        raise DataError(f"{out}: site must be >= 0 (got {site})")
    inputs = _checked_inputs(out, inputs, text, opts)
    site_dir = out / f"site-{site}"
    _refuse_existing(site_dir, opts)
    work = out / f".prepare-site-{site}"
    stream = tokenize_stream(inputs, text, work, opts, mode=f"site-{site}")
    n_train, n_val = _split(stream.total, opts.val_fraction, out, f"{stream.total} tokens")
    meta = {"site": site, "sites": None, "mode": "site"}
    _write_site(stream, site_dir, 0, n_train, n_val, opts, meta)
    shutil.rmtree(work)
    return site_dir


def prepare_sites(
    inputs: Sequence[Path] | None,
    out: Path,
    sites: int,
    encoding: str = "bytes",
    val_fraction: float = 0.1,
    *,
    text: str | None = None,
    overwrite: bool = False,
    only: int | None = None,
    options: PrepareOptions | None = None,
) -> list[Path]:
    """Tokenize ``inputs`` (and/or ``text``) and split the stream into ``sites`` equal parts.

    Site ``i`` gets tokens ``[i*L, (i+1)*L)`` of the concatenated stream (``L = N // sites``,
    the remainder is dropped); the last ``val_fraction`` of each part is its validation
    split. Writes ``out/site-<i>/{train_*.bin,val_*.bin,meta.json}`` and returns the site
    directories. ``only=i`` writes just site ``i`` (the same split); cutting by tokens
    needs the whole stream's length, so it still tokenizes every input (in bounded memory).
    ``options`` (when given) supplies everything but ``encoding``/``val_fraction``/``overwrite``.
    """
    opts = options or PrepareOptions()
    opts = replace(
        opts, encoding=encoding, val_fraction=val_fraction, overwrite=overwrite or opts.overwrite
    )
    out = Path(out)
    if sites < 1:
        raise DataError(f"{out}: sites must be >= 1 (got {sites})")
    inputs = _checked_inputs(out, inputs, text, opts)
    if only is not None and not 0 <= only < sites:
        raise DataError(f"{out}: site {only} out of range for {sites} sites")
    wanted = range(sites) if only is None else (only,)
    for i in wanted:
        _refuse_existing(out / f"site-{i}", opts)
    work = out / (f".prepare-slices-{sites}" if only is None else f".prepare-slice-{only}-{sites}")
    stream = tokenize_stream(inputs, text, work, opts, mode=f"slices-{sites}")
    part = stream.total // sites
    n_train, n_val = _split(
        part, opts.val_fraction, out, f"{stream.total} tokens over {sites} sites"
    )
    if only is None:  # stale site folders of an earlier, larger split go too
        for stale in out.glob("site-*"):
            if stale.is_dir() and stale.name[5:].isdigit() and int(stale.name[5:]) >= sites:
                shutil.rmtree(stale)
    dirs = []
    for i in wanted:
        meta = {"site": i, "sites": sites, "mode": "slices"}
        dirs.append(_write_site(stream, out / f"site-{i}", i * part, n_train, n_val, opts, meta))
    shutil.rmtree(work)
    return dirs
