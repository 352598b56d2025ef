"""Input readers: documents stream out of text, JSON-lines, Parquet and Arrow files.

Each reader yields :class:`Unit` s: a piece of text, whether its document ends there (an
end-of-text token follows), and its position in the file (the unit index ``--resume``
restarts from). Memory stays bounded: a ``.txt`` file is read in blocks, Parquet by row
groups, Arrow by record batches (data §inputs).
"""

from __future__ import annotations

import codecs
import contextlib
import gzip
import io
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from mobius_fed.data.errors import DataError

TEXT_SUFFIXES = (".txt", ".jsonl", ".parquet", ".arrow")
COMPRESSED = (".gz", ".zst")
BLOCK_BYTES = 1 << 20  # .txt read size
_MAX_BLOCK = 64 << 20  # a .txt block is cut anyway past this (a line this long)
_SAFE_NEXT = frozenset(range(0x21, 0x7F))  # printable ASCII, not whitespace


@dataclass(frozen=True)
class Unit:
    """A piece of one document; ``index`` increases within its file."""

    text: str
    end: bool
    index: int
    nbytes: int


@dataclass
class Skips:
    """Bad documents/files skipped under ``--skip-bad``: a count and the first reasons."""

    count: int = 0
    examples: list[str] = field(default_factory=list)

    def add(self, reason: str) -> None:
        self.count += 1
        if len(self.examples) < 10:
            self.examples.append(reason)


class BadInput(DataError):
    """One document or file that cannot be read; skippable with ``--skip-bad``."""


def kind_of(path: Path) -> tuple[str, str]:
    """(format, compression) from the name: ``a.jsonl.zst`` → ("jsonl", "zst")."""
    suffixes = [s.lower() for s in path.suffixes]
    comp = suffixes[-1][1:] if suffixes and suffixes[-1] in COMPRESSED else ""
    fmt_suffix = suffixes[-2] if comp and len(suffixes) > 1 else (suffixes[-1] if suffixes else "")
    if fmt_suffix not in TEXT_SUFFIXES or (comp and fmt_suffix not in (".txt", ".jsonl")):
        raise DataError(
            f"{path}: unsupported file type {''.join(path.suffixes) or '(none)'!r}; expected "
            f"{', '.join(TEXT_SUFFIXES)} (.txt/.jsonl also as .gz or .zst), a directory of "
            "them, or a Hugging Face datasets directory"
        )
    return fmt_suffix[1:], comp


def _hf_arrow_files(directory: Path) -> list[Path]:
    """The .arrow files of a ``datasets`` save_to_disk directory, in the dataset's order."""
    if (directory / "dataset_dict.json").is_file():
        if (directory / "train").is_dir():
            return _hf_arrow_files(directory / "train")
        raise DataError(f"{directory}: a DatasetDict without a train split; give a split's path")
    state = directory / "state.json"
    if state.is_file():
        try:
            names = [d["filename"] for d in json.loads(state.read_text())["_data_files"]]
            return [directory / n for n in names]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise DataError(f"{state}: unreadable datasets state: {exc}") from exc
    return sorted(directory.glob("*.arrow"))


def expand_inputs(paths: list[Path]) -> list[Path]:
    """Files in reading order: a directory is walked (sorted, hidden entries skipped), a
    ``datasets`` directory gives its arrow files; unsupported files are refused."""
    files: list[Path] = []
    for path in paths:
        if path.is_dir():
            hf_files = ("state.json", "dataset_info.json", "dataset_dict.json")
            if any((path / name).is_file() for name in hf_files):  # a datasets directory
                files += _hf_arrow_files(path)
                continue
            found = []
            for root, dirs, names in os.walk(path):
                dirs[:] = sorted(d for d in dirs if not d.startswith("."))
                for name in sorted(n for n in names if not n.startswith(".")):
                    p = Path(root) / name
                    with contextlib.suppress(DataError):  # an unsupported file is passed over
                        kind_of(p)
                        found.append(p)
            if not found:
                raise DataError(f"{path}: directory holds no {', '.join(TEXT_SUFFIXES)} files")
            files += found
        elif path.is_file():
            kind_of(path)
            files.append(path)
        else:
            raise DataError(f"{path}: input file not found")
    return files


