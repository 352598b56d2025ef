"""Wire codecs: exact round trips, sizes, rejected payloads, and ring == reference."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from mobius_fed.config import TrainConfig
from mobius_fed.proto import ring_pb2
from mobius_fed.transport.codec import FrameError, TensorAssembler, encode_frames, parse_frame
from mobius_fed.transport.compress import CODECS, Codec, CodecError, pack_bits, unpack_bits
from mobius_fed.transport.wire_config import WireConfig
from tests.bench_loader import load_benchmark
from tests.ring_harness import Ring

SHAPE = (4, 32, 96)
LOSSY = [c for c in CODECS if c != "none"]


def _x() -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(SHAPE, generator=gen) * torch.linspace(0.1, 3, SHAPE[-1])
    x[..., 5] *= 40  # an outlier channel, as residual streams have
    return x


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_bit_packing_round_trips(bits):
    codes = torch.randint(0, 1 << bits, (8 * 37,), dtype=torch.uint8)
    packed = pack_bits(codes, bits)
    assert packed.numel() == 37 * bits
    assert torch.equal(unpack_bits(packed, bits), codes)


@pytest.mark.parametrize("name", LOSSY)
def test_codec_is_deterministic_sized_and_close(name):
    codec = Codec(name, group=64, rank=8)
    x = _x()
    payload = codec.encode(x)
    assert payload.dtype == torch.uint8 and payload.numel() == codec.payload_bytes(SHAPE)
    y = codec.decode(payload, SHAPE)
    assert torch.equal(y, codec.roundtrip(x.clone())), "the same input must decode identically"
    rel = ((y - x).norm() / x.norm()).item()
    limit = {"int8": 0.01, "fp8": 0.05, "fp8e5m2": 0.08, "int6": 0.04, "int5": 0.08}
    limit.update({"int4": 0.15, "int3": 0.3})
    assert rel < limit.get(name, 1.0), rel
    assert codec.ratio(SHAPE) > 3.8


def test_stochastic_rounding_is_seeded_and_unbiased():
    codec = Codec("int2", stochastic=True)
    assert codec.spec == "int2/g64/sr"
    x = _x()[:1, :8]
    a, b = codec.roundtrip(x, seed=3), codec.roundtrip(x, seed=3)
    assert torch.equal(a, b), "the same seed must give the same tensor"
    assert not torch.equal(a, codec.roundtrip(x, seed=4))
    mean = torch.stack([codec.roundtrip(x, seed=k) for k in range(400)]).mean(0)
    nearest = Codec("int2").roundtrip(x)
    assert (mean - x).abs().mean() < 0.25 * (nearest - x).abs().mean()


def test_ratios():
    shape = (8, 128, 96)  # a cpu-small micro-batch
    assert Codec("int8").ratio(shape) == pytest.approx(32 / 8.25)
    assert Codec("int3").ratio(shape) == pytest.approx(32 / 3.25)
    assert Codec("int2").ratio(shape) == pytest.approx(32 / 2.25)
    assert Codec("lowrank", rank=5).ratio(shape) > 16


def test_bad_codec_settings_are_named():
    with pytest.raises(ValueError, match="unknown wire codec 'int9'"):
        Codec("int9")
    assert WireConfig.parse_flag("fwd=int8,bwd=fp8") == {"fwd": "int8", "bwd": "fp8"}
    assert WireConfig.parse_flag("both=int3") == {"fwd": "int3", "bwd": "int3"}
    with pytest.raises(ValueError, match="unknown key 'fwdd'"):
        WireConfig.parse_flag("fwdd=int8")
    with pytest.raises(ValueError, match="group=12 is not a multiple of 8"):
        WireConfig.parse_flag("group=12")


def _frames(codec: Codec, payload: torch.Tensor, chunk_bytes: int = 1000) -> list[bytes]:
    return list(
        encode_frames(
            run_id="r",
            step=0,
            origin=0,
            tick=1,
            micro=0,
            direction=ring_pb2.FORWARD,
            tensor=payload,
            chunk_bytes=chunk_bytes,
            packed=(codec.spec, SHAPE),
        )
    )


def _assemble(codec: Codec, frames: list[bytes], expect: Codec | None = None) -> torch.Tensor:
    asm = TensorAssembler(SHAPE, "fp32", codec=expect or codec)
    out = None
    for raw in frames:
        frame, data = parse_frame(raw)
        out = asm.add("k", frame, data=data)
    assert out is not None
    return out


@pytest.mark.parametrize("name", ["int3", "fp8", "lowrank"])
def test_packed_frames_reassemble_to_the_roundtrip(name):
    codec = Codec(name)
    x = _x()
    frames = _frames(codec, codec.encode(x))
    assert len(frames) > 1, "the payload must travel in pieces"
    assert torch.equal(_assemble(codec, frames), codec.roundtrip(x))


def _tamper(raw: bytes, **changes) -> bytes:
    frame, data = parse_frame(raw)
    full = ring_pb2.Frame()
    full.CopyFrom(frame)
    full.tensor.data = bytes(data)
    for key, value in changes.items():
        setattr(full.tensor, key, value)
    return full.SerializeToString()


def test_malformed_packed_payloads_are_rejected():
    codec = Codec("int3")
    payload = codec.encode(_x())
    frames = _frames(codec, payload, chunk_bytes=1 << 20)
    assert len(frames) == 1
    with pytest.raises(FrameError, match=r"codec 'int3/g32' \(expected 'int3/g64'\)"):
        _assemble(codec, [_tamper(frames[0], codec="int3/g32")])
    with pytest.raises(FrameError, match="dtype fp32 \\(expected PACKED int3/g64\\)"):
        _assemble(codec, [_tamper(frames[0], dtype=ring_pb2.FLOAT32)])
    with pytest.raises(FrameError, match="crc32"):
        bad = bytearray(payload.numpy().tobytes())
        bad[-1] ^= 0xFF
        _assemble(codec, [_tamper(frames[0], data=bytes(bad))])
    short = payload.numpy().tobytes()[:-3]
    with pytest.raises(FrameError, match="payload bytes"):
        import zlib

        _assemble(codec, [_tamper(frames[0], data=short, crc32=zlib.crc32(short))])
    # a NaN scale: the payload is well-formed bytes but decodes to non-finite values
    nan = payload.clone()
    nan[:2] = torch.tensor([0xC0, 0x7F], dtype=torch.uint8)  # bf16 NaN
    with pytest.raises(FrameError, match="non-finite"):
        _assemble(codec, _frames(codec, nan))
    with pytest.raises(CodecError, match="payload of 5 bytes"):
        codec.decode(torch.zeros(5, dtype=torch.uint8), SHAPE)


# ----------------------------------------------------------------- ring == reference

RING = dict(preset="cpu-tiny", steps=2, batch_size=4, sync_every=0, eval_every=0)
PAIRS = [
    ("cyclic", 2, "int8", "fp8"),
    ("ordered", 3, "fp8e5m2", "int4"),
    ("cyclic", 2, "int6", "int5"),
    ("cyclic", 3, "int3", "int2/sr"),
    ("ordered", 2, "lowrank", "int3"),
]


class CodecRing(Ring):
    """The harness's ring, with ``wire_*`` keys folded into the ``wire`` sub-config."""

    def config(self) -> TrainConfig:
        train = dict(self.train)
        keys = ("wire_fwd", "wire_bwd", "wire_rounding")
        wire = {k[5:]: train.pop(k) for k in list(train) if k in keys}
        return TrainConfig(workers=self.P, wire=wire, **train)


