"""Typed errors of the daemon core. kvd/server/service.py maps each class to one gRPC status.

Bad client input raises one of these before any state changes. Running out of host
memory is an expected outcome and also has its class here, so a batch that does not fit
unwinds the same way as bad input. A broken invariant is never one of these: it is an
AssertionError that names the culprit.
"""

from __future__ import annotations


class KVDError(Exception):
    """Base class of every error a client can cause."""


class InvalidArgument(KVDError):
    """The request is malformed: wrong lengths, out-of-range ids, oversize batches."""


class NotFound(KVDError):
    """An unknown namespace, sequence, page, pin or session."""


class PermissionDenied(KVDError):
    """The object exists but belongs to another session."""


class FailedPrecondition(KVDError):
    """A well-formed request that the current state forbids (an invalid transition)."""


class ResourceExhausted(KVDError):
    """The host budget cannot hold the batch even after eviction; nothing was changed."""
