from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SequenceState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SEQUENCE_STATE_UNSPECIFIED: _ClassVar[SequenceState]
    PREFILLED: _ClassVar[SequenceState]
    IN_DECODE: _ClassVar[SequenceState]
    ON_HOLD: _ClassVar[SequenceState]
    EVICTED: _ClassVar[SequenceState]
    COMPLETED: _ClassVar[SequenceState]
SEQUENCE_STATE_UNSPECIFIED: SequenceState
PREFILLED: SequenceState
IN_DECODE: SequenceState
ON_HOLD: SequenceState
EVICTED: SequenceState
COMPLETED: SequenceState

class CloseSessionRequest(_message.Message):
    __slots__ = ("session",)
    SESSION_FIELD_NUMBER: _ClassVar[int]
    session: str
    def __init__(self, session: _Optional[str] = ...) -> None: ...

class CloseSessionReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class OpenSessionRequest(_message.Message):
    __slots__ = ("client_name", "pid", "ticket")
    CLIENT_NAME_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    client_name: str
    pid: int
    ticket: str
    def __init__(self, client_name: _Optional[str] = ..., pid: _Optional[int] = ..., ticket: _Optional[str] = ...) -> None: ...

class SessionEvent(_message.Message):
    __slots__ = ("opened", "evicted")
    OPENED_FIELD_NUMBER: _ClassVar[int]
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    opened: SessionOpened
    evicted: SequencesEvicted
    def __init__(self, opened: _Optional[_Union[SessionOpened, _Mapping]] = ..., evicted: _Optional[_Union[SequencesEvicted, _Mapping]] = ...) -> None: ...

class SessionOpened(_message.Message):
    __slots__ = ("session", "prefix_reuse", "host_bytes", "daemon_instance")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    PREFIX_REUSE_FIELD_NUMBER: _ClassVar[int]
    HOST_BYTES_FIELD_NUMBER: _ClassVar[int]
    DAEMON_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    session: str
    prefix_reuse: bool
    host_bytes: int
    daemon_instance: str
    def __init__(self, session: _Optional[str] = ..., prefix_reuse: _Optional[bool] = ..., host_bytes: _Optional[int] = ..., daemon_instance: _Optional[str] = ...) -> None: ...

class SequencesEvicted(_message.Message):
    __slots__ = ("namespace_id", "seq_ids")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    namespace_id: int
    seq_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, namespace_id: _Optional[int] = ..., seq_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class PageLayout(_message.Message):
    __slots__ = ("num_layers", "num_kv_heads", "head_dim", "page_size", "dtype", "kind")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: str
    kind: str
    def __init__(self, num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., page_size: _Optional[int] = ..., dtype: _Optional[str] = ..., kind: _Optional[str] = ...) -> None: ...

class NamespaceIdentity(_message.Message):
    __slots__ = ("model", "revision", "layout", "tp_rank", "tp_size", "attention", "vocab_size", "extra")
    class ExtraEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EXTRA_FIELD_NUMBER: _ClassVar[int]
    model: str
    revision: str
    layout: PageLayout
    tp_rank: int
    tp_size: int
    attention: str
    vocab_size: int
    extra: _containers.ScalarMap[str, str]
    def __init__(self, model: _Optional[str] = ..., revision: _Optional[str] = ..., layout: _Optional[_Union[PageLayout, _Mapping]] = ..., tp_rank: _Optional[int] = ..., tp_size: _Optional[int] = ..., attention: _Optional[str] = ..., vocab_size: _Optional[int] = ..., extra: _Optional[_Mapping[str, str]] = ...) -> None: ...

class RegisterNamespaceRequest(_message.Message):
    __slots__ = ("session", "identity")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    session: str
    identity: NamespaceIdentity
    def __init__(self, session: _Optional[str] = ..., identity: _Optional[_Union[NamespaceIdentity, _Mapping]] = ...) -> None: ...

class RegisterNamespaceReply(_message.Message):
    __slots__ = ("namespace_id", "page_bytes", "root")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    ROOT_FIELD_NUMBER: _ClassVar[int]
    namespace_id: int
    page_bytes: int
    root: bytes
    def __init__(self, namespace_id: _Optional[int] = ..., page_bytes: _Optional[int] = ..., root: _Optional[bytes] = ...) -> None: ...

class DescribeExtentsRequest(_message.Message):
    __slots__ = ("session", "namespace_id")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    session: str
    namespace_id: int
    def __init__(self, session: _Optional[str] = ..., namespace_id: _Optional[int] = ...) -> None: ...

class ExtentInfo(_message.Message):
    __slots__ = ("shm_name", "first_page", "num_pages", "page_bytes")
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    FIRST_PAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    shm_name: str
    first_page: int
    num_pages: int
    page_bytes: int
    def __init__(self, shm_name: _Optional[str] = ..., first_page: _Optional[int] = ..., num_pages: _Optional[int] = ..., page_bytes: _Optional[int] = ...) -> None: ...