def _open_binary(path: Path, comp: str) -> IO[bytes]:
    if comp == "gz":
        # Ignored: typeshed types gzip.open(…, "rb") as GzipFile, a binary IO all the same.
        return gzip.open(path, "rb")  # type: ignore[return-value]
    if comp == "zst":
        try:
            import zstandard
        except ImportError as exc:
            raise DataError(
                f"{path}: reading .zst needs zstandard (pip install 'mobius-fed[zstd]')"
            ) from exc
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(open(path, "rb")))
    return open(path, "rb")


def _cut(buf: bytes) -> int:
    """Where to end a .txt block: after the last newline that starts a line with a printable
    ASCII character (byte-level regex pre-tokenizers split there anyway); 0 if none."""
    p = len(buf) - 1
    while True:
        p = buf.rfind(b"\n", 0, p)
        if p < 0:
            return 0
        if buf[p + 1] in _SAFE_NEXT:
            return p + 1


def _read_txt(path: Path, comp: str, skips: Skips | None, start: int) -> Iterator[Unit]:
    """A .txt file is one document, read in blocks cut where the tokens cannot change.

    Invalid UTF-8 raises; under ``--skip-bad`` the bad bytes are dropped and counted."""
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    with _open_binary(path, comp) as f:
        carry, offset, lines, index, total, eof = b"", 0, 0, 0, 0, False
        while not eof:
            block = f.read(BLOCK_BYTES)
            eof = not block
            total += len(block)
            buf = carry + block
            cut = len(buf)
            if not eof and len(buf) < _MAX_BLOCK:
                cut = _cut(buf)
                if cut == 0:
                    carry = buf
                    continue
            piece, carry = buf[:cut], buf[cut:]
            if total == 0:
                raise BadInput(f"{path}: empty file")
            try:
                text = decoder.decode(piece, final=eof)
            except UnicodeDecodeError as exc:
                line = lines + piece.count(b"\n", 0, exc.start) + 1
                at = offset + exc.start
                bad = f"{path}: line {line} (byte {at}): invalid UTF-8: {exc.reason}"
                if skips is None:
                    raise BadInput(bad) from None
                skips.add(bad)
                decoder = codecs.getincrementaldecoder("utf-8")("ignore")
                text = decoder.decode(piece, final=eof)
            if index >= start:
                yield Unit(text, eof, index, len(piece))
            offset += len(piece)
            lines += piece.count(b"\n")
            index += 1


def _read_jsonl(
    path: Path, comp: str, text_field: str, skips: Skips | None, start: int
) -> Iterator[Unit]:
    records = 0
    with _open_binary(path, comp) as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            records += 1
            if lineno < start:
                continue
            try:
                record = json.loads(raw.decode("utf-8"))
                if not isinstance(record, dict):
                    raise BadInput(f"{path}:{lineno}: a JSON object per line expected")
                value = record.get(text_field)
                if not isinstance(value, str):
                    raise BadInput(f'{path}:{lineno}: missing string field "{text_field}"')
            except UnicodeDecodeError as exc:
                bad: BadInput = BadInput(f"{path}:{lineno}: invalid UTF-8: {exc.reason}")
            except json.JSONDecodeError as exc:
                bad = BadInput(f"{path}:{lineno}: bad JSON: {exc}")
            except BadInput as exc:
                bad = exc
            else:
                yield Unit(value, True, lineno, len(raw))
                continue
            if skips is None:
                raise bad
            skips.add(str(bad))
    if records == 0:
        raise BadInput(f"{path}: empty file (no JSON records)")


