"""What clients ask of the cache and what they get back, and the checks every request passes.

The manager validates a whole request with these functions before it changes anything,
so bad input raises ``InvalidArgument`` and loses nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Generic, TypeVar

import numpy as np

from kvd.cache.sequences import Sequence
from kvd.config import AUX_BYTES_PER_SEQUENCE
from kvd.core.errors import FailedPrecondition, InvalidArgument
from kvd.core.index import ChainSpec, ExtraKey, ExtraKind, chain_spec
from kvd.core.namespaces import Namespace
from kvd.core.types import PageId, PinId, SeqId, SequenceState
from kvd.wire.codec import TOKEN_BYTES, token_array, unpack_tokens

_SMALL_TOKEN_BYTES = 1024

# A call done in steps (a publish, an allocation's room, a wide lookup) holds the event loop
# about this long at a time; the servicer lets other calls run between two steps.
STEP_SECONDS = 0.0002

# Fields and repeated elements one request may hold on the wire, counted before it is
# parsed (kvd/server/shape.py): parsing costs per element, so this bounds what a refused request
# costs. The largest batches the limits below allow hold under 32K (4,096 sequences with
# their extra keys; a 4,096-sequence extend).
MAX_REQUEST_FIELDS = 1 << 16


@dataclass(frozen=True)
class Limits:
    """Bounds on one request, so one client cannot monopolise the daemon. Each is far
    beyond what a real engine sends (a batch of 64 prompts of 128K tokens is 8M tokens), and
    together they bound the work of any one call. Counts and sizes are checked before any
    object is built from the request (``check_call``)."""

    max_batch_sequences: int = 4096
    max_tokens_per_sequence: int = 1 << 22
    max_call_tokens: int = 1 << 23
    max_seq_id_chars: int = 256
    max_extra_keys: int = 4096
    max_call_extra_keys: int = 1 << 14
    max_extra_key_bytes: int = 1024
    max_call_extra_key_bytes: int = 4 << 20
    max_aux_bytes: int = AUX_BYTES_PER_SEQUENCE  # one sequence's aux state (setting aux_bytes_per_sequence)


# A large call makes thousands of these (and of PreparedRequest, ExtraKey, ChainSpec) on the
# offload thread (kvd/server/offload.py): with slots they leave the garbage collections that the
# allocations trigger, which hold the GIL, less to walk (1.7x less collection time).
@dataclass(frozen=True, slots=True)
class SequenceRequest:
    seq_id: str
    tokens: bytes
    extra_keys: tuple[ExtraKey, ...] = ()


@dataclass(frozen=True)
class SequencePlan:
    """Where one sequence's KV lives: prefill computes tokens [suffix_start, num_tokens)."""

    seq_id: SeqId
    shared_pages: list[PageId]
    private_pages: list[PageId]
    shared_prefix_tokens: int
    suffix_start: int
    num_tokens: int

    @property
    def pages(self) -> list[PageId]:
        return self.shared_pages + self.private_pages


@dataclass(frozen=True, slots=True)  # slots: see SequenceRequest
class LookupResult:
    seq_id: str
    hit_pages: list[PageId]
    hit_tokens: int
    remote_pending_tokens: int = 0  # tokens past the hit a fetch from the remote store may still bring


@dataclass(frozen=True)
class Rebind:
    """Publishing found an identical page: ``old_page`` was freed, ``new_page`` replaces it."""

    position: int
    old_page: PageId
    new_page: PageId


@dataclass(frozen=True)
class PublishResult:
    seq_id: SeqId
    published_pages: int
    rebinds: list[Rebind]


@dataclass(frozen=True)
class ResetResult:
    dropped_pages: int  # cached pages dropped from the index and freed
    kept_pages: int  # published pages a sequence or pin still references: untouched

    def __add__(self, other: ResetResult) -> ResetResult:
        return ResetResult(self.dropped_pages + other.dropped_pages, self.kept_pages + other.kept_pages)


@dataclass  # not frozen: a decode step makes one per sequence, and a frozen one takes 3x as long to build
class ExtendResult:
    seq_id: SeqId
    new_pages: list[PageId]
    num_tokens: int


T = TypeVar("T")


@dataclass(frozen=True)
class WithEvictions(Generic[T]):
    """The result of a call that may make room (allocate, extend, fork), and the caller's
    own ON_HOLD sequences it evicted for that room, now EVICTED: the reply names them, so
    the caller knows before its next call. Other owners hear of theirs on their session
    streams (``Session.listener``)."""

    result: T
    evicted: list[SeqId]


