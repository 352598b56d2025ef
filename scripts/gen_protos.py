"""Generate Python code for every .proto under protos/ into the package tree.

Usage: ``python scripts/gen_protos.py [--check]``. With ``--check`` the code is generated
into a temporary directory and compared with the committed files; exit status 1 lists
the stale ones. Generated files (``*_pb2.py``, ``*_pb2.pyi``, ``*_pb2_grpc.py``) are
never hand-edited.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTOS = ROOT / "protos"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def proto_files() -> list[Path]:
    """All .proto files under protos/, relative to it, sorted."""
    return sorted(p.relative_to(PROTOS) for p in PROTOS.rglob("*.proto"))


def generate(out_root: Path) -> list[Path]:
    """Run grpc_tools.protoc into ``out_root``; return generated paths relative to it."""
    protos = proto_files()
    if not protos:
        raise SystemExit(f"no .proto files under {PROTOS}")
    cmd = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        f"-I{PROTOS}",
        f"--python_out={out_root}",
        f"--grpc_python_out={out_root}",
        f"--pyi_out={out_root}",
        *(str(p) for p in protos),
    ]
    subprocess.run(cmd, check=True, cwd=ROOT)
    outs: list[Path] = []
    for p in protos:
        stem = p.with_suffix("")
        outs += [stem.parent / (stem.name + s) for s in GENERATED_SUFFIXES]
    for package_dir in {p.parent for p in protos}:
        init = out_root / package_dir / "__init__.py"
        if not init.exists():
            init.write_text('"""Generated protobuf/gRPC code (scripts/gen_protos.py)."""\n')
    return outs


def stale_files() -> list[str]:
    """Generated files that are missing or differ from a fresh generation."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh_root = Path(tmp)
        stale = []
        for rel in generate(fresh_root):
            committed = ROOT / rel
            if not committed.exists() or committed.read_bytes() != (fresh_root / rel).read_bytes():
                stale.append(str(rel))
        return stale


def main(argv: list[str] | None = None) -> int:
    """CLI entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if generated code is stale")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files()
        for rel in stale:
            print(f"stale: {rel}", file=sys.stderr)
        if stale:
            print("run: python scripts/gen_protos.py", file=sys.stderr)
        return 1 if stale else 0
    for rel in generate(ROOT):
        print(f"wrote {rel}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
