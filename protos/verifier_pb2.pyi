from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., min_p: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ...) -> None: ...

class Limits(_message.Message):
    __slots__ = ("max_new_tokens", "max_tree_nodes", "max_tree_depth")
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TREE_NODES_FIELD_NUMBER: _ClassVar[int]
    MAX_TREE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    max_new_tokens: int
    max_tree_nodes: int
    max_tree_depth: int
    def __init__(self, max_new_tokens: _Optional[int] = ..., max_tree_nodes: _Optional[int] = ..., max_tree_depth: _Optional[int] = ...) -> None: ...

class DraftTree(_message.Message):
    __slots__ = ("tokens", "parents")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    parents: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., parents: _Optional[_Iterable[int]] = ...) -> None: ...

class Open(_message.Message):
    __slots__ = ("target_model", "vocab_size", "vocab_fingerprint", "sampling", "prompt_tokens", "limits", "decode_steps", "top_logprobs", "prior_output_tokens", "constraint", "cache_salt", "withhold_from_teacher", "host_draft")
    TARGET_MODEL_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    DECODE_STEPS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PRIOR_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    WITHHOLD_FROM_TEACHER_FIELD_NUMBER: _ClassVar[int]
    HOST_DRAFT_FIELD_NUMBER: _ClassVar[int]
    target_model: str
    vocab_size: int
    vocab_fingerprint: str
    sampling: SamplingParams
    prompt_tokens: _containers.RepeatedScalarFieldContainer[int]
    limits: Limits
    decode_steps: int
    top_logprobs: int
    prior_output_tokens: int
    constraint: Constraint
    cache_salt: str
    withhold_from_teacher: bool
    host_draft: bool
    def __init__(self, target_model: _Optional[str] = ..., vocab_size: _Optional[int] = ..., vocab_fingerprint: _Optional[str] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., prompt_tokens: _Optional[_Iterable[int]] = ..., limits: _Optional[_Union[Limits, _Mapping]] = ..., decode_steps: _Optional[int] = ..., top_logprobs: _Optional[int] = ..., prior_output_tokens: _Optional[int] = ..., constraint: _Optional[_Union[Constraint, _Mapping]] = ..., cache_salt: _Optional[str] = ..., withhold_from_teacher: _Optional[bool] = ..., host_draft: _Optional[bool] = ...) -> None: ...

class Constraint(_message.Message):
    __slots__ = ("json_schema", "json_object")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ...) -> None: ...

class Opened(_message.Message):
    __slots__ = ("session_id", "target_model", "n_ctx", "limits", "prefill_us", "cached_tokens", "extra_pieces", "adapter", "host_drafter", "host_level_us")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODEL_FIELD_NUMBER: _ClassVar[int]
    N_CTX_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_US_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXTRA_PIECES_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    HOST_DRAFTER_FIELD_NUMBER: _ClassVar[int]
    HOST_LEVEL_US_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    target_model: str
    n_ctx: int
    limits: Limits
    prefill_us: int
    cached_tokens: int
    extra_pieces: _containers.RepeatedScalarFieldContainer[bytes]
    adapter: AdapterInfo
    host_drafter: str
    host_level_us: int
    def __init__(self, session_id: _Optional[str] = ..., target_model: _Optional[str] = ..., n_ctx: _Optional[int] = ..., limits: _Optional[_Union[Limits, _Mapping]] = ..., prefill_us: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., extra_pieces: _Optional[_Iterable[bytes]] = ..., adapter: _Optional[_Union[AdapterInfo, _Mapping]] = ..., host_drafter: _Optional[str] = ..., host_level_us: _Optional[int] = ...) -> None: ...

class AdapterInfo(_message.Message):
    __slots__ = ("sha256", "version", "base", "size_bytes")
    SHA256_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BASE_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    sha256: str
    version: int
    base: str
    size_bytes: int
    def __init__(self, sha256: _Optional[str] = ..., version: _Optional[int] = ..., base: _Optional[str] = ..., size_bytes: _Optional[int] = ...) -> None: ...

class Draft(_message.Message):
    __slots__ = ("session_id", "committed_len", "tree", "decode_steps", "seq", "assumed_tokens", "node_logprobs", "host_draft")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_LEN_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    DECODE_STEPS_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    ASSUMED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NODE_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    HOST_DRAFT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    committed_len: int
    tree: DraftTree
    decode_steps: int
    seq: int
    assumed_tokens: _containers.RepeatedScalarFieldContainer[int]
    node_logprobs: _containers.RepeatedScalarFieldContainer[float]
    host_draft: bool
    def __init__(self, session_id: _Optional[str] = ..., committed_len: _Optional[int] = ..., tree: _Optional[_Union[DraftTree, _Mapping]] = ..., decode_steps: _Optional[int] = ..., seq: _Optional[int] = ..., assumed_tokens: _Optional[_Iterable[int]] = ..., node_logprobs: _Optional[_Iterable[float]] = ..., host_draft: _Optional[bool] = ...) -> None: ...

