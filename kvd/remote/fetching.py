"""The remote store as a fetch's source (``Fetches``, kvd/tiers/fetches.py, runs the fetch).

``find`` hands the link's worker one job (kvd/remote/jobs.py) that hashes the missing pages'
chain keys and asks the store which it holds in one batched existence query; ``get`` reads
the values into the new local pages and checks each header's checksum. A page that did not
arrive (the host holding it died, or it went meanwhile) is ``Arrival.FAILED``, asked for
again by a later lookup; a key whose value arrived and failed a check is never fetched again.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from kvd.core.index import ChainSpec
from kvd.core.namespaces import Namespace
from kvd.remote.jobs import TierJobs, find, get
from kvd.remote.mooncake_store import GetOutcome
from kvd.tiers.fetches import Arrival, Done, Found

MAX_REJECTED_KEYS = 4096  # store keys whose value failed its checks, never fetched again


class RemoteSource:
    """One tier's door to the store for fetches, and the keys it no longer fetches."""

    name = "the remote store"
    recheck_after_landing = True  # whether the store holds a prompt's next page costs a round trip

    def __init__(self, jobs: TierJobs) -> None:
        self.jobs = jobs
        # Store keys whose value failed its checks: a fetch stops before them (read by the worker).
        self._rejected: OrderedDict[str, None] = OrderedDict()

    @property
    def up(self) -> bool:
        return self.jobs.up

    def find(self, ns: Namespace, chain: ChainSpec, tokens: bytes, parent_key: bytes, pages: range, done: Done) -> None:
        scope, rejected = self.jobs.scope, self._rejected
        self.jobs.run(lambda store: find(store, scope, ns, chain, tokens, parent_key, pages, rejected), done)

    def get(self, ns: Namespace, found: Found, views: list[np.ndarray], done: Done) -> None:
        staging = self.jobs.staging_for(ns.page_size)
        self.jobs.run(
            lambda store: get(store, found, views, staging),
            lambda got, error: done(None if got is None else [_arrival(g) for g in got], error),
        )

    def reject(self, key: str) -> None:
        self._rejected[key] = None
        if len(self._rejected) > MAX_REJECTED_KEYS:
            self._rejected.popitem(last=False)


def _arrival(got):
    return Arrival.FAILED if got is GetOutcome.FAILED else got