def _rows(
    path: Path, batches: Iterator[object], text_field: str, skips: Skips | None, start: int
) -> Iterator[Unit]:
    row = 0
    for batch in batches:
        # Ignored: a pyarrow RecordBatch (an optional extra without type information here).
        n = batch.num_rows  # type: ignore[attr-defined]
        if row + n <= start:
            row += n
            continue
        # Ignored: as above, a pyarrow RecordBatch.
        for value in batch.column(text_field).to_pylist():  # type: ignore[attr-defined]
            if row >= start:
                if isinstance(value, str):
                    yield Unit(value, True, row, len(value))
                else:
                    what = "null" if value is None else f"a {type(value).__name__}"
                    bad = BadInput(f'{path}: row {row}: field "{text_field}" is {what}')
                    if skips is None:
                        raise bad
                    skips.add(str(bad))
            row += 1
    if row == 0:
        raise BadInput(f"{path}: empty file (no rows)")


def _pyarrow(path: Path, what: str):  # -> module pyarrow
    try:
        import pyarrow
        import pyarrow.ipc
        import pyarrow.parquet
    except ImportError as exc:
        raise DataError(f"{path}: reading {what} needs pyarrow (pip install pyarrow)") from exc
    return pyarrow


def _read_parquet(path: Path, text_field: str, skips: Skips | None, start: int) -> Iterator[Unit]:
    pa = _pyarrow(path, ".parquet")
    try:
        pf = pa.parquet.ParquetFile(path)
    except Exception as exc:
        raise BadInput(f"{path}: unreadable parquet: {exc}") from exc
    names = pf.schema_arrow.names
    if text_field not in names:
        raise BadInput(f'{path}: no column "{text_field}" (columns: {", ".join(names)})')

    def groups() -> Iterator[object]:
        row = 0
        for g in range(pf.num_row_groups):
            n = pf.metadata.row_group(g).num_rows
            skip = row + n <= start  # resume: skip whole row groups unread
            yield _Skipped(n) if skip else pf.read_row_group(g, columns=[text_field])
            row += n

    return _rows(path, groups(), text_field, skips, start)


@dataclass(frozen=True)
class _Skipped:
    num_rows: int


def _read_arrow(path: Path, text_field: str, skips: Skips | None, start: int) -> Iterator[Unit]:
    pa = _pyarrow(path, ".arrow")
    source = pa.memory_map(str(path), "r")
    try:
        reader = pa.ipc.open_stream(source)  # what datasets writes
    except Exception:
        try:
            reader = pa.ipc.open_file(source)
            reader = (reader.get_batch(i) for i in range(reader.num_record_batches))
        except Exception as exc:
            raise BadInput(f"{path}: unreadable arrow file: {exc}") from exc
    else:
        names = reader.schema.names
        if text_field not in names:
            raise BadInput(f'{path}: no column "{text_field}" (columns: {", ".join(names)})')
    return _rows(path, iter(reader), text_field, skips, start)


def read_units(
    path: Path, *, text_field: str = "text", skips: Skips | None = None, start: int = 0
) -> Iterator[Unit]:
    """The units of one file from unit index ``start`` on. A bad document raises
    :class:`BadInput` naming file and line/row, or is counted in ``skips``."""
    fmt, comp = kind_of(path)
    if not path.is_file():
        raise DataError(f"{path}: input file not found")
    if fmt == "txt":
        return _read_txt(path, comp, skips, start)
    if fmt == "jsonl":
        return _read_jsonl(path, comp, text_field, skips, start)
    if fmt == "parquet":
        return _read_parquet(path, text_field, skips, start)
    return _read_arrow(path, text_field, skips, start)


def read_documents(path: str | os.PathLike[str], text_field: str = "text") -> Iterator[str]:
    """Yield whole documents: a .txt file is one; .jsonl/.parquet/.arrow give a field."""
    parts: list[str] = []
    for unit in read_units(Path(path), text_field=text_field):
        parts.append(unit.text)
        if unit.end:
            yield "".join(parts)
            parts = []