class Verdict(_message.Message):
    __slots__ = ("accepted", "bonus_token", "committed_len", "finish_reason", "queue_us", "verify_us", "draft_seq", "rebased", "stale", "forward_tokens", "logprobs", "pruned_nodes", "committed_hash", "price_us_per_token", "batch_sessions", "token_budget", "host_tokens", "host_drafted", "host_level_us")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    BONUS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_LEN_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    QUEUE_US_FIELD_NUMBER: _ClassVar[int]
    VERIFY_US_FIELD_NUMBER: _ClassVar[int]
    DRAFT_SEQ_FIELD_NUMBER: _ClassVar[int]
    REBASED_FIELD_NUMBER: _ClassVar[int]
    STALE_FIELD_NUMBER: _ClassVar[int]
    FORWARD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PRUNED_NODES_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_HASH_FIELD_NUMBER: _ClassVar[int]
    PRICE_US_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    BATCH_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BUDGET_FIELD_NUMBER: _ClassVar[int]
    HOST_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HOST_DRAFTED_FIELD_NUMBER: _ClassVar[int]
    HOST_LEVEL_US_FIELD_NUMBER: _ClassVar[int]
    accepted: _containers.RepeatedScalarFieldContainer[int]
    bonus_token: int
    committed_len: int
    finish_reason: FinishReason
    queue_us: int
    verify_us: int
    draft_seq: int
    rebased: int
    stale: bool
    forward_tokens: int
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    pruned_nodes: int
    committed_hash: int
    price_us_per_token: int
    batch_sessions: int
    token_budget: int
    host_tokens: _containers.RepeatedScalarFieldContainer[int]
    host_drafted: int
    host_level_us: int
    def __init__(self, accepted: _Optional[_Iterable[int]] = ..., bonus_token: _Optional[int] = ..., committed_len: _Optional[int] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., queue_us: _Optional[int] = ..., verify_us: _Optional[int] = ..., draft_seq: _Optional[int] = ..., rebased: _Optional[int] = ..., stale: _Optional[bool] = ..., forward_tokens: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., pruned_nodes: _Optional[int] = ..., committed_hash: _Optional[int] = ..., price_us_per_token: _Optional[int] = ..., batch_sessions: _Optional[int] = ..., token_budget: _Optional[int] = ..., host_tokens: _Optional[_Iterable[int]] = ..., host_drafted: _Optional[int] = ..., host_level_us: _Optional[int] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("token", "logprob", "top_tokens", "top_logprobs")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token: int
    logprob: float
    top_tokens: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token: _Optional[int] = ..., logprob: _Optional[float] = ..., top_tokens: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class Close(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class Closed(_message.Message):
    __slots__ = ("session_id", "committed_len")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_LEN_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    committed_len: int
    def __init__(self, session_id: _Optional[str] = ..., committed_len: _Optional[int] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("open", "draft", "close")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    open: Open
    draft: Draft
    close: Close
    def __init__(self, open: _Optional[_Union[Open, _Mapping]] = ..., draft: _Optional[_Union[Draft, _Mapping]] = ..., close: _Optional[_Union[Close, _Mapping]] = ...) -> None: ...

class SessionResponse(_message.Message):
    __slots__ = ("opened", "verdict", "closed")
    OPENED_FIELD_NUMBER: _ClassVar[int]
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    opened: Opened
    verdict: Verdict
    closed: Closed
    def __init__(self, opened: _Optional[_Union[Opened, _Mapping]] = ..., verdict: _Optional[_Union[Verdict, _Mapping]] = ..., closed: _Optional[_Union[Closed, _Mapping]] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("target_model", "engine", "vocab_size", "vocab_fingerprint", "n_ctx", "active_sessions", "max_sessions", "draining", "chat_template", "bos_token", "eos_token")
    TARGET_MODEL_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    N_CTX_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    BOS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    target_model: str
    engine: str
    vocab_size: int
    vocab_fingerprint: str
    n_ctx: int
    active_sessions: int
    max_sessions: int
    draining: bool
    chat_template: str
    bos_token: str
    eos_token: str
    def __init__(self, target_model: _Optional[str] = ..., engine: _Optional[str] = ..., vocab_size: _Optional[int] = ..., vocab_fingerprint: _Optional[str] = ..., n_ctx: _Optional[int] = ..., active_sessions: _Optional[int] = ..., max_sessions: _Optional[int] = ..., draining: _Optional[bool] = ..., chat_template: _Optional[str] = ..., bos_token: _Optional[str] = ..., eos_token: _Optional[str] = ...) -> None: ...

class AdapterRequest(_message.Message):
    __slots__ = ("sha256", "cache_salt")
    SHA256_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    sha256: str
    cache_salt: str
    def __init__(self, sha256: _Optional[str] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class AdapterChunk(_message.Message):
    __slots__ = ("format", "info", "data")
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    format: str
    info: AdapterInfo
    data: bytes
    def __init__(self, format: _Optional[str] = ..., info: _Optional[_Union[AdapterInfo, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class TokenizerRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TokenizerChunk(_message.Message):
    __slots__ = ("format", "vocab_fingerprint", "data")
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    VOCAB_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    format: str
    vocab_fingerprint: str
    data: bytes
    def __init__(self, format: _Optional[str] = ..., vocab_fingerprint: _Optional[str] = ..., data: _Optional[bytes] = ...) -> None: ...
