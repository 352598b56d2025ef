from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class RegisterRequest(_message.Message):
    __slots__ = ("listen_address", "config_fingerprint", "unreachable", "rendezvous", "relay", "data_tokenizer", "data_vocab", "standby")
    LISTEN_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    UNREACHABLE_FIELD_NUMBER: _ClassVar[int]
    RENDEZVOUS_FIELD_NUMBER: _ClassVar[int]
    RELAY_FIELD_NUMBER: _ClassVar[int]
    DATA_TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    DATA_VOCAB_FIELD_NUMBER: _ClassVar[int]
    STANDBY_FIELD_NUMBER: _ClassVar[int]
    listen_address: str
    config_fingerprint: str
    unreachable: bool
    rendezvous: str
    relay: str
    data_tokenizer: str
    data_vocab: int
    standby: bool
    def __init__(self, listen_address: _Optional[str] = ..., config_fingerprint: _Optional[str] = ..., unreachable: _Optional[bool] = ..., rendezvous: _Optional[str] = ..., relay: _Optional[str] = ..., data_tokenizer: _Optional[str] = ..., data_vocab: _Optional[int] = ..., standby: _Optional[bool] = ...) -> None: ...

class RunSpec(_message.Message):
    __slots__ = ("run_id", "rank", "peers", "train_config_json", "config_fingerprint", "resume_round", "resume_checkpoint", "heartbeat_interval_s", "tunnel_key", "crl", "standby")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    TRAIN_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    RESUME_ROUND_FIELD_NUMBER: _ClassVar[int]
    RESUME_CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    TUNNEL_KEY_FIELD_NUMBER: _ClassVar[int]
    CRL_FIELD_NUMBER: _ClassVar[int]
    STANDBY_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    rank: int
    peers: _containers.RepeatedScalarFieldContainer[str]
    train_config_json: str
    config_fingerprint: str
    resume_round: int
    resume_checkpoint: str
    heartbeat_interval_s: float
    tunnel_key: bytes
    crl: bytes
    standby: bool
    def __init__(self, run_id: _Optional[str] = ..., rank: _Optional[int] = ..., peers: _Optional[_Iterable[str]] = ..., train_config_json: _Optional[str] = ..., config_fingerprint: _Optional[str] = ..., resume_round: _Optional[int] = ..., resume_checkpoint: _Optional[str] = ..., heartbeat_interval_s: _Optional[float] = ..., tunnel_key: _Optional[bytes] = ..., crl: _Optional[bytes] = ..., standby: _Optional[bool] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("state", "step", "last_loss", "tokens_per_s", "links_json")
    STATE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LAST_LOSS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    LINKS_JSON_FIELD_NUMBER: _ClassVar[int]
    state: str
    step: int
    last_loss: float
    tokens_per_s: float
    links_json: str
    def __init__(self, state: _Optional[str] = ..., step: _Optional[int] = ..., last_loss: _Optional[float] = ..., tokens_per_s: _Optional[float] = ..., links_json: _Optional[str] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("stop", "reason", "rejoin", "crl")
    STOP_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    REJOIN_FIELD_NUMBER: _ClassVar[int]
    CRL_FIELD_NUMBER: _ClassVar[int]
    stop: bool
    reason: str
    rejoin: bool
    crl: bytes
    def __init__(self, stop: _Optional[bool] = ..., reason: _Optional[str] = ..., rejoin: _Optional[bool] = ..., crl: _Optional[bytes] = ...) -> None: ...

class Envelope(_message.Message):
    __slots__ = ("flower_message", "note")
    FLOWER_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    NOTE_FIELD_NUMBER: _ClassVar[int]
    flower_message: bytes
    note: str
    def __init__(self, flower_message: _Optional[bytes] = ..., note: _Optional[str] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReplaceRequest(_message.Message):
    __slots__ = ("worker", "standby", "force")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    STANDBY_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    worker: str
    standby: str
    force: bool
    def __init__(self, worker: _Optional[str] = ..., standby: _Optional[str] = ..., force: _Optional[bool] = ...) -> None: ...

class ReplaceReply(_message.Message):
    __slots__ = ("message",)
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    message: str
    def __init__(self, message: _Optional[str] = ...) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("json",)
    JSON_FIELD_NUMBER: _ClassVar[int]
    json: str
    def __init__(self, json: _Optional[str] = ...) -> None: ...