@dataclass(frozen=True)
class SequenceStatus:
    """One sequence as the daemon holds it now (``KVCacheManager.describe``)."""

    seq_id: SeqId
    state: SequenceState
    num_tokens: int  # tokens it has room for (0 once EVICTED)
    known_tokens: int  # of those, tokens whose ids were given (their pages can be published)
    shared_pages: int  # published pages at the head of its page table
    private_pages: int  # its own writable pages after them
    shared_prefix_tokens: int  # tokens its allocation found cached
    aux_bytes: int  # size of its non-KV state

    @classmethod
    def of(cls, seq: Sequence) -> SequenceStatus:
        return cls(
            seq.seq_id,
            seq.state,
            seq.num_tokens,
            seq.known_tokens,
            len(seq.shared_pages),
            len(seq.private_pages),
            seq.shared_prefix_tokens,
            len(seq.aux),
        )


@dataclass(frozen=True)
class PinResult:
    pin_id: PinId
    pages: list[PageId]
    tokens: int


@dataclass(frozen=True, slots=True)  # slots: see SequenceRequest
class PreparedRequest:
    """A validated request with its chain spec (matching it gives an ``index.Match``)."""

    request: SequenceRequest
    tokens: bytes
    num_tokens: int
    chain: ChainSpec


def check_call(limits: Limits, sequences, tokens: int | None = None) -> None:
    """Sizes of a whole Allocate or Lookup call, read from the proto messages or
    SequenceRequests (anything with ``tokens`` and ``extra_keys``) before anything is built
    from them: token ids, extra keys and their bytes, in that order, so a refusal
    costs at most one pass over the keys the limit allows. ``tokens``: the call's token
    ids when some lie in a token buffer (counted from their spans, before any is copied)."""
    if tokens is None:
        tokens = sum(len(s.tokens) for s in sequences) // TOKEN_BYTES
    if tokens > limits.max_call_tokens:
        raise InvalidArgument(
            f"one call holds {tokens} tokens, over the limit of {limits.max_call_tokens}; split the batch"
        )
    keys = sum(len(s.extra_keys) for s in sequences)
    if keys > limits.max_call_extra_keys:
        raise InvalidArgument(
            f"one call holds {keys} extra keys, over the limit of {limits.max_call_extra_keys}; split the batch"
        )
    key_bytes = sum(len(k.value) for s in sequences for k in s.extra_keys)
    if key_bytes > limits.max_call_extra_key_bytes:
        raise InvalidArgument(
            f"the extra keys of one call hold {key_bytes} bytes, over the limit of {limits.max_call_extra_key_bytes}"
        )


def check_batch(limits: Limits, seq_ids: list[str], unique: bool = True) -> None:
    """Batch size, sequence ids, and (for batches that create or change sequences) no id twice."""
    if len(seq_ids) > limits.max_batch_sequences:
        raise InvalidArgument(f"batch of {len(seq_ids)} sequences is over the limit of {limits.max_batch_sequences}")
    for s in seq_ids:
        check_seq_id(limits, s)
    if unique and len(set(seq_ids)) != len(seq_ids):
        dup = next(s for s in seq_ids if seq_ids.count(s) > 1)
        raise InvalidArgument(f"sequence {dup!r} appears twice in one batch")


def check_seq_id(limits: Limits, seq_id: str) -> None:
    if not seq_id or len(seq_id) > limits.max_seq_id_chars:
        raise InvalidArgument(f"sequence id must have 1 to {limits.max_seq_id_chars} characters, got {seq_id!r:.300}")


def check_tokens(limits: Limits, ns: Namespace, tokens: bytes, what: str) -> bytes:
    """Packed int32 token ids within the namespace's vocabulary; returns them as bytes."""
    if len(tokens) % TOKEN_BYTES:
        raise InvalidArgument(
            f"{what}: token bytes length {len(tokens)} is not a multiple of {TOKEN_BYTES} "
            "(token ids are packed little-endian int32)"
        )
    if len(tokens) // TOKEN_BYTES > limits.max_tokens_per_sequence:
        raise InvalidArgument(
            f"{what}: {len(tokens) // TOKEN_BYTES} tokens is over the limit of {limits.max_tokens_per_sequence}"
        )
    if not _in_vocabulary(ns, tokens):
        vocab = ns.identity.vocab_size
        ids = token_array(tokens)
        bad = np.flatnonzero((ids < 0) | (ids >= vocab)) if vocab else np.flatnonzero(ids < 0)
        limit = f"[0, {vocab})" if vocab else "[0, 2^31)"
        raise InvalidArgument(f"{what}: token id {int(ids[bad[0]])} at position {int(bad[0])} is out of range {limit}")
    return bytes(tokens)