@pytest.mark.slow
@pytest.mark.parametrize(("order", "P", "fwd", "bwd"), PAIRS)
def test_ring_equals_reference_with_codec(tmp_path: Path, order, P, fwd, bwd):
    """Every codec, both directions, relays included (ordered): the ring's losses equal
    the reference engine's exactly, and the wire carried the compressed payloads."""
    stochastic = bwd.endswith("/sr")  # int2 gradients rounded stochastically
    bwd = bwd.removesuffix("/sr")
    train = {**RING, "order": order, "wire_fwd": fwd, "wire_bwd": bwd}
    if stochastic:
        train["wire_rounding"] = "stochastic"
    ring = CodecRing(tmp_path, P, train).prepare()
    capture = tmp_path / "worker-1.frames"
    ring.start(extra={1: ["--capture-frames", str(capture)]}).wait()
    ref, ref_eval = ring.reference()
    got = ring.losses()
    assert set(got) == set(ref)
    assert max(abs(got[k] - ref[k]) for k in ref) == 0.0
    ring_eval = ring.eval_losses()
    assert all(ring_eval[s] == v for s, v in enumerate(ref_eval))
    sent = capture.read_bytes()
    specs = [Codec(name, stochastic=stochastic).spec for name in (fwd, bwd)]
    assert all(spec.encode() in sent for spec in specs), specs


