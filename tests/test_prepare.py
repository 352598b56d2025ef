"""Streaming prepare at a site's scale: resume after a kill, per-site files, any tokenizer,
every input format and each bad input, and the loader over many shards (docs/data.md)."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from mobius_fed.data import (
    DataError,
    SiteData,
    embedded_corpus,
    encode_document,
    get_encoding,
    prepare_sites,
    read_shard,
    site_identity,
    write_shard,
)
from mobius_fed.data.prepare import PrepareOptions, prepare_site
from mobius_fed.data.shards import TokenStream
from mobius_fed.data.vocab import encoding_vocab

CORPUS = embedded_corpus()
BYTES = get_encoding("bytes")


def _cli(*args: str, cwd: Path, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mobius_fed.cli.main", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "OMP_NUM_THREADS": "1", "MOBIUS_THREADS": "1"},
    )


def _split_tokens(site: Path, split: str) -> list[int]:
    files = sorted(site.glob(f"{split}_*.bin"))
    return np.concatenate([read_shard(f) for f in files]).astype(np.int64).tolist()


def _opts(**kw) -> PrepareOptions:
    return PrepareOptions(progress=False, log=open(os.devnull, "w"), **kw)


def _docs(path: Path, texts: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: t}) + "\n" for t in texts), encoding="utf-8")
    return path


def _stream_of(texts: list[str], enc=BYTES) -> list[int]:
    return [t for text in texts for t in encode_document(enc, text)]


# --- shards and the loader --------------------------------------------------------------------


def test_uint32_shards_and_header(tmp_path: Path) -> None:
    big = [0, 65535, 65536, 2**32 - 1]
    path = write_shard(tmp_path / "w.bin", big, dtype="<u4")
    got = read_shard(path)
    assert got.dtype == np.uint32 and got.tolist() == big
    header = np.fromfile(path, dtype="<i4", count=4)
    assert header.tolist() == [20240520, 2, 4, 4]  # version 2, width 4 bytes
    with pytest.raises(DataError, match=r"\[0, 65535\] for uint16"):
        write_shard(tmp_path / "n.bin", [65536])
    old = write_shard(tmp_path / "o.bin", [1, 2, 3])  # uint16 stays modded-nanogpt version 1
    assert np.fromfile(old, dtype="<i4", count=2).tolist() == [20240520, 1]
    assert not list(tmp_path.glob(".*.tmp"))


@pytest.mark.parametrize("expect", [None, 5, 6, 7])
def test_shard_hash_is_the_files(tmp_path: Path, expect: int | None) -> None:
    """The hash built while writing (count announced up front) or by re-reading (count
    unknown or different) is always the sha256 of the file as written."""
    from mobius_fed.data.shards import ShardWriter

    with ShardWriter(tmp_path / "s.bin", "<u4", expect=expect) as writer:
        writer.write(np.arange(4, dtype=np.uint32))
        writer.write(np.array([70_000, 3], dtype=np.int64)[::-1])  # converted, non-contiguous
    data = (tmp_path / "s.bin").read_bytes()
    assert writer.sha256 == hashlib.sha256(data).hexdigest()
    assert read_shard(tmp_path / "s.bin").tolist() == [0, 1, 2, 3, 3, 70_000]


def test_token_stream_windows_cross_shards() -> None:
    rng = np.random.default_rng(0)
    whole = rng.integers(0, 60000, 1000).astype(np.uint16)
    pieces = np.split(whole, [7, 8, 300, 301, 650])
    stream = TokenStream(pieces)
    offsets = np.array([0, 5, 6, 7, 290, 299, 640, 980, 1000 - 20])
    expect = whole[offsets[:, None] + np.arange(20)].astype(np.int64)
    assert np.array_equal(stream.windows(offsets, 20), expect)
    assert len(stream) == 1000 and stream.max() == int(whole.max())


def test_batches_do_not_depend_on_shard_count(tmp_path: Path) -> None:
    """One shard or twenty: the same (seed, site, split, step) gives the same batch."""
    tokens = np.random.default_rng(1).integers(0, 257, 20_000).astype(np.uint16)
    for n, name in ((1, "one"), (20, "many")):
        d = tmp_path / name
        for k, part in enumerate(np.array_split(tokens, n)):
            write_shard(d / f"train_{k:06d}.bin", part)
        write_shard(d / "val_000000.bin", tokens[:500])
    one, many = SiteData(tmp_path / "one", 64, site=3), SiteData(tmp_path / "many", 64, site=3)
    for step in range(5):
        a = one.batch("train", seed=7, step=step, batch_size=16)
        b = many.batch("train", seed=7, step=step, batch_size=16)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_small_shards_equal_one_shard(tmp_path: Path) -> None:
    text = CORPUS[:30_000]
    one = prepare_site(None, tmp_path / "a", 0, text=text, options=_opts())
    many = prepare_site(None, tmp_path / "b", 0, text=text, options=_opts(shard_tokens=1000))
    meta = json.loads((many / "meta.json").read_text())
    n = len(encode_document(BYTES, text))
    n_val = round(n * 0.1)
    assert len(meta["shards"]["train"]) == -(-(n - n_val) // 1000)
    assert len(meta["shards"]["val"]) == -(-n_val // 1000)
    for split in ("train", "val"):
        assert _split_tokens(one, split) == _split_tokens(many, split)
    stream = encode_document(BYTES, text)
    assert _split_tokens(one, "train") + _split_tokens(one, "val") == stream
    for shard in meta["shards"]["train"]:  # the manifest's hashes are the files'
        assert hashlib.sha256((many / shard["file"]).read_bytes()).hexdigest() == shard["sha256"]


# --- resume after a kill ----------------------------------------------------------------------


def test_resume_after_kill_mid_shard(tmp_path: Path) -> None:
    """A real `prepare` process killed (SIGKILL) after some parts; --resume continues after
    the last complete part and gives exactly the tokens of an uninterrupted run."""
    texts = [CORPUS[i : i + 3000] for i in range(0, len(CORPUS), 3000)] * 4  # ~1.9 MB
    src = _docs(tmp_path / "docs.jsonl", texts)
    args = ["prepare", "--site", "0", str(src), "--out", "out", "--shard-tokens", "50000"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "mobius_fed.cli.main", *args],
        cwd=tmp_path,
        stderr=subprocess.PIPE,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    progress = tmp_path / "out/.prepare-site-0/progress.json"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if len(json.loads(progress.read_text())["parts"]) >= 3:
                break
        except (OSError, ValueError):
            pass
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    state = json.loads(progress.read_text())
    done = len(state["parts"])
    assert 3 <= done < 38 and not state["complete"], "killed too late to test resuming"
    assert not (tmp_path / "out/site-0/meta.json").exists()
    # Only whole parts carry a part name (a half-written one is a hidden .tmp file); the
    # kill may land between a part's rename and its record, so one more may be there.
    work = progress.parent
    names = sorted(p.name for p in work.glob("part_*.bin"))
    listed = [p["file"] for p in state["parts"]]
    assert names[: len(listed)] == listed and len(names) <= len(listed) + 1
    for p in state["parts"]:
        assert len(read_shard(work / p["file"])) == 50_000

    resumed = _cli(*args, "--resume", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    first = re.search(r"part (\d+):", resumed.stderr)
    assert first and int(first.group(1)) >= done, resumed.stderr[:500]  # no part redone
    assert not work.exists() and not list((tmp_path / "out/site-0").glob(".*"))
    stream = _stream_of(texts)
    site = tmp_path / "out/site-0"
    assert _split_tokens(site, "train") + _split_tokens(site, "val") == stream
    meta = json.loads((site / "meta.json").read_text())
    assert meta["train_tokens"] + meta["val_tokens"] == len(stream)


def test_resume_refuses_a_changed_request(tmp_path: Path) -> None:
    src = _docs(tmp_path / "a.jsonl", [CORPUS[:5000]])
    work = tmp_path / "out/.prepare-site-0"
    work.mkdir(parents=True)
    (work / "progress.json").write_text(json.dumps({"request": {"mode": "x"}, "parts": []}))
    with pytest.raises(DataError, match=r"cannot resume.*--overwrite"):
        prepare_site([src], tmp_path / "out", 0, options=_opts(resume=True))


# --- each site its own files ------------------------------------------------------------------


def test_per_site_prepare_distinct_batch_seeds(tmp_path: Path) -> None:
    """Two hosts prepare their own (here identical) files with --site i: each meta.json
    carries its index, so the two sites draw different offsets."""
    text = tmp_path / "mine.txt"
    text.write_text("ab" * 3000)
    for i in (0, 1):
        proc = _cli("prepare", "--site", str(i), str(text), "--out", f"host{i}", cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
    a, b = (SiteData(tmp_path / f"host{i}/site-{i}", seq_len=8) for i in (0, 1))
    assert (a.site, b.site) == (0, 1)
    assert json.loads((tmp_path / "host1/site-1/meta.json").read_text())["mode"] == "site"
    xa, xb = (d.batch("train", seed=3, step=4, batch_size=16)[0] for d in (a, b))
    assert not torch.equal(xa[:, 0], xb[:, 0])  # same text: only the offsets differ
    proc = _cli("prepare", "--site", "0", "--out", "x", cwd=tmp_path)
    assert proc.returncode != 0 and "give the files" in proc.stderr


def test_only_slice_says_it_reads_everything(tmp_path: Path) -> None:
    proc = _cli("prepare", "--sites", "3", "--only", "2", "--out", "s", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "every input is read and tokenized" in proc.stderr
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == ["site-2"]
    full = prepare_sites(None, tmp_path / "all", 3, text=CORPUS)
    assert _split_tokens(full[2], "train") == _split_tokens(tmp_path / "s/site-2", "train")


@pytest.mark.slow
def test_vocab_mismatch_refused_at_registration(tmp_path: Path) -> None:
    """A real coordinator; worker-0 registers with byte-level data over mTLS, then a real
    worker-1 process whose site was prepared with another tokenizer is refused, and the
    message names both sites."""
    from mobius_fed.cli.up import LocalFederation
    from mobius_fed.config import TrainConfig
    from mobius_fed.proto import control_pb2, control_pb2_grpc
    from mobius_fed.transport.tls import NodeTLS, open_channel

    train = TrainConfig(workers=2, preset="cpu-tiny", batch_size=2, steps=2)
    fed = LocalFederation(tmp_path, train).prepare()
    tok = _word_tokenizer(tmp_path / "tok.json", filler=10)
    prepare_site(
        None, fed.sites, 1, text=CORPUS[:20_000],
        options=_opts(encoding=f"hf:{tok}", overwrite=True),
    )  # fmt: skip
    assert site_identity(fed.sites / "site-0") == ("bytes", 257)
    fed.start(workers=False)
    try:
        deadline = time.monotonic() + 60
        while fed.status() is None:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        w0 = NodeTLS(fed.certs / "ca.crt", fed.certs / "worker-0.crt", fed.certs / "worker-0.key")
        target = f"127.0.0.1:{fed.coord_port}"
        ch = open_channel(target, w0, target_name="coordinator")
        try:
            spec = control_pb2_grpc.ControlStub(ch).Register(
                control_pb2.RegisterRequest(
                    listen_address="127.0.0.1:1", data_tokenizer="bytes", data_vocab=257
                ),
                timeout=20,
            )
            assert spec.rank == 0
        finally:
            ch.close()
        proc = subprocess.run(fed.worker_cmd(1), capture_output=True, text=True, timeout=120)
        assert proc.returncode != 0
        assert "data mismatch" in proc.stderr and "worker-1" in proc.stderr, proc.stderr[-2000:]
        assert "worker-0's uses bytes (vocab 257)" in proc.stderr
    finally:
        fed.stop()


# --- any tokenizer ----------------------------------------------------------------------------


def _word_tokenizer(path: Path, filler: int) -> Path:
    """A WordLevel tokenizer.json: ``filler`` unused ids first, then every word and
    punctuation mark of the embedded corpus, [UNK] and <|endoftext|> last."""
    tokenizers = pytest.importorskip("tokenizers")
    words = sorted(set(re.findall(r"\w+|[^\w\s]+", CORPUS)))
    vocab = {f"<unused{i}>": i for i in range(filler)}
    for w in [*words, "[UNK]", "<|endoftext|>"]:
        vocab.setdefault(w, len(vocab))
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(str(path))
    return path


@pytest.mark.slow
def test_large_vocab_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A tokenizer with > 65,536 ids: prepare (uint32 shards) → train (`local`) → export →
    generate, the model's vocabulary following the tokenizer."""
    from mobius_fed.cli.main import main

    tok = _word_tokenizer(tmp_path / "tokenizer.json", filler=66_000)
    name = f"hf:{tok}"
    vocab = encoding_vocab(name)
    assert vocab > 66_000
    half = len(CORPUS) // 2
    for i, text in enumerate((CORPUS[:half], CORPUS[half:])):
        f = tmp_path / f"own-{i}.txt"
        f.write_text(text)
        assert main(["prepare", "--site", str(i), str(f), "--out", str(tmp_path / "sites"),
                     "--encoding", name]) == 0  # fmt: skip
    site = tmp_path / "sites/site-1"
    meta = json.loads((site / "meta.json").read_text())
    assert meta["dtype"] == "uint32" and meta["vocab_size"] == vocab
    train = read_shard(site / "train_000000.bin")
    assert train.dtype == np.uint32 and int(train.max()) >= 66_000
    assert site_identity(site) == (meta["tokenizer"], vocab) and meta["tokenizer"].startswith("hf:")
    run = tmp_path / "run"
    flags = ["--preset", "cpu-tiny", "--workers", "2", "--steps", "2", "--batch-size", "2",
             "--eval-every", "0", "--threads", "1", "--encoding", name]  # fmt: skip
    assert main(["local", *flags, "--data", str(tmp_path / "sites"), "--out", str(run)]) == 0
    assert main(["export", str(run), "--out", str(tmp_path / "exp"), "--origin", "0"]) == 0
    conf = json.loads((tmp_path / "exp/config.json").read_text())
    assert conf["vocab_size"] >= vocab and conf["encoding"] == name
    capsys.readouterr()
    args = ["--prompt", "the", "--max-new-tokens", "4", "--threads", "1"]
    assert main(["generate", str(tmp_path / "exp"), *args]) == 0
    out = capsys.readouterr().out
    assert out.startswith("the")  # the prompt, then the new text
    known = set(json.loads(tok.read_text())["model"]["vocab"])  # decoded ids are its words
    assert out[3:].split() and set(out[3:].split()) <= known