def check_token_lists(limits: Limits, ns: Namespace, given: list[tuple[str, bytes]]) -> None:
    """``check_tokens`` for the (seq_id, token ids) of several sequences, in one pass over all
    ids when they are fine (a decode step gives one id per sequence); errors name the sequence."""
    max_bytes = limits.max_tokens_per_sequence * TOKEN_BYTES
    if all(not len(t) % TOKEN_BYTES and len(t) <= max_bytes for _, t in given) and _in_vocabulary(
        ns, b"".join(t for _, t in given)
    ):
        return
    for seq_id, tokens in given:
        check_tokens(limits, ns, tokens, f"sequence {seq_id!r}")


def _in_vocabulary(ns: Namespace, tokens: bytes) -> bool:
    """Whether every packed id lies in [0, vocab_size) (in [0, 2^31) without a vocabulary)."""
    vocab = ns.identity.vocab_size
    if len(tokens) <= _SMALL_TOKEN_BYTES:  # a decode step's few ids: cheaper without numpy
        ids = unpack_tokens(tokens)
        return not ids or (min(ids) >= 0 and (not vocab or max(ids) < vocab))
    ids = token_array(tokens)
    return bool(ids.min() >= 0 and (not vocab or ids.max() < vocab))


def prepare(limits: Limits, ns: Namespace, r: SequenceRequest) -> PreparedRequest:
    """Validates one sequence request and builds its chain spec; raises InvalidArgument."""
    what = f"sequence {r.seq_id!r}"
    tokens = check_tokens(limits, ns, r.tokens, what)
    num_tokens = len(tokens) // TOKEN_BYTES
    if len(r.extra_keys) > limits.max_extra_keys:
        raise InvalidArgument(f"{what}: {len(r.extra_keys)} extra keys is over the limit of {limits.max_extra_keys}")
    for k in r.extra_keys:
        if k.kind not in ExtraKind.__members__.values():
            raise InvalidArgument(f"{what}: extra key kind {k.kind!r} is unknown (MULTIMODAL, LORA or CACHE_SALT)")
        if not k.value or len(k.value) > limits.max_extra_key_bytes:
            raise InvalidArgument(
                f"{what}: {ExtraKind(k.kind).name} extra key value must have 1 to "
                f"{limits.max_extra_key_bytes} bytes, got {len(k.value)}"
            )
        if k.kind == ExtraKind.MULTIMODAL and (k.length < 1 or k.offset + k.length > num_tokens):
            raise InvalidArgument(
                f"{what}: multimodal item at tokens [{k.offset}, {k.offset + k.length}) lies outside "
                f"the prompt of {num_tokens} tokens"
            )
    items = sorted((k.offset, k.offset + k.length) for k in r.extra_keys if k.kind == ExtraKind.MULTIMODAL)
    for (_, end), (start, next_end) in zip(items, items[1:]):
        if start < end:
            raise InvalidArgument(
                f"{what}: multimodal items at tokens [..., {end}) and [{start}, {next_end}) overlap; "
                "each placeholder token belongs to one item"
            )
    return PreparedRequest(r, tokens, num_tokens, chain_spec(ns.root, ns.page_size, list(r.extra_keys)))


@dataclass(frozen=True)
class Batch:
    """The sequences of one Allocate or Lookup call, checked as a whole (``check_batch``)
    and one by one (``prepare``) against the limits and one namespace; its caller checked
    the call's sizes (``check_call``) on what it had before building them.
    Making it reads nothing of the core but the namespace (an immutable value), so the
    servicer makes a large call's batch off the event loop (kvd/server/offload.py); the manager then
    matches, pins and allocates on the loop."""

    namespace: Namespace
    requests: list[PreparedRequest]

    @classmethod
    def of(cls, limits: Limits, ns: Namespace, requests: list[SequenceRequest], unique: bool) -> Batch:
        """Raises InvalidArgument for the first thing wrong; ``unique``: no sequence id twice
        (a batch that creates sequences)."""
        check_batch(limits, [r.seq_id for r in requests], unique)
        return cls(ns, [prepare(limits, ns, r) for r in requests])


