"""Generated protobuf/gRPC code (scripts/gen_protos.py)."""