def test_tiktoken_names_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert encoding_vocab("cl100k_base") == 100277 and encoding_vocab("o200k_base") == 200019
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    try:
        enc = get_encoding("cl100k_base")
    except DataError as exc:
        assert "cl100k_base" in str(exc) and "TIKTOKEN_CACHE_DIR" in str(exc)
    else:  # an online machine: the download worked
        assert enc.n_vocab == 100277
    with pytest.raises(DataError, match=r"tokenizer\.json not found"):
        get_encoding(f"hf:{tmp_path / 'missing.json'}")
    with pytest.raises(DataError, match=r"hf:<path"):
        get_encoding("llama9")


# --- inputs -----------------------------------------------------------------------------------


def _prepared(tmp_path: Path, inputs: list[Path], **kw) -> list[int]:
    site = prepare_site(inputs, tmp_path / "out", 0, options=_opts(overwrite=True, **kw))
    return _split_tokens(site, "train") + _split_tokens(site, "val")


def test_inputs_txt_jsonl_gz_tree(tmp_path: Path) -> None:
    texts = [CORPUS[:4000], CORPUS[4000:9000], "naïve café 🙂"]
    tree = tmp_path / "tree"
    (tree / "b").mkdir(parents=True)
    _docs(tree / "a.jsonl", texts[:1])
    with gzip.open(tree / "b" / "c.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write(json.dumps({"body": texts[1]}) + "\n")
    (tree / "b" / "d.txt").write_text(texts[2])
    (tree / "b" / "notes.md").write_text("ignored")
    (tree / "a.jsonl").write_text(json.dumps({"body": texts[0]}) + "\n")
    assert _prepared(tmp_path, [tree], text_field="body") == _stream_of(texts)


def test_large_txt_read_in_blocks_is_exact(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import mobius_fed.data.sources as sources

    monkeypatch.setattr(sources, "BLOCK_BYTES", 4096)  # many blocks
    f = tmp_path / "big.txt"
    f.write_text(CORPUS[:100_000])
    assert _prepared(tmp_path, [f]) == encode_document(BYTES, CORPUS[:100_000])


def test_inputs_zst(tmp_path: Path) -> None:
    zstandard = pytest.importorskip("zstandard", reason="zstandard (the zstd extra) not installed")
    texts = ["one document", "another"]
    raw = "".join(json.dumps({"text": t}) + "\n" for t in texts).encode()
    (tmp_path / "d.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(raw))
    assert _prepared(tmp_path, [tmp_path / "d.jsonl.zst"]) == _stream_of(texts)


def test_inputs_parquet_row_groups_and_hf_dataset_dir(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow", reason="pyarrow (the parquet extra) not installed")
    import pyarrow.parquet as pq

    texts = [CORPUS[i : i + 700] for i in range(0, 7000, 700)]
    table = pa.table({"id": list(range(len(texts))), "content": texts})
    pq.write_table(table, tmp_path / "t.parquet", row_group_size=3)
    assert pq.ParquetFile(tmp_path / "t.parquet").num_row_groups == 4
    assert _prepared(tmp_path, [tmp_path / "t.parquet"], text_field="content") == _stream_of(texts)
    # A `datasets` save_to_disk directory: arrow IPC streams listed in state.json.
    ds = tmp_path / "ds"
    ds.mkdir()
    for k, rows in enumerate((texts[:4], texts[4:])):
        with pa.ipc.new_stream(ds / f"data-{k:05d}-of-00002.arrow", table.schema) as w:
            w.write_table(pa.table({"id": [0] * len(rows), "content": rows}))
    (ds / "state.json").write_text(json.dumps({"_data_files": [
        {"filename": "data-00000-of-00002.arrow"}, {"filename": "data-00001-of-00002.arrow"}
    ]}))  # fmt: skip
    (ds / "dataset_info.json").write_text("{}")
    assert _prepared(tmp_path, [ds], text_field="content") == _stream_of(texts)
    with pytest.raises(DataError, match=r't\.parquet: no column "text" \(columns: id, content\)'):
        _prepared(tmp_path, [tmp_path / "t.parquet"])


# --- bad input --------------------------------------------------------------------------------

GOOD = {"text": CORPUS[:3000]}


def _bad_cases(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """name → (file, the error it must give)."""
    cases: dict[str, tuple[Path, str]] = {}
    f = tmp_path / "utf8.txt"
    f.write_bytes(b"fine line\nsecond \xff\xfe line\n")
    cases["txt invalid utf-8"] = (f, r"utf8\.txt: line 2 \(byte 17\): invalid UTF-8")
    f = tmp_path / "utf8.jsonl"
    f.write_bytes(json.dumps(GOOD).encode() + b'\n{"text": "bad \xff"}\n')
    cases["jsonl invalid utf-8"] = (f, r"utf8\.jsonl:2: invalid UTF-8")
    f = tmp_path / "field.jsonl"
    f.write_text(json.dumps(GOOD) + '\n{"body": "x"}\n')
    cases["jsonl missing field"] = (f, r'field\.jsonl:2: missing string field "text"')
    f = tmp_path / "json.jsonl"
    f.write_text(json.dumps(GOOD) + "\n{not json\n")
    cases["jsonl bad json"] = (f, r"json\.jsonl:2: bad JSON")
    f = tmp_path / "empty.txt"
    f.write_bytes(b"")
    cases["empty txt"] = (f, r"empty\.txt: empty file")
    f = tmp_path / "empty.jsonl"
    f.write_text("\n\n")
    cases["empty jsonl"] = (f, r"empty\.jsonl: empty file")
    return cases


def test_each_bad_input_names_file_and_line(tmp_path: Path) -> None:
    for name, (bad, match) in _bad_cases(tmp_path).items():
        good = _docs(tmp_path / "good.jsonl", [GOOD["text"]])
        out = tmp_path / f"out-{name.replace(' ', '-')}"
        with pytest.raises(DataError, match=match):
            prepare_site([good, bad], out, 0, options=_opts(shard_tokens=1000))
        site = out / "site-0"
        assert not site.exists(), f"{name}: a site was written"
        work = out / ".prepare-site-0"  # whole parts of the good file only; none half-written
        state = json.loads((work / "progress.json").read_text())
        assert not state["complete"] and not list(work.glob(".*.tmp")), name


def test_skip_bad_counts_and_continues(tmp_path: Path) -> None:
    cases = _bad_cases(tmp_path)
    good = _docs(tmp_path / "good.jsonl", [GOOD["text"]])
    site = prepare_site([good, *(f for f, _ in cases.values())], tmp_path / "out", 0,
                        options=_opts(skip_bad=True))  # fmt: skip
    meta = json.loads((site / "meta.json").read_text())
    assert meta["skipped"] == 6
    assert any("utf8.jsonl:2" in e for e in meta["skipped_examples"])
    got = _split_tokens(site, "train") + _split_tokens(site, "val")
    kept = [GOOD["text"], "fine line\nsecond  line\n", GOOD["text"], GOOD["text"], GOOD["text"]]
    assert got == _stream_of(kept)


def test_parquet_null_row_is_bad(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow", reason="pyarrow (the parquet extra) not installed")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["ok", None, "fine"]}), tmp_path / "n.parquet")
    with pytest.raises(DataError, match=r'n\.parquet: row 1: field "text" is null'):
        _prepared(tmp_path, [tmp_path / "n.parquet"])
    with pytest.raises(DataError, match="too little text"):
        _prepared(tmp_path, [tmp_path / "n.parquet"], skip_bad=True)


@pytest.mark.parametrize("marker", [False, True], ids=["plain", "marker-in-text"])
def test_task_in_one_call_equals_one_call_per_document(marker: bool) -> None:
    """A task of whole documents encoded in one tiktoken call (joined by the end-of-text
    marker) gives each document's ids + EOT exactly, edge whitespace included; a text that
    holds the marker as plain text sends the task back to one call per document."""
    import mobius_fed.data.prepare as prepare

    texts = [CORPUS[i : i + 3001] for i in range(0, 60_000, 3001)]
    texts += ["", " ", "\n\n", "tail  ", "naïve café 🙂\n"]
    if marker:
        texts.insert(3, "a <|endoftext|> b")
    ends = [True] * len(texts)
    whole = prepare._encode_whole(BYTES, texts, ends)
    assert (whole is None) == marker
    tokens, counts = prepare._encode_task(("bytes", texts, ends, "<u2"))
    each = [encode_document(BYTES, t) for t in texts]
    assert tokens.tolist() == [i for ids in each for i in ids]
    assert counts.tolist() == [len(ids) for ids in each]
    assert prepare._encode_whole(BYTES, texts[:2], [True, False]) is None  # a .txt block


@pytest.mark.parametrize("threads", [True, False], ids=["threads", "processes"])
def test_workers_give_the_same_tokens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, threads: bool
) -> None:
    """--workers 2 keeps the input order with tasks in flight, on threads (tiktoken) and on
    spawned processes (the other tokenizers), parts ending inside and between tasks."""
    texts = [CORPUS[i : i + 5000] for i in range(0, 300_000, 5000)]
    src = _docs(tmp_path / "d.jsonl", texts)
    import mobius_fed.data.prepare as prepare

    monkeypatch.setattr(prepare, "TASK_BYTES", 20_000)  # many small tasks
    monkeypatch.setattr(prepare, "_on_threads", lambda name: threads)
    got = _prepared(tmp_path, [src], workers=2, shard_tokens=70_000)
    assert got == _stream_of(texts)