def test_ids_codec_sends_token_ids_exactly_after_the_payload():
    """Subspace mode tokens: the last channel (token ids) travels as exact 16-bit integers
    after the codec's payload of the other channels; the spec names it."""
    codec = Codec("int4", stochastic=True, ids=True)
    x = torch.randn(2, 7, 9)
    x[..., -1] = torch.randint(0, 50304, (2, 7)).float()
    payload = codec.encode(x, seed=4)
    assert payload.numel() == codec.payload_bytes((2, 7, 9))
    assert codec.payload_bytes((2, 7, 9)) == Codec("int4").payload_bytes((2, 7, 8)) + 2 * 14
    y = codec.decode(payload, (2, 7, 9))
    assert torch.equal(y[..., -1], x[..., -1])
    assert torch.equal(y[..., :-1], Codec("int4", stochastic=True).roundtrip(x[..., :-1], 4))
    assert codec.spec == "int4/g64/sr+ids"
    with pytest.raises(CodecError, match="payload of 10 bytes"):
        codec.decode(payload[:10], (2, 7, 9))


def test_width_law_pairs_fits_and_judges_the_targets(tmp_path: Path):
    """The width-law table pairs each arm with the fp32 model of its own width and seed,
    fits Δ = a·d^−β (recovering a known law), extrapolates, and says met or missed."""
    bench = load_benchmark("compression")
    fit = bench.power_law([(48, 0.8), (96, 0.4), (192, 0.2)])
    assert fit["beta"] == pytest.approx(1.0) and fit["width_for"](0.02) == pytest.approx(1920)
    mid, (lo, hi) = fit["predict"](768)
    assert mid == pytest.approx(0.05) and lo <= mid <= hi
    with pytest.raises(ValueError, match="≥ 2 widths"):
        bench.power_law([(96, 0.4)])
    # Δ ≤ 0 somewhere (better than fp32): no power law, Δ = a + b·ln d instead
    line = bench.log_linear([(48, -0.04), (96, 0.0), (192, 0.04)])
    assert line["b"] == pytest.approx(0.04 / math.log(2)) and line["se"] == pytest.approx(0)
    assert line["width_for"](0.02) == pytest.approx(96 * 2**0.5)
    assert bench.ratio_class(33.8) == "~40×" and bench.ratio_class(107.8) == "≥100×"
    rows = []
    for preset, base, delta in (("width-48", 2.0, 0.8), ("width-96", 1.8, 0.4)):
        for seed, wiggle in ((0, 0.0), (1, 0.01), (2, -0.01)):
            common = dict(order="cyclic", loops=1, steps=10, preset=preset, seed=seed)
            rows.append({**common, "wire": "none", "subspace": "off", "eq8": base, "ratio": 1})
            sub = f"rank={12 if preset == 'width-96' else 6},mode=tokens,writes=full"
            wire = "fwd=int8,bwd=int4,rounding=stochastic"
            eq8 = base + delta + wiggle
            rows.append({**common, "wire": wire, "subspace": sub, "eq8": eq8, "ratio": 37.0})
            if preset == "width-96" and seed == 0:  # a learned U: a scheme of its own
                learned = f"{sub},learn=on,lr=0.01"
                row = {**common, "wire": wire, "subspace": learned, "eq8": base + 0.5}
                rows.append({**row, "ratio": 37.0})
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = bench.width_law([str(path)], str(tmp_path / "law.png"))
    assert "| tokens, full, ~40×; fwd=int8,bwd=int4,rounding=stochastic | 96 | d/8 | 10 |" in text
    assert "+0.400 ± 0.025 | 3 |" in text  # t(2) · s/√3 with s = 0.01
    learned = "| tokens, full, ~40×, learned U (lr 0.01); fwd=int8,bwd=int4,rounding=stochastic"
    assert f"{learned} | 96 | d/8 | 10 |" in text and "+0.500 | 1 |" in text
    assert bench.parse_subspace("rank=12,mode=tokens,learn=on,lr=0.02,schedule=constant") == {
        "rank": 12, "mode": "tokens", "learn": True, "lr": 0.02, "schedule": "constant"
    }  # fmt: skip
    with pytest.raises(ValueError, match="learn must be on or off"):
        bench.parse_subspace("rank=12,learn=yes")
    assert "Δ ≈ " in text and "d^−1.000" in text
    assert "target ≥ 32× at Δ ≤ 0.02: MISSED by 0.380" in text
    assert "fit: Δ = 0.02 at d ≈ 1920" in text
    assert "moonshot ≥ 100×: no arm at that ratio measured at d = 96" in text
    assert (tmp_path / "law.png").stat().st_size > 1000
