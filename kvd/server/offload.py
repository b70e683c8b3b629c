"""Offload: the work of a large request that needs nothing of the core, done on a thread of
its own so that the event loop keeps serving other sessions' calls meanwhile.

The core is read and changed only on the event loop (kvd/cache/manager.py), and while a call's
code runs there no other call is served. Much of a large call's work reads nothing of the
core, though: parsing its bytes (kvd/server/shape.py's count, then protobuf), checking its sizes,
converting it to core requests with their token ids read out of the token buffer,
checking those ids against the vocabulary and building chain specs (kvd/cache/requests.py
``Batch``), and building its reply. For the largest calls the limits allow (a Lookup of
4,096 sequences with 4 LoRA keys each: ~100 ms of that work on a 2-core box; one of 8M
ids in the token buffer: ~10 ms) that held the loop in pieces of 10–20 ms, and every
other session's call arriving meanwhile waited. Here it runs on one worker thread: Python
code hands the GIL back to the loop within the daemon's switch interval (0.2 ms,
kvd/server/daemon.py), and the token-buffer reads and numpy's vocabulary checks release it while
they run; what still holds it is protobuf's parse (~1 ms) and the garbage collections the
thread's allocations trigger (1–3 ms). Matching, pinning and allocating stay on the loop,
as every other call's work does.

A small request (a decode step, a batch of ordinary prompts) is handled inline: the hand-off
to the thread and back (~40 µs, more on a busy box) would cost it more than its work, and
every hand-off makes the loop wait for the GIL once more.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")

# A request of more bytes than this is parsed off the loop (kvd/server/messages.py ``Unparsed``):
# counting and parsing cost per field, ~2 ms per 64 KiB of sequences with extra keys. A
# decode step's extend (~1 KiB for 64 sequences) and ordinary prompts are far below.
LARGE_REQUEST_BYTES = 64 << 10
# An Allocate or Lookup of more sequences than this, or of more token ids (read from the
# token buffer and checked: ~0.25 ms per 256K ids), is checked and converted off the loop.
# A batch of 50K-token prompts stays inline up to five prompts.
LARGE_SEQUENCES = 64
LARGE_TOKEN_IDS = 1 << 18


def large_call(sequences) -> bool:
    """Whether an Allocate's or Lookup's sequences (proto) are worth the thread: more than
    ``LARGE_SEQUENCES``, more than ``LARGE_REQUEST_BYTES`` on the wire, or more than
    ``LARGE_TOKEN_IDS`` ids named in the token buffer. Reads the sizes of at most
    ``LARGE_SEQUENCES`` sequences (protobuf knows them without copying a field)."""
    if len(sequences) > LARGE_SEQUENCES:
        return True
    return (
        sum(s.ByteSize() for s in sequences) > LARGE_REQUEST_BYTES
        or sum(s.tokens_at.num_tokens for s in sequences) > LARGE_TOKEN_IDS
    )


class Offload:
    """The one worker thread (one: large calls queue behind each other, and the loop
    shares the GIL with one thread at a time). ``close`` at the daemon's stop."""

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvd-offload")

    async def run(self, work: Callable[[], T]) -> T:
        """``work()`` on the worker thread; its exception, if it raises, here."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, work)

    def close(self) -> None:
        """Waits for the work in progress (a call cut short by the stop: bounded by one
        request's work) and drops what was queued."""
        self._executor.shutdown(wait=True, cancel_futures=True)
