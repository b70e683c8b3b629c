"""kvd/server/shape.py: the count of a request's fields, walked over the wire bytes before parsing,
against a plain reference walk (one call per varint, over a memoryview)."""

from __future__ import annotations

import random

import numpy as np
import pytest
from google.protobuf.message import DecodeError

from kvd.server import shape
from kvd.wire import kvd_pb2 as pb


def _reference_varint(view: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(view) or shift > 63:
            raise DecodeError("truncated or overlong varint")
        byte = view[pos]
        value |= (byte & 0x7F) << shift
        pos += 1
        if byte < 0x80:
            return value, pos
        shift += 7


def _reference(type_name: str, view: memoryview, budget: int) -> int:
    fields = shape._FIELDS[type_name]
    count = pos = 0
    while pos < len(view) and count <= budget:
        key, pos = _reference_varint(view, pos)
        wire = key & 7
        if wire == 0:
            _, pos = _reference_varint(view, pos)
        elif wire in (1, 5):
            pos += 8 if wire == 1 else 4
        elif wire == 2:
            size, pos = _reference_varint(view, pos)
            start, pos = pos, pos + size
            field = fields.get(key >> 3)
            if pos <= len(view) and field is not None:
                if field.packed:
                    count += size - 1
                elif field.nested is not None:
                    count += _reference(field.nested, view[start:pos], budget - count)
        else:
            raise DecodeError("wire type")
        if pos > len(view):
            raise DecodeError("past the end")
        count += 1
    return count


def _lookup(rng: random.Random) -> bytes:
    sequences = [
        pb.SequenceRequest(
            seq_id=f"s{i}" * rng.randrange(1, 80),
            tokens=np.arange(rng.randrange(0, 300), dtype="<i4").tobytes(),
            extra_keys=[pb.ExtraKey(kind=1, value=b"k" * rng.randrange(0, 200)) for _ in range(rng.randrange(0, 6))],
        )
        for i in range(rng.randrange(1, 300))
    ]
    return pb.LookupRequest(
        session="x" * 16, namespace_id=rng.randrange(1, 1 << 31), sequences=sequences
    ).SerializeToString()


@pytest.mark.parametrize("seed", range(20))
def test_the_count_is_the_reference_walks_and_bad_bytes_are_refused_alike(seed):
    rng = random.Random(seed)
    raw = _lookup(rng)
    for budget in (10, 100, 1000, 10_000):
        want = _reference("kvd.v1.LookupRequest", memoryview(raw), budget) > budget
        assert shape.exceeds("kvd.v1.LookupRequest", raw, budget) == want
    for cut in sorted(rng.sample(range(1, len(raw)), 20)):
        bad = raw[:cut] + bytes(rng.randrange(256) for _ in range(rng.randrange(0, 4)))
        try:
            want = _reference("kvd.v1.LookupRequest", memoryview(bad), 10) > 10
        except DecodeError:
            want = DecodeError
        if want is DecodeError:
            with pytest.raises(DecodeError):
                shape.exceeds("kvd.v1.LookupRequest", bad, 10)
        else:
            assert shape.exceeds("kvd.v1.LookupRequest", bad, 10) == want
