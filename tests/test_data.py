"""Tests for mobius_fed.data: shards, tokenizers, site preparation and the batch loader."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from mobius_fed.data import (
    MAGIC,
    DataError,
    SiteData,
    embedded_corpus,
    encode_document,
    get_encoding,
    prepare_sites,
    read_documents,
    read_shard,
    write_shard,
)
from mobius_fed.data.shards import HEADER_BYTES

SHAKESPEARE = Path(__file__).resolve().parents[2] / "shared/data/tinyshakespeare.txt"


def _header(magic: int = MAGIC, version: int = 1, count: int = 0) -> bytes:
    header = np.zeros(256, dtype="<i4")
    header[:3] = magic, version, count
    return header.tobytes()


# --- shards ---------------------------------------------------------------------------------


def test_shard_round_trip(tmp_path: Path) -> None:
    tokens = [0, 1, 255, 256, 50256, 65535]
    path = write_shard(tmp_path / "s.bin", tokens)
    got = read_shard(path)
    assert got.dtype == np.uint16 and got.tolist() == tokens
    assert not got.flags.writeable
    assert path.stat().st_size == HEADER_BYTES + 2 * len(tokens)
    assert read_shard(write_shard(tmp_path / "e.bin", [])).tolist() == []


@pytest.mark.parametrize("bad", [-1, 65536])
def test_write_shard_refuses_out_of_range(tmp_path: Path, bad: int) -> None:
    with pytest.raises(DataError, match=r"\[0, 65535\]"):
        write_shard(tmp_path / "s.bin", [1, bad])
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (_header(magic=123, count=2) + b"\0" * 4, "bad magic 123 \\(expected 20240520\\)"),
        (_header(version=7, count=2) + b"\0" * 4, "unsupported version 7"),
        (_header(count=3) + b"\0" * 4, "truncated"),
        (_header(count=1) + b"\0" * 4, "oversized"),
        (b"\0" * 100, "too short for header"),
    ],
)
def test_read_shard_refusals(tmp_path: Path, content: bytes, match: str) -> None:
    path = tmp_path / "bad.bin"
    path.write_bytes(content)
    with pytest.raises(DataError, match=match) as info:
        read_shard(path)
    assert str(path) in str(info.value)


def test_read_shard_missing(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="not found") as info:
        read_shard(tmp_path / "nope.bin")
    assert "nope.bin" in str(info.value)


# --- tokenizers -----------------------------------------------------------------------------


def test_bytes_encoding_round_trip() -> None:
    enc = get_encoding("bytes")
    assert enc.n_vocab == 257 and enc.eot_token == 256
    assert get_encoding("bytes") is enc
    text = "Möbius — naïve café 日本語 🙂 <|endoftext|>"
    ids = encode_document(enc, text)
    assert ids[-1] == 256 and max(ids[:-1]) < 256
    assert ids[:-1] == list(text.encode("utf-8"))
    assert enc.decode(ids[:-1]) == text


def test_unknown_encoding_lists_names() -> None:
    with pytest.raises(DataError, match="bytes, gpt2"):
        get_encoding("cl100k_nope")


def test_gpt2_uncached_fails_fast(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    start = time.monotonic()
    try:
        enc = get_encoding("gpt2")
    except DataError as exc:
        assert "TIKTOKEN_CACHE_DIR" in str(exc) and "--encoding bytes" in str(exc)
        assert "gpt2" in str(exc)
    else:  # online machine: the download worked
        assert enc.n_vocab == 50257
    assert time.monotonic() - start < 65


# --- preparation ----------------------------------------------------------------------------


def _site_tokens(site_dir: Path) -> tuple[np.ndarray, np.ndarray]:
    return read_shard(site_dir / "train_000000.bin"), read_shard(site_dir / "val_000000.bin")


def _check_sites(dirs: list[Path], stream: list[int], sites: int, val_fraction: float) -> None:
    assert [d.name for d in dirs] == [f"site-{i}" for i in range(sites)]
    part = len(stream) // sites
    pieces = []
    for i, d in enumerate(dirs):
        train, val = _site_tokens(d)
        assert len(train) + len(val) == part
        assert len(val) == round(part * val_fraction)
        meta = json.loads((d / "meta.json").read_text())
        assert meta["site"] == i and meta["sites"] == sites and meta["encoding"] == "bytes"
        assert (meta["train_tokens"], meta["val_tokens"]) == (len(train), len(val))
        pieces += [train, val]
    # Site parts concatenated in order are exactly the stream prefix: disjoint, no gaps.
    assert np.concatenate(pieces).tolist() == stream[: part * sites]


def test_prepare_embedded_corpus(tmp_path: Path) -> None:
    text = embedded_corpus()
    assert len(text) > 100_000 and "for" in text
    dirs = prepare_sites(None, tmp_path, 3, val_fraction=0.1, text=text)
    _check_sites(dirs, encode_document(get_encoding("bytes"), text), 3, 0.1)
    assert json.loads((dirs[0] / "meta.json").read_text())["sources"] == ["<text>"]


@pytest.mark.skipif(not SHAKESPEARE.is_file(), reason="tinyshakespeare.txt not present")
def test_prepare_tinyshakespeare(tmp_path: Path) -> None:
    dirs = prepare_sites([SHAKESPEARE], tmp_path, 4, val_fraction=0.2)
    stream = encode_document(get_encoding("bytes"), SHAKESPEARE.read_text(encoding="utf-8"))
    _check_sites(dirs, stream, 4, 0.2)


def test_prepare_refusals(tmp_path: Path) -> None:
    text = "hello world " * 100
    prepare_sites(None, tmp_path, 2, text=text)
    with pytest.raises(DataError, match=r"site-0.*not empty"):
        prepare_sites(None, tmp_path, 2, text=text)
    (tmp_path / "site-5").mkdir()
    (tmp_path / "site-5" / "stale").write_text("x")
    dirs = prepare_sites(None, tmp_path, 3, text=text, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == [d.name for d in dirs]
    with pytest.raises(DataError, match="sites must be"):
        prepare_sites(None, tmp_path / "a", 0, text=text)
    with pytest.raises(DataError, match="val_fraction"):
        prepare_sites(None, tmp_path / "a", 1, text=text, val_fraction=1.0)
    with pytest.raises(DataError, match="too little text"):
        prepare_sites(None, tmp_path / "a", 4, text="tiny")
    with pytest.raises(DataError, match=r"x\.csv: input file not found"):
        prepare_sites([tmp_path / "x.csv"], tmp_path / "a", 1)
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(DataError, match=r"x\.csv.*unsupported file type"):
        prepare_sites([tmp_path / "x.csv"], tmp_path / "a", 1)


def test_jsonl_documents(tmp_path: Path) -> None:
    good = tmp_path / "good.jsonl"
    good.write_text('{"text": "alpha"}\n\n{"text": "béta", "id": 2}\n')
    assert list(read_documents(good)) == ["alpha", "béta"]
    dirs = prepare_sites([good], tmp_path / "out", 1, val_fraction=0.25)
    train, val = _site_tokens(dirs[0])
    stream = [*b"alpha", 256, *"béta".encode(), 256]
    assert np.concatenate([train, val]).tolist() == stream
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{not json\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:2: bad JSON"):
        list(read_documents(bad))
    bad.write_text('{"text": "ok"}\n{"body": "x"}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:2: missing string field"):
        list(read_documents(bad))
    with pytest.raises(DataError, match="not found"):
        list(read_documents(tmp_path / "gone.jsonl"))


# --- loader ---------------------------------------------------------------------------------


@pytest.fixture
def site(tmp_path: Path) -> Path:
    return prepare_sites(None, tmp_path, 2, text=embedded_corpus()[:20_000])[0]


def test_loader_determinism(site: Path) -> None:
    data = SiteData(site, seq_len=16, encoding="bytes")
    x1, y1 = data.batch("train", seed=1, step=5, batch_size=8)
    x2, y2 = SiteData(site, seq_len=16).batch("train", seed=1, step=5, batch_size=8)
    assert x1.shape == y1.shape == (8, 16) and x1.dtype == y1.dtype == torch.int64
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert not torch.equal(x1, data.batch("train", seed=1, step=6, batch_size=8)[0])
    assert not torch.equal(x1, data.batch("train", seed=2, step=5, batch_size=8)[0])
    assert not torch.equal(x1, data.batch("val", seed=1, step=5, batch_size=8)[0])
    assert torch.equal(x1[:, 1:], y1[:, :-1])
    # Every row is a real window of the split: y continues x by one token.
    train = torch.from_numpy(read_shard(site / "train_000000.bin").astype(np.int64))
    for row_x, row_y in zip(x1, y1, strict=True):
        hits = [o for o in range(len(train) - 16) if torch.equal(train[o : o + 16], row_x)]
        assert any(torch.equal(train[o + 1 : o + 17], row_y) for o in hits)
    assert data.max_token() <= 256
    assert data.num_tokens("train") == len(train)


def test_loader_refusals(site: Path, tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"missing-dir.*not found"):
        SiteData(tmp_path / "missing-dir", seq_len=8)
    with pytest.raises(DataError, match="encoding mismatch"):
        SiteData(site, seq_len=8, encoding="gpt2")
    with pytest.raises(DataError, match=r"val split has .* tokens"):
        SiteData(site, seq_len=5000)
    (site / "val_000000.bin").unlink()
    with pytest.raises(DataError, match="no val_"):
        SiteData(site, seq_len=8)


def test_loader_concatenates_shards(tmp_path: Path) -> None:
    write_shard(tmp_path / "train_000001.bin", [3, 4, 5])
    write_shard(tmp_path / "train_000000.bin", [0, 1, 2])
    write_shard(tmp_path / "val_000000.bin", [7, 8, 9])
    data = SiteData(tmp_path, seq_len=2)
    assert data.num_tokens("train") == 6 and data.max_token() == 9
    x, y = data.batch("train", seed=0, step=0, batch_size=64)
    assert torch.equal(y, x + 1)


def test_sites_draw_independent_offsets(tmp_path: Path) -> None:
    """Batches are a pure function of (seed, site, split, step): sites no longer share offsets."""
    dirs = prepare_sites(None, tmp_path / "p", 2, text="ab" * 2000)  # both sites hold "abab…"
    a, b = (SiteData(d, seq_len=8) for d in dirs)
    assert (a.site, b.site) == (0, 1)
    xa, xb = (d.batch("train", seed=3, step=4, batch_size=16)[0] for d in (a, b))
    assert not torch.equal(xa[:, 0], xb[:, 0])  # identical text, so only offsets can differ
    assert torch.equal(
        xa, SiteData(dirs[0], seq_len=8).batch("train", seed=3, step=4, batch_size=16)[0]
    )
    # The site index travels with the data: the same directory copied elsewhere agrees.
    assert SiteData(dirs[1], seq_len=8, site=1).site == 1
    a.site = b.site = None  # the old coupled sampling, kept for comparisons
    xa, xb = (d.batch("train", seed=3, step=4, batch_size=16)[0] for d in (a, b))
    assert torch.equal(xa, xb)
    (dirs[0] / "meta.json").write_text('{"site": "zero"}')
    with pytest.raises(DataError, match="'site' must be a non-negative integer"):
        SiteData(dirs[0], seq_len=8)
