"""The GPU path: device selection everywhere, bf16 autocast blocks on CUDA (skipped without)."""

from __future__ import annotations

import pytest
import torch

from mobius_fed.config import TrainConfig
from mobius_fed.data import SiteData, embedded_corpus, prepare_sites
from mobius_fed.engine import ReferenceEngine
from mobius_fed.model.layers import resolve_device

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_device_choice():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            resolve_device("cuda")
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        resolve_device("tpu")


def _engine(tmp_path, device: str, **kw) -> ReferenceEngine:
    cfg = TrainConfig(
        preset="cpu-tiny", workers=2, steps=3, batch_size=4, device=device, eval_every=0, **kw
    )
    dirs = prepare_sites(None, tmp_path / device, 2, text=embedded_corpus())
    sites = [SiteData(d, cfg.model().seq_len) for d in dirs]
    return ReferenceEngine(cfg, sites)


@cuda
def test_reference_trains_on_cuda_close_to_cpu(tmp_path):
    gpu, cpu = _engine(tmp_path, "cuda"), _engine(tmp_path, "cpu")
    assert next(gpu.groups[0].parameters()).is_cuda
    for _ in range(3):
        g, c = gpu.train_step(), cpu.train_step()
        assert g.loss == pytest.approx(c.loss, abs=0.05)  # bf16 blocks vs fp32
    h = gpu.replicas[0].embed(torch.zeros(1, 8, dtype=torch.long, device="cuda"))
    assert gpu.groups[0](h, 0).dtype == torch.float32, "the residual stream stays fp32"


@cuda
def test_codec_stage_on_cuda(tmp_path):
    engine = _engine(tmp_path, "cuda", wire={"fwd": "int8", "bwd": "int8"})
    r = engine.train_step()
    assert r.loss == r.loss  # finite, ran through the codec on the device


@cuda
def test_fp32_precision_on_cuda_tracks_cpu(tmp_path):
    """precision = fp32 turns the blocks' autocast off: the GPU follows the CPU closely."""
    gpu = _engine(tmp_path, "cuda", precision="fp32")
    cpu = _engine(tmp_path, "cpu", precision="fp32")
    assert not gpu.groups[0].blocks[0].bf16
    for _ in range(3):
        g, c = gpu.train_step(), cpu.train_step()
        assert g.loss == pytest.approx(c.loss, abs=1e-3)


def test_precision_is_not_training_math():
    """Like device, precision is how the blocks run: a checkpoint may resume under another
    precision, while the peers of one ring must agree on it (the fingerprint)."""
    bf16, fp32 = TrainConfig(precision="bf16"), TrainConfig(precision="fp32")
    assert bf16.training_math() == fp32.training_math()
    assert bf16.fingerprint() != fp32.fingerprint()
    with pytest.raises(ValueError, match="precision"):
        TrainConfig(precision="fp16")
