from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Direction(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DIRECTION_UNSPECIFIED: _ClassVar[Direction]
    FORWARD: _ClassVar[Direction]
    BACKWARD: _ClassVar[Direction]
    FIN: _ClassVar[Direction]
    ACK: _ClassVar[Direction]
    CLOSE: _ClassVar[Direction]

class Phase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRAIN: _ClassVar[Phase]
    EVAL: _ClassVar[Phase]

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    FLOAT32: _ClassVar[DType]
    BFLOAT16: _ClassVar[DType]
    FLOAT16: _ClassVar[DType]
    PACKED: _ClassVar[DType]
DIRECTION_UNSPECIFIED: Direction
FORWARD: Direction
BACKWARD: Direction
FIN: Direction
ACK: Direction
CLOSE: Direction
TRAIN: Phase
EVAL: Phase
DTYPE_UNSPECIFIED: DType
FLOAT32: DType
BFLOAT16: DType
FLOAT16: DType
PACKED: DType

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data", "crc32", "offset", "codec")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    crc32: int
    offset: int
    codec: str
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ..., crc32: _Optional[int] = ..., offset: _Optional[int] = ..., codec: _Optional[str] = ...) -> None: ...

class Frame(_message.Message):
    __slots__ = ("run_id", "step", "origin", "tick", "micro", "direction", "tensor", "phase", "chunk", "chunks", "ack")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_FIELD_NUMBER: _ClassVar[int]
    TICK_FIELD_NUMBER: _ClassVar[int]
    MICRO_FIELD_NUMBER: _ClassVar[int]
    DIRECTION_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    step: int
    origin: int
    tick: int
    micro: int
    direction: Direction
    tensor: Tensor
    phase: Phase
    chunk: int
    chunks: int
    ack: int
    def __init__(self, run_id: _Optional[str] = ..., step: _Optional[int] = ..., origin: _Optional[int] = ..., tick: _Optional[int] = ..., micro: _Optional[int] = ..., direction: _Optional[_Union[Direction, str]] = ..., tensor: _Optional[_Union[Tensor, _Mapping]] = ..., phase: _Optional[_Union[Phase, str]] = ..., chunk: _Optional[int] = ..., chunks: _Optional[int] = ..., ack: _Optional[int] = ...) -> None: ...

class PingRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PingReply(_message.Message):
    __slots__ = ("identity", "peer")
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    identity: str
    peer: str
    def __init__(self, identity: _Optional[str] = ..., peer: _Optional[str] = ...) -> None: ...
