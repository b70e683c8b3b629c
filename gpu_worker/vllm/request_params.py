"""`KvdParams`: what one vLLM request asks of kvd, read from its `kv_transfer_params`.

vLLM hands connectors each request's `kv_transfer_params` (`Request.kv_transfer_params`:
the OpenAI server's `kv_transfer_params` field, `extra_body={"kv_transfer_params": ...}` in
the OpenAI client; `SamplingParams(extra_args={"kv_transfer_params": ...})` with `LLM`).
kvd reads its own entry, "kvd", a dict:

- `"store": false`: nothing of the request is saved to kvd (its lookups still hit);
- `"keep_seconds": N`: once the request is done, its prompt's pages in kvd are kept from
  eviction for N seconds, within a share of the tenant's budget (gpu_worker/vllm/keeps.py).

Other entries of `kv_transfer_params` belong to other connectors and are left alone. An
unknown key in "kvd", a value of the wrong type or range, or a "kvd" that is no dict is a
warning in the engine's log that names the request and what was wrong, and is ignored: the
request is served as if it had not been given (the entries that were right still apply).
The scheduler half reads a request's once, when vLLM adds it (gpu_worker/vllm/scheduler.py).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

log = logging.getLogger(__name__)

ENTRY = "kvd"  # kvd's entry in kv_transfer_params


@dataclass(frozen=True)
class KvdParams:
    """A request's say: `store` (False: nothing of it is saved), `keep_seconds` (0: no keep),
    and `ignored`, what of its "kvd" entry was wrong (as the warning said), for the counts."""

    store: bool = True
    keep_seconds: float = 0.0
    ignored: tuple[str, ...] = ()

    @classmethod
    def of(cls, request) -> KvdParams:
        """The request's say; each wrong part logged once (a warning) and left out."""
        params = getattr(request, "kv_transfer_params", None)
        if not isinstance(params, dict) or ENTRY not in params:
            return DEFAULT
        given = params[ENTRY]
        if not isinstance(given, dict):
            return cls._warned(request, [f'"kvd" must be a dict such as {{"store": false}}, got {given!r}'])
        store, keep, wrong = True, 0.0, []
        for key, value in given.items():
            if key == "store":
                if isinstance(value, bool):
                    store = value
                else:
                    wrong.append(f'"store" must be true or false, got {value!r}')
            elif key == "keep_seconds":
                number = isinstance(value, int | float) and not isinstance(value, bool)
                if number and math.isfinite(value) and value >= 0:
                    keep = float(value)
                else:
                    wrong.append(f'"keep_seconds" must be a finite number of seconds >= 0, got {value!r}')
            else:
                wrong.append(f'unknown key {key!r} (kvd reads "store" and "keep_seconds")')
        return cls._warned(request, wrong, store, keep)

    @classmethod
    def _warned(cls, request, wrong: list[str], store: bool = True, keep: float = 0.0) -> KvdParams:
        for why in wrong:
            log.warning(
                'kvd: request %s: kv_transfer_params["kvd"]: %s; ignored, the request is served as usual',
                request.request_id,
                why,
            )
        return cls(store, keep, tuple(wrong))


DEFAULT = KvdParams()