def extend_items(
    seq_ids: list[str], num_tokens: list[int], token_id_counts: list[int], token_ids: bytes
) -> list[tuple[str, int, bytes | None]]:
    """The items of an extend request that arrives as columns, one entry per sequence:
    (seq_id, num_tokens, its token ids or None). ``token_ids`` holds the given ids one
    sequence after another, ``token_id_counts[i]`` of them for sequence i. Raises
    InvalidArgument when the columns disagree; each item is checked by the manager."""
    if not len(seq_ids) == len(num_tokens) == len(token_id_counts):
        raise InvalidArgument(
            f"extend request has {len(seq_ids)} seq_ids, {len(num_tokens)} num_tokens and "
            f"{len(token_id_counts)} token_id_counts; each column needs one entry per sequence"
        )
    if len(token_ids) % TOKEN_BYTES:
        raise InvalidArgument(
            f"extend request: token_ids has {len(token_ids)} bytes, not a multiple of {TOKEN_BYTES} "
            "(token ids are packed little-endian int32)"
        )
    ends = list(accumulate(token_id_counts))
    given = ends[-1] if ends else 0
    if given != len(token_ids) // TOKEN_BYTES:
        raise InvalidArgument(
            f"extend request: token_id_counts add up to {given} token ids "
            f"but token_ids holds {len(token_ids) // TOKEN_BYTES}"
        )
    tokens = [
        token_ids[(end - count) * TOKEN_BYTES : end * TOKEN_BYTES] if count else None
        for count, end in zip(token_id_counts, ends)
    ]
    return list(zip(seq_ids, num_tokens, tokens))


def check_extend(limits: Limits, seq: Sequence, num_tokens: int, tokens: bytes | None) -> int:
    """One item of an extend (already checked for vocabulary): the sequence may grow by
    ``num_tokens``, and ``tokens``, when given, are that many ids continuing known ones.
    Returns the sequence's new length."""
    if seq.state not in (SequenceState.PREFILLED, SequenceState.IN_DECODE):
        raise FailedPrecondition(
            f"sequence {seq.seq_id!r} is {seq.state.name}; only PREFILLED or IN_DECODE sequences grow"
        )
    if num_tokens <= 0:
        raise InvalidArgument(f"sequence {seq.seq_id!r}: extend needs a positive number of tokens, got {num_tokens}")
    total = seq.num_tokens + num_tokens
    if total > limits.max_tokens_per_sequence:
        raise InvalidArgument(
            f"sequence {seq.seq_id!r} would hold {total} tokens, over the limit of {limits.max_tokens_per_sequence}"
        )
    if tokens:
        if len(tokens) != num_tokens * TOKEN_BYTES:
            raise InvalidArgument(
                f"sequence {seq.seq_id!r}: {len(tokens) // TOKEN_BYTES} token ids given for {num_tokens} new tokens"
            )
        if seq.known_tokens != seq.num_tokens:
            raise FailedPrecondition(
                f"sequence {seq.seq_id!r}: token ids of positions {seq.known_tokens}..{seq.num_tokens - 1} "
                "were never given, so later ids cannot be recorded"
            )
    return total


def publish_pages(seq: Sequence, num_tokens: int, page_size: int) -> int:
    """How many leading full pages of ``seq`` a publish of ``num_tokens`` covers: 0 means
    every full page whose token ids are known; otherwise exactly whole pages of known ids."""
    if num_tokens == 0:
        return min(seq.num_tokens, seq.known_tokens) // page_size
    if num_tokens < 0 or num_tokens % page_size or num_tokens > seq.num_tokens:
        raise InvalidArgument(
            f"sequence {seq.seq_id!r}: cannot publish {num_tokens} tokens; only full pages are "
            f"published (a multiple of page_size {page_size}, at most its {seq.num_tokens} tokens)"
        )
    if num_tokens > seq.known_tokens:
        raise FailedPrecondition(
            f"sequence {seq.seq_id!r}: token ids after position {seq.known_tokens} are unknown; "
            "pass them to extend() to publish their pages"
        )
    return num_tokens // page_size
