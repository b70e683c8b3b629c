"""The largest message either side of the socket sends or accepts.

gRPC's 4 MiB default is too small for a prefill batch; the bound still matters, because a
request is received and parsed whole before any check runs. The largest legitimate
request is a 64 MiB aux state (``MAX_AUX_STATE_BYTES``, the most ``aux_bytes_per_sequence``
may be set to) or a call of 8M token ids (32 MiB, kvd.cache.requests.Limits.max_call_tokens);
96 MiB holds either with room for the rest.
"""

MAX_MESSAGE_BYTES = 96 << 20
MAX_AUX_STATE_BYTES = 64 << 20
