"""Turn text files into per-site train/val shards (one disjoint slice of the stream per site)."""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from mobius_fed.data.errors import DataError
from mobius_fed.data.shards import write_shard
from mobius_fed.data.tokenizers import encode_document, get_encoding

TEXT_SUFFIXES = (".txt", ".jsonl", ".parquet")
_SITE_DIR = re.compile(r"site-\d+")


def read_documents(path: str | os.PathLike[str]) -> Iterator[str]:
    """Yield documents: a .txt file is one; .jsonl/.parquet give their "text" field/column."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: input file not found")
    suffix = path.suffix.lower()
    if suffix == ".txt":
        yield path.read_text(encoding="utf-8")
    elif suffix == ".jsonl":
        yield from _read_jsonl(path)
    elif suffix == ".parquet":
        yield from _read_parquet(path)
    else:
        raise DataError(f"{path}: unsupported file type {suffix!r}; expected {TEXT_SUFFIXES}")


def _read_jsonl(path: Path) -> Iterator[str]:
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}:{lineno}: bad JSON: {exc}") from exc
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise DataError(f'{path}:{lineno}: missing string field "text"')
            yield record["text"]


def _read_parquet(path: Path) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise DataError(f"{path}: reading .parquet needs pyarrow (pip install pyarrow)") from exc
    try:
        table = pq.read_table(path, columns=["text"])
    except Exception as exc:
        raise DataError(f'{path}: cannot read "text" column: {exc}') from exc
    for value in table.column("text").to_pylist():
        if isinstance(value, str):
            yield value


def _write_json(path: Path, obj: object) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def _check_request(inputs, out: Path, sites, val_fraction, text, overwrite, only) -> list[Path]:
    """Refuse a bad request before any work; the site directories it would replace."""
    if sites < 1:
        raise DataError(f"{out}: sites must be >= 1 (got {sites})")
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"{out}: val_fraction must be in (0, 1) (got {val_fraction})")
    if not inputs and text is None:
        raise DataError(f"{out}: no input files and no text given")
    if only is not None and not 0 <= only < sites:
        raise DataError(f"{out}: site {only} out of range for {sites} sites")
    existing = sorted(p for p in out.glob("site-*") if p.is_dir() and _SITE_DIR.fullmatch(p.name))
    if only is not None:
        existing = [p for p in existing if p.name == f"site-{only}"]
    for site_dir in existing:
        if any(site_dir.iterdir()) and not overwrite:
            raise DataError(
                f"{site_dir}: site directory exists and is not empty "
                "(pass overwrite=True / --overwrite)"
            )
    return existing


def _token_stream(inputs: list[Path], text: str | None, enc) -> tuple[np.ndarray, list[str]]:
    """Every document of ``inputs`` (then ``text``) encoded, end to end; and the sources."""
    pieces: list[np.ndarray] = []
    sources: list[str] = []
    for path in inputs:
        sources.append(str(path))
        pieces.extend(
            np.asarray(encode_document(enc, d), dtype=np.int64) for d in read_documents(path)
        )
    if text is not None:
        sources.append("<text>")
        pieces.append(np.asarray(encode_document(enc, text), dtype=np.int64))
    stream = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
    return stream, sources


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
) -> list[Path]:
    """Tokenize ``inputs`` (and/or ``text``) and split the stream into ``sites`` equal parts.

    Site ``i`` gets tokens ``[i*L, (i+1)*L)`` of the concatenated stream (``L = N // sites``,
    the remainder is dropped); the last ``val_fraction`` of each part is its validation
    split. Writes ``out/site-<i>/{train_000000.bin,val_000000.bin,meta.json}`` and returns
    the site directories. ``only=i`` writes just site ``i`` (the same split), for a host
    or container that must hold its own site and nothing else.
    """
    out = Path(out)
    inputs = [Path(p) for p in inputs or ()]
    existing = _check_request(inputs, out, sites, val_fraction, text, overwrite, only)
    stream, sources = _token_stream(inputs, text, get_encoding(encoding))
    part = len(stream) // sites
    n_val = round(part * val_fraction)
    n_train = part - n_val
    if n_train < 2 or n_val < 2:
        raise DataError(
            f"{out}: too little text: {len(stream)} tokens over {sites} sites gives "
            f"{n_train} train / {n_val} val tokens per site (need >= 2 each)"
        )

    for site_dir in existing:
        shutil.rmtree(site_dir)
    site_dirs = []
    for i in range(sites) if only is None else (only,):
        site_dir = out / f"site-{i}"
        site_dir.mkdir(parents=True, exist_ok=True)
        chunk = stream[i * part : (i + 1) * part]
        write_shard(site_dir / "train_000000.bin", chunk[:n_train])
        write_shard(site_dir / "val_000000.bin", chunk[n_train:])
        meta = {
            "site": i,
            "sites": sites,
            "encoding": encoding,
            "train_tokens": n_train,
            "val_tokens": n_val,
            "sources": sources,
        }
        _write_json(site_dir / "meta.json", meta)
        site_dirs.append(site_dir)
    return site_dirs
