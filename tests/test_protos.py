"""Committed generated protobuf code must match protos/ (python scripts/gen_protos.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gen_protos.py"


def test_generated_code_is_fresh() -> None:
    if importlib.util.find_spec("grpc_tools") is None:
        pytest.skip("grpc_tools (grpcio-tools) not installed; cannot regenerate protos")
    spec = importlib.util.spec_from_file_location("gen_protos", SCRIPT)
    assert spec is not None and spec.loader is not None
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    stale = gen.stale_files()
    assert not stale, f"stale generated code {stale}; run: python scripts/gen_protos.py"


def test_generated_modules_import() -> None:
    from mobius_fed.proto import ring_pb2, ring_pb2_grpc

    assert ring_pb2.DESCRIPTOR.package == "mobius_fed.ring.v1"
    assert ring_pb2.Frame.DESCRIPTOR.fields_by_name["tensor"].number == 7
    assert hasattr(ring_pb2_grpc, "RingLinkStub")