class DescribeExtentsReply(_message.Message):
    __slots__ = ("extents",)
    EXTENTS_FIELD_NUMBER: _ClassVar[int]
    extents: _containers.RepeatedCompositeFieldContainer[ExtentInfo]
    def __init__(self, extents: _Optional[_Iterable[_Union[ExtentInfo, _Mapping]]] = ...) -> None: ...

class ExtraKey(_message.Message):
    __slots__ = ("kind", "value", "offset", "length")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[ExtraKey.Kind]
        MULTIMODAL: _ClassVar[ExtraKey.Kind]
        LORA: _ClassVar[ExtraKey.Kind]
        CACHE_SALT: _ClassVar[ExtraKey.Kind]
    KIND_UNSPECIFIED: ExtraKey.Kind
    MULTIMODAL: ExtraKey.Kind
    LORA: ExtraKey.Kind
    CACHE_SALT: ExtraKey.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    kind: ExtraKey.Kind
    value: bytes
    offset: int
    length: int
    def __init__(self, kind: _Optional[_Union[ExtraKey.Kind, str]] = ..., value: _Optional[bytes] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class OpenTokenBufferRequest(_message.Message):
    __slots__ = ("session", "size_bytes")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    session: str
    size_bytes: int
    def __init__(self, session: _Optional[str] = ..., size_bytes: _Optional[int] = ...) -> None: ...

class OpenTokenBufferReply(_message.Message):
    __slots__ = ("shm_name", "size_bytes")
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    shm_name: str
    size_bytes: int
    def __init__(self, shm_name: _Optional[str] = ..., size_bytes: _Optional[int] = ...) -> None: ...

class ReadTokenBufferRequest(_message.Message):
    __slots__ = ("session", "span")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    SPAN_FIELD_NUMBER: _ClassVar[int]
    session: str
    span: TokenSpan
    def __init__(self, session: _Optional[str] = ..., span: _Optional[_Union[TokenSpan, _Mapping]] = ...) -> None: ...

class ReadTokenBufferReply(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: bytes
    def __init__(self, token_ids: _Optional[bytes] = ...) -> None: ...

class TokenSpan(_message.Message):
    __slots__ = ("offset", "num_tokens")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    offset: int
    num_tokens: int
    def __init__(self, offset: _Optional[int] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class SequenceRequest(_message.Message):
    __slots__ = ("seq_id", "tokens", "extra_keys", "tokens_at")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXTRA_KEYS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_AT_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    tokens: bytes
    extra_keys: _containers.RepeatedCompositeFieldContainer[ExtraKey]
    tokens_at: TokenSpan
    def __init__(self, seq_id: _Optional[str] = ..., tokens: _Optional[bytes] = ..., extra_keys: _Optional[_Iterable[_Union[ExtraKey, _Mapping]]] = ..., tokens_at: _Optional[_Union[TokenSpan, _Mapping]] = ...) -> None: ...

class AllocateRequest(_message.Message):
    __slots__ = ("session", "namespace_id", "sequences")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    session: str
    namespace_id: int
    sequences: _containers.RepeatedCompositeFieldContainer[SequenceRequest]
    def __init__(self, session: _Optional[str] = ..., namespace_id: _Optional[int] = ..., sequences: _Optional[_Iterable[_Union[SequenceRequest, _Mapping]]] = ...) -> None: ...

class SequenceAllocation(_message.Message):
    __slots__ = ("seq_id", "shared_pages", "private_pages", "shared_prefix_tokens", "suffix_start", "num_tokens")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    SHARED_PAGES_FIELD_NUMBER: _ClassVar[int]
    PRIVATE_PAGES_FIELD_NUMBER: _ClassVar[int]
    SHARED_PREFIX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SUFFIX_START_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    shared_pages: bytes
    private_pages: bytes
    shared_prefix_tokens: int
    suffix_start: int
    num_tokens: int
    def __init__(self, seq_id: _Optional[str] = ..., shared_pages: _Optional[bytes] = ..., private_pages: _Optional[bytes] = ..., shared_prefix_tokens: _Optional[int] = ..., suffix_start: _Optional[int] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class AllocateReply(_message.Message):
    __slots__ = ("sequences", "evicted_seq_ids")
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    EVICTED_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    sequences: _containers.RepeatedCompositeFieldContainer[SequenceAllocation]
    evicted_seq_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, sequences: _Optional[_Iterable[_Union[SequenceAllocation, _Mapping]]] = ..., evicted_seq_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("session", "namespace_id", "sequences")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    session: str
    namespace_id: int
    sequences: _containers.RepeatedCompositeFieldContainer[SequenceRequest]
    def __init__(self, session: _Optional[str] = ..., namespace_id: _Optional[int] = ..., sequences: _Optional[_Iterable[_Union[SequenceRequest, _Mapping]]] = ...) -> None: ...

class LookupResult(_message.Message):
    __slots__ = ("seq_id", "hit_pages", "hit_tokens", "remote_pending_tokens")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    HIT_PAGES_FIELD_NUMBER: _ClassVar[int]
    HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_PENDING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    hit_pages: bytes
    hit_tokens: int
    remote_pending_tokens: int
    def __init__(self, seq_id: _Optional[str] = ..., hit_pages: _Optional[bytes] = ..., hit_tokens: _Optional[int] = ..., remote_pending_tokens: _Optional[int] = ...) -> None: ...

class LookupReply(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[LookupResult]
    def __init__(self, results: _Optional[_Iterable[_Union[LookupResult, _Mapping]]] = ...) -> None: ...

class PublishItem(_message.Message):
    __slots__ = ("seq_id", "num_tokens")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    num_tokens: int
    def __init__(self, seq_id: _Optional[str] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class PublishRequest(_message.Message):
    __slots__ = ("session", "namespace_id", "items")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    session: str
    namespace_id: int
    items: _containers.RepeatedCompositeFieldContainer[PublishItem]
    def __init__(self, session: _Optional[str] = ..., namespace_id: _Optional[int] = ..., items: _Optional[_Iterable[_Union[PublishItem, _Mapping]]] = ...) -> None: ...

class Rebind(_message.Message):
    __slots__ = ("position", "old_page", "new_page")
    POSITION_FIELD_NUMBER: _ClassVar[int]
    OLD_PAGE_FIELD_NUMBER: _ClassVar[int]
    NEW_PAGE_FIELD_NUMBER: _ClassVar[int]
    position: int
    old_page: int
    new_page: int
    def __init__(self, position: _Optional[int] = ..., old_page: _Optional[int] = ..., new_page: _Optional[int] = ...) -> None: ...

class PublishResult(_message.Message):
    __slots__ = ("seq_id", "published_pages", "rebinds")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_PAGES_FIELD_NUMBER: _ClassVar[int]
    REBINDS_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    published_pages: int
    rebinds: _containers.RepeatedCompositeFieldContainer[Rebind]
    def __init__(self, seq_id: _Optional[str] = ..., published_pages: _Optional[int] = ..., rebinds: _Optional[_Iterable[_Union[Rebind, _Mapping]]] = ...) -> None: ...

class PublishReply(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[PublishResult]
    def __init__(self, results: _Optional[_Iterable[_Union[PublishResult, _Mapping]]] = ...) -> None: ...

class ExtendRequest(_message.Message):
    __slots__ = ("session", "namespace_id", "seq_ids", "num_tokens", "token_id_counts", "token_ids")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_COUNTS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    session: str
    namespace_id: int
    seq_ids: _containers.RepeatedScalarFieldContainer[str]
    num_tokens: _containers.RepeatedScalarFieldContainer[int]
    token_id_counts: _containers.RepeatedScalarFieldContainer[int]
    token_ids: bytes
    def __init__(self, session: _Optional[str] = ..., namespace_id: _Optional[int] = ..., seq_ids: _Optional[_Iterable[str]] = ..., num_tokens: _Optional[_Iterable[int]] = ..., token_id_counts: _Optional[_Iterable[int]] = ..., token_ids: _Optional[bytes] = ...) -> None: ...

class ExtendReply(_message.Message):
    __slots__ = ("num_tokens", "new_page_counts", "new_pages", "evicted_seq_ids")
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NEW_PAGE_COUNTS_FIELD_NUMBER: _ClassVar[int]
    NEW_PAGES_FIELD_NUMBER: _ClassVar[int]
    EVICTED_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    num_tokens: _containers.RepeatedScalarFieldContainer[int]
    new_page_counts: _containers.RepeatedScalarFieldContainer[int]
    new_pages: bytes
    evicted_seq_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, num_tokens: _Optional[_Iterable[int]] = ..., new_page_counts: _Optional[_Iterable[int]] = ..., new_pages: _Optional[bytes] = ..., evicted_seq_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ForkRequest(_message.Message):
    __slots__ = ("session", "namespace_id", "src_seq_id", "dst_seq_id")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    SRC_SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    DST_SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    session: str
    namespace_id: int
    src_seq_id: str
    dst_seq_id: str
    def __init__(self, session: _Optional[str] = ..., namespace_id: _Optional[int] = ..., src_seq_id: _Optional[str] = ..., dst_seq_id: _Optional[str] = ...) -> None: ...

class ForkReply(_message.Message):
    __slots__ = ("sequence", "evicted_seq_ids")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    EVICTED_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    sequence: SequenceAllocation
    evicted_seq_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, sequence: _Optional[_Union[SequenceAllocation, _Mapping]] = ..., evicted_seq_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("session", "namespace_id", "seq_ids")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    session: str
    namespace_id: int
    seq_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, session: _Optional[str] = ..., namespace_id: _Optional[int] = ..., seq_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ReleaseReply(_message.Message):
    __slots__ = ("released_pages",)
    RELEASED_PAGES_FIELD_NUMBER: _ClassVar[int]
    released_pages: int
    def __init__(self, released_pages: _Optional[int] = ...) -> None: ...

class SetStateRequest(_message.Message):
    __slots__ = ("session", "namespace_id", "seq_id", "state")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    session: str
    namespace_id: int
    seq_id: str
    state: SequenceState
    def __init__(self, session: _Optional[str] = ..., namespace_id: _Optional[int] = ..., seq_id: _Optional[str] = ..., state: _Optional[_Union[SequenceState, str]] = ...) -> None: ...

class SetStateReply(_message.Message):
    __slots__ = ("previous",)
    PREVIOUS_FIELD_NUMBER: _ClassVar[int]
    previous: SequenceState
    def __init__(self, previous: _Optional[_Union[SequenceState, str]] = ...) -> None: ...

class SetStatesRequest(_message.Message):
    __slots__ = ("session", "namespace_id", "seq_ids", "state")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    session: str
    namespace_id: int
    seq_ids: _containers.RepeatedScalarFieldContainer[str]
    state: SequenceState
    def __init__(self, session: _Optional[str] = ..., namespace_id: _Optional[int] = ..., seq_ids: _Optional[_Iterable[str]] = ..., state: _Optional[_Union[SequenceState, str]] = ...) -> None: ...

class SetStatesReply(_message.Message):
    __slots__ = ("previous",)
    PREVIOUS_FIELD_NUMBER: _ClassVar[int]
    previous: _containers.RepeatedScalarFieldContainer[SequenceState]
    def __init__(self, previous: _Optional[_Iterable[_Union[SequenceState, str]]] = ...) -> None: ...

class SetAuxStateRequest(_message.Message):
    __slots__ = ("session", "namespace_id", "seq_id", "data")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    session: str
    namespace_id: int
    seq_id: str
    data: bytes
    def __init__(self, session: _Optional[str] = ..., namespace_id: _Optional[int] = ..., seq_id: _Optional[str] = ..., data: _Optional[bytes] = ...) -> None: ...

class SetAuxStateReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetAuxStateRequest(_message.Message):
    __slots__ = ("session", "namespace_id", "seq_id")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    session: str
    namespace_id: int
    seq_id: str
    def __init__(self, session: _Optional[str] = ..., namespace_id: _Optional[int] = ..., seq_id: _Optional[str] = ...) -> None: ...

class GetAuxStateReply(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...

class DescribeSequencesRequest(_message.Message):
    __slots__ = ("session", "namespace_id", "seq_ids")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    session: str
    namespace_id: int
    seq_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, session: _Optional[str] = ..., namespace_id: _Optional[int] = ..., seq_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class SequenceStatus(_message.Message):
    __slots__ = ("seq_id", "state", "num_tokens", "known_tokens", "shared_pages", "private_pages", "shared_prefix_tokens", "aux_bytes")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KNOWN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SHARED_PAGES_FIELD_NUMBER: _ClassVar[int]
    PRIVATE_PAGES_FIELD_NUMBER: _ClassVar[int]
    SHARED_PREFIX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    AUX_BYTES_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    state: SequenceState
    num_tokens: int
    known_tokens: int
    shared_pages: int
    private_pages: int
    shared_prefix_tokens: int
    aux_bytes: int
    def __init__(self, seq_id: _Optional[str] = ..., state: _Optional[_Union[SequenceState, str]] = ..., num_tokens: _Optional[int] = ..., known_tokens: _Optional[int] = ..., shared_pages: _Optional[int] = ..., private_pages: _Optional[int] = ..., shared_prefix_tokens: _Optional[int] = ..., aux_bytes: _Optional[int] = ...) -> None: ...

class DescribeSequencesReply(_message.Message):
    __slots__ = ("sequences",)
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    sequences: _containers.RepeatedCompositeFieldContainer[SequenceStatus]
    def __init__(self, sequences: _Optional[_Iterable[_Union[SequenceStatus, _Mapping]]] = ...) -> None: ...

class PinRequest(_message.Message):
    __slots__ = ("session", "namespace_id", "tokens", "extra_keys", "ttl_seconds")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXTRA_KEYS_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    session: str
    namespace_id: int
    tokens: bytes
    extra_keys: _containers.RepeatedCompositeFieldContainer[ExtraKey]
    ttl_seconds: float
    def __init__(self, session: _Optional[str] = ..., namespace_id: _Optional[int] = ..., tokens: _Optional[bytes] = ..., extra_keys: _Optional[_Iterable[_Union[ExtraKey, _Mapping]]] = ..., ttl_seconds: _Optional[float] = ...) -> None: ...

class PinReply(_message.Message):
    __slots__ = ("pin_id", "pinned_pages", "pinned_tokens", "pending_tokens")
    PIN_ID_FIELD_NUMBER: _ClassVar[int]
    PINNED_PAGES_FIELD_NUMBER: _ClassVar[int]
    PINNED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PENDING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    pin_id: int
    pinned_pages: int
    pinned_tokens: int
    pending_tokens: int
    def __init__(self, pin_id: _Optional[int] = ..., pinned_pages: _Optional[int] = ..., pinned_tokens: _Optional[int] = ..., pending_tokens: _Optional[int] = ...) -> None: ...

class PrewarmRequest(_message.Message):
    __slots__ = ("session", "ticket", "namespace_id", "identity", "prompts")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    session: str
    ticket: str
    namespace_id: int
    identity: NamespaceIdentity
    prompts: _containers.RepeatedCompositeFieldContainer[SequenceRequest]
    def __init__(self, session: _Optional[str] = ..., ticket: _Optional[str] = ..., namespace_id: _Optional[int] = ..., identity: _Optional[_Union[NamespaceIdentity, _Mapping]] = ..., prompts: _Optional[_Iterable[_Union[SequenceRequest, _Mapping]]] = ...) -> None: ...

class PrewarmResult(_message.Message):
    __slots__ = ("seq_id", "requested_tokens", "resident_tokens", "pending_tokens", "over_budget_tokens", "not_found_tokens")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    REQUESTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PENDING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OVER_BUDGET_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NOT_FOUND_TOKENS_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    requested_tokens: int
    resident_tokens: int
    pending_tokens: int
    over_budget_tokens: int
    not_found_tokens: int
    def __init__(self, seq_id: _Optional[str] = ..., requested_tokens: _Optional[int] = ..., resident_tokens: _Optional[int] = ..., pending_tokens: _Optional[int] = ..., over_budget_tokens: _Optional[int] = ..., not_found_tokens: _Optional[int] = ...) -> None: ...

class PrewarmReply(_message.Message):
    __slots__ = ("results", "partial")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[PrewarmResult]
    partial: bool
    def __init__(self, results: _Optional[_Iterable[_Union[PrewarmResult, _Mapping]]] = ..., partial: _Optional[bool] = ...) -> None: ...

class PrewarmStats(_message.Message):
    __slots__ = ("prompts", "requested_tokens", "resident_tokens", "promoted_tokens", "not_found_tokens", "over_budget_tokens", "pending_tokens")
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    REQUESTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMOTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NOT_FOUND_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OVER_BUDGET_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PENDING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompts: int
    requested_tokens: int
    resident_tokens: int
    promoted_tokens: int
    not_found_tokens: int
    over_budget_tokens: int
    pending_tokens: int
    def __init__(self, prompts: _Optional[int] = ..., requested_tokens: _Optional[int] = ..., resident_tokens: _Optional[int] = ..., promoted_tokens: _Optional[int] = ..., not_found_tokens: _Optional[int] = ..., over_budget_tokens: _Optional[int] = ..., pending_tokens: _Optional[int] = ...) -> None: ...

class UnpinRequest(_message.Message):
    __slots__ = ("session", "pin_id")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    PIN_ID_FIELD_NUMBER: _ClassVar[int]
    session: str
    pin_id: int
    def __init__(self, session: _Optional[str] = ..., pin_id: _Optional[int] = ...) -> None: ...

class UnpinReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ("session", "ticket")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    session: str
    ticket: str
    def __init__(self, session: _Optional[str] = ..., ticket: _Optional[str] = ...) -> None: ...

class PageStats(_message.Message):
    __slots__ = ("logical_pages", "physical_pages", "shared_pages", "private_pages", "cached_pages", "pinned_pages", "free_pages", "host_pages_saved", "host_bytes_saved", "refcount_increments", "refcount_decrements", "lookup_tokens", "hit_tokens", "evicted_pages", "sequences", "sessions", "corrupted_pages")
    LOGICAL_PAGES_FIELD_NUMBER: _ClassVar[int]
    PHYSICAL_PAGES_FIELD_NUMBER: _ClassVar[int]
    SHARED_PAGES_FIELD_NUMBER: _ClassVar[int]
    PRIVATE_PAGES_FIELD_NUMBER: _ClassVar[int]
    CACHED_PAGES_FIELD_NUMBER: _ClassVar[int]
    PINNED_PAGES_FIELD_NUMBER: _ClassVar[int]
    FREE_PAGES_FIELD_NUMBER: _ClassVar[int]
    HOST_PAGES_SAVED_FIELD_NUMBER: _ClassVar[int]
    HOST_BYTES_SAVED_FIELD_NUMBER: _ClassVar[int]
    REFCOUNT_INCREMENTS_FIELD_NUMBER: _ClassVar[int]
    REFCOUNT_DECREMENTS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EVICTED_PAGES_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    CORRUPTED_PAGES_FIELD_NUMBER: _ClassVar[int]
    logical_pages: int
    physical_pages: int
    shared_pages: int
    private_pages: int
    cached_pages: int
    pinned_pages: int
    free_pages: int
    host_pages_saved: int
    host_bytes_saved: int
    refcount_increments: int
    refcount_decrements: int
    lookup_tokens: int
    hit_tokens: int
    evicted_pages: int
    sequences: int
    sessions: int
    corrupted_pages: int
    def __init__(self, logical_pages: _Optional[int] = ..., physical_pages: _Optional[int] = ..., shared_pages: _Optional[int] = ..., private_pages: _Optional[int] = ..., cached_pages: _Optional[int] = ..., pinned_pages: _Optional[int] = ..., free_pages: _Optional[int] = ..., host_pages_saved: _Optional[int] = ..., host_bytes_saved: _Optional[int] = ..., refcount_increments: _Optional[int] = ..., refcount_decrements: _Optional[int] = ..., lookup_tokens: _Optional[int] = ..., hit_tokens: _Optional[int] = ..., evicted_pages: _Optional[int] = ..., sequences: _Optional[int] = ..., sessions: _Optional[int] = ..., corrupted_pages: _Optional[int] = ...) -> None: ...

class NamespaceStats(_message.Message):
    __slots__ = ("namespace_id", "model", "page_bytes", "pages", "tenant")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    namespace_id: int
    model: str
    page_bytes: int
    pages: PageStats
    tenant: str
    def __init__(self, namespace_id: _Optional[int] = ..., model: _Optional[str] = ..., page_bytes: _Optional[int] = ..., pages: _Optional[_Union[PageStats, _Mapping]] = ..., tenant: _Optional[str] = ...) -> None: ...

class RecoveryStats(_message.Message):
    __slots__ = ("recovered_pages", "resealed_pages", "corrupted_pages", "orphaned_pages", "mismatch_pages", "incomplete_pages", "incomplete_extents", "discarded", "seconds", "pending_pages", "evicted_pages")
    RECOVERED_PAGES_FIELD_NUMBER: _ClassVar[int]
    RESEALED_PAGES_FIELD_NUMBER: _ClassVar[int]
    CORRUPTED_PAGES_FIELD_NUMBER: _ClassVar[int]
    ORPHANED_PAGES_FIELD_NUMBER: _ClassVar[int]
    MISMATCH_PAGES_FIELD_NUMBER: _ClassVar[int]
    INCOMPLETE_PAGES_FIELD_NUMBER: _ClassVar[int]
    INCOMPLETE_EXTENTS_FIELD_NUMBER: _ClassVar[int]
    DISCARDED_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    PENDING_PAGES_FIELD_NUMBER: _ClassVar[int]
    EVICTED_PAGES_FIELD_NUMBER: _ClassVar[int]
    recovered_pages: int
    resealed_pages: int
    corrupted_pages: int
    orphaned_pages: int
    mismatch_pages: int
    incomplete_pages: int
    incomplete_extents: int
    discarded: str
    seconds: float
    pending_pages: int
    evicted_pages: int
    def __init__(self, recovered_pages: _Optional[int] = ..., resealed_pages: _Optional[int] = ..., corrupted_pages: _Optional[int] = ..., orphaned_pages: _Optional[int] = ..., mismatch_pages: _Optional[int] = ..., incomplete_pages: _Optional[int] = ..., incomplete_extents: _Optional[int] = ..., discarded: _Optional[str] = ..., seconds: _Optional[float] = ..., pending_pages: _Optional[int] = ..., evicted_pages: _Optional[int] = ...) -> None: ...

class RemoteStats(_message.Message):
    __slots__ = ("state", "stored_pages", "fetched_pages", "hit_tokens", "refused_pages", "skipped_pages", "rejected_pages", "errors", "outages", "reoffered_pages", "resets")
    STATE_FIELD_NUMBER: _ClassVar[int]
    STORED_PAGES_FIELD_NUMBER: _ClassVar[int]
    FETCHED_PAGES_FIELD_NUMBER: _ClassVar[int]
    HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REFUSED_PAGES_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_PAGES_FIELD_NUMBER: _ClassVar[int]
    REJECTED_PAGES_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    OUTAGES_FIELD_NUMBER: _ClassVar[int]
    REOFFERED_PAGES_FIELD_NUMBER: _ClassVar[int]
    RESETS_FIELD_NUMBER: _ClassVar[int]
    state: str
    stored_pages: int
    fetched_pages: int
    hit_tokens: int
    refused_pages: int
    skipped_pages: int
    rejected_pages: int
    errors: int
    outages: int
    reoffered_pages: int
    resets: int
    def __init__(self, state: _Optional[str] = ..., stored_pages: _Optional[int] = ..., fetched_pages: _Optional[int] = ..., hit_tokens: _Optional[int] = ..., refused_pages: _Optional[int] = ..., skipped_pages: _Optional[int] = ..., rejected_pages: _Optional[int] = ..., errors: _Optional[int] = ..., outages: _Optional[int] = ..., reoffered_pages: _Optional[int] = ..., resets: _Optional[int] = ...) -> None: ...

class DiskStats(_message.Message):
    __slots__ = ("state", "pages", "bytes", "capacity_bytes", "written_pages", "fetched_pages", "hit_tokens", "skipped_pages", "refused_pages", "evicted_pages", "rejected_pages", "errors", "backlog_bytes", "recovered_pages", "direct_io", "written_bytes", "read_bytes", "promotion_buckets", "promotion_seconds", "pending_pages")
    STATE_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_PAGES_FIELD_NUMBER: _ClassVar[int]
    FETCHED_PAGES_FIELD_NUMBER: _ClassVar[int]
    HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_PAGES_FIELD_NUMBER: _ClassVar[int]
    REFUSED_PAGES_FIELD_NUMBER: _ClassVar[int]
    EVICTED_PAGES_FIELD_NUMBER: _ClassVar[int]
    REJECTED_PAGES_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    BACKLOG_BYTES_FIELD_NUMBER: _ClassVar[int]
    RECOVERED_PAGES_FIELD_NUMBER: _ClassVar[int]
    DIRECT_IO_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_BYTES_FIELD_NUMBER: _ClassVar[int]
    READ_BYTES_FIELD_NUMBER: _ClassVar[int]
    PROMOTION_BUCKETS_FIELD_NUMBER: _ClassVar[int]
    PROMOTION_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PENDING_PAGES_FIELD_NUMBER: _ClassVar[int]
    state: str
    pages: int
    bytes: int
    capacity_bytes: int
    written_pages: int
    fetched_pages: int
    hit_tokens: int
    skipped_pages: int
    refused_pages: int
    evicted_pages: int
    rejected_pages: int
    errors: int
    backlog_bytes: int
    recovered_pages: int
    direct_io: bool
    written_bytes: int
    read_bytes: int
    promotion_buckets: _containers.RepeatedScalarFieldContainer[int]
    promotion_seconds: float
    pending_pages: int
    def __init__(self, state: _Optional[str] = ..., pages: _Optional[int] = ..., bytes: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., written_pages: _Optional[int] = ..., fetched_pages: _Optional[int] = ..., hit_tokens: _Optional[int] = ..., skipped_pages: _Optional[int] = ..., refused_pages: _Optional[int] = ..., evicted_pages: _Optional[int] = ..., rejected_pages: _Optional[int] = ..., errors: _Optional[int] = ..., backlog_bytes: _Optional[int] = ..., recovered_pages: _Optional[int] = ..., direct_io: _Optional[bool] = ..., written_bytes: _Optional[int] = ..., read_bytes: _Optional[int] = ..., promotion_buckets: _Optional[_Iterable[int]] = ..., promotion_seconds: _Optional[float] = ..., pending_pages: _Optional[int] = ...) -> None: ...

class StatsReply(_message.Message):
    __slots__ = ("totals", "host_bytes", "arena_bytes", "prefix_reuse", "namespaces", "shm_refusals", "recovery", "host_bytes_used", "host_bytes_free", "aux_bytes", "aux_bytes_used", "aux_bytes_per_sequence", "remote", "disk", "prewarm")
    TOTALS_FIELD_NUMBER: _ClassVar[int]
    HOST_BYTES_FIELD_NUMBER: _ClassVar[int]
    ARENA_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_REUSE_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    SHM_REFUSALS_FIELD_NUMBER: _ClassVar[int]
    RECOVERY_FIELD_NUMBER: _ClassVar[int]
    HOST_BYTES_USED_FIELD_NUMBER: _ClassVar[int]
    HOST_BYTES_FREE_FIELD_NUMBER: _ClassVar[int]
    AUX_BYTES_FIELD_NUMBER: _ClassVar[int]
    AUX_BYTES_USED_FIELD_NUMBER: _ClassVar[int]
    AUX_BYTES_PER_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    REMOTE_FIELD_NUMBER: _ClassVar[int]
    DISK_FIELD_NUMBER: _ClassVar[int]
    PREWARM_FIELD_NUMBER: _ClassVar[int]
    totals: PageStats
    host_bytes: int
    arena_bytes: int
    prefix_reuse: bool
    namespaces: _containers.RepeatedCompositeFieldContainer[NamespaceStats]
    shm_refusals: int
    recovery: RecoveryStats
    host_bytes_used: int
    host_bytes_free: int
    aux_bytes: int
    aux_bytes_used: int
    aux_bytes_per_sequence: int
    remote: RemoteStats
    disk: DiskStats
    prewarm: PrewarmStats
    def __init__(self, totals: _Optional[_Union[PageStats, _Mapping]] = ..., host_bytes: _Optional[int] = ..., arena_bytes: _Optional[int] = ..., prefix_reuse: _Optional[bool] = ..., namespaces: _Optional[_Iterable[_Union[NamespaceStats, _Mapping]]] = ..., shm_refusals: _Optional[int] = ..., recovery: _Optional[_Union[RecoveryStats, _Mapping]] = ..., host_bytes_used: _Optional[int] = ..., host_bytes_free: _Optional[int] = ..., aux_bytes: _Optional[int] = ..., aux_bytes_used: _Optional[int] = ..., aux_bytes_per_sequence: _Optional[int] = ..., remote: _Optional[_Union[RemoteStats, _Mapping]] = ..., disk: _Optional[_Union[DiskStats, _Mapping]] = ..., prewarm: _Optional[_Union[PrewarmStats, _Mapping]] = ...) -> None: ...

class CheckInvariantsRequest(_message.Message):
    __slots__ = ("session", "ticket")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    session: str
    ticket: str
    def __init__(self, session: _Optional[str] = ..., ticket: _Optional[str] = ...) -> None: ...

class CheckInvariantsReply(_message.Message):
    __slots__ = ("violations",)
    VIOLATIONS_FIELD_NUMBER: _ClassVar[int]
    violations: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, violations: _Optional[_Iterable[str]] = ...) -> None: ...

class VerifyPagesRequest(_message.Message):
    __slots__ = ("ticket",)
    TICKET_FIELD_NUMBER: _ClassVar[int]
    ticket: str
    def __init__(self, ticket: _Optional[str] = ...) -> None: ...

class VerifyPagesReply(_message.Message):
    __slots__ = ("checked_pages", "checked_bytes", "corrupted_pages", "seconds", "recovery")
    CHECKED_PAGES_FIELD_NUMBER: _ClassVar[int]
    CHECKED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CORRUPTED_PAGES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    RECOVERY_FIELD_NUMBER: _ClassVar[int]
    checked_pages: int
    checked_bytes: int
    corrupted_pages: int
    seconds: float
    recovery: RecoveryStats
    def __init__(self, checked_pages: _Optional[int] = ..., checked_bytes: _Optional[int] = ..., corrupted_pages: _Optional[int] = ..., seconds: _Optional[float] = ..., recovery: _Optional[_Union[RecoveryStats, _Mapping]] = ...) -> None: ...

class ResetPrefixCacheRequest(_message.Message):
    __slots__ = ("session", "ticket", "has_namespace", "namespace_id")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    HAS_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    session: str
    ticket: str
    has_namespace: bool
    namespace_id: int
    def __init__(self, session: _Optional[str] = ..., ticket: _Optional[str] = ..., has_namespace: _Optional[bool] = ..., namespace_id: _Optional[int] = ...) -> None: ...

class ResetPrefixCacheReply(_message.Message):
    __slots__ = ("dropped_pages", "kept_pages")
    DROPPED_PAGES_FIELD_NUMBER: _ClassVar[int]
    KEPT_PAGES_FIELD_NUMBER: _ClassVar[int]
    dropped_pages: int
    kept_pages: int
    def __init__(self, dropped_pages: _Optional[int] = ..., kept_pages: _Optional[int] = ...) -> None: ...

class PingRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PingReply(_message.Message):
    __slots__ = ("version", "lock_memory", "unlocked_bytes")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LOCK_MEMORY_FIELD_NUMBER: _ClassVar[int]
    UNLOCKED_BYTES_FIELD_NUMBER: _ClassVar[int]
    version: str
    lock_memory: bool
    unlocked_bytes: int
    def __init__(self, version: _Optional[str] = ..., lock_memory: _Optional[bool] = ..., unlocked_bytes: _Optional[int] = ...) -> None: ...

class SubscribeEventsRequest(_message.Message):
    __slots__ = ("session", "has_from_seq", "from_seq", "removals_only")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    HAS_FROM_SEQ_FIELD_NUMBER: _ClassVar[int]
    FROM_SEQ_FIELD_NUMBER: _ClassVar[int]
    REMOVALS_ONLY_FIELD_NUMBER: _ClassVar[int]
    session: str
    has_from_seq: bool
    from_seq: int
    removals_only: bool
    def __init__(self, session: _Optional[str] = ..., has_from_seq: _Optional[bool] = ..., from_seq: _Optional[int] = ..., removals_only: _Optional[bool] = ...) -> None: ...

class BlockStored(_message.Message):
    __slots__ = ("namespace_id", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_name", "medium")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PARENT_BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    namespace_id: int
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    parent_block_hash: bytes
    token_ids: bytes
    block_size: int
    lora_name: str
    medium: str
    def __init__(self, namespace_id: _Optional[int] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., parent_block_hash: _Optional[bytes] = ..., token_ids: _Optional[bytes] = ..., block_size: _Optional[int] = ..., lora_name: _Optional[str] = ..., medium: _Optional[str] = ...) -> None: ...

class BlockRemoved(_message.Message):
    __slots__ = ("namespace_id", "block_hashes", "medium")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    namespace_id: int
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    medium: str
    def __init__(self, namespace_id: _Optional[int] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., medium: _Optional[str] = ...) -> None: ...

class AllBlocksCleared(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KVEvent(_message.Message):
    __slots__ = ("stored", "removed", "cleared")
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    stored: BlockStored
    removed: BlockRemoved
    cleared: AllBlocksCleared
    def __init__(self, stored: _Optional[_Union[BlockStored, _Mapping]] = ..., removed: _Optional[_Union[BlockRemoved, _Mapping]] = ..., cleared: _Optional[_Union[AllBlocksCleared, _Mapping]] = ...) -> None: ...

class KVEventBatch(_message.Message):
    __slots__ = ("seq", "ts", "events")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TS_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    seq: int
    ts: float
    events: _containers.RepeatedCompositeFieldContainer[KVEvent]
    def __init__(self, seq: _Optional[int] = ..., ts: _Optional[float] = ..., events: _Optional[_Iterable[_Union[KVEvent, _Mapping]]] = ...) -> None: ...
