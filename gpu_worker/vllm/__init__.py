"""kvd's vLLM v1 KV connector, apart from the reference engine in gpu_worker/.

``connector.py`` is the facade vLLM instantiates (``KVDConnector``; users' configs name it
by its old path, ``gpu_worker.vllm_connector``, which re-exports it), and
``cache_shape.py`` reads from vLLM's configuration what its kvd pages hold. The scheduler
half is ``scheduler.py`` (load and save plans), ``lookahead.py`` (its kvd calls, on a
thread of their own), ``removal_feed.py`` (kvd's removals, heard on its event stream) and
``block_events.py`` (vLLM's KV events of the blocks kvd stores and removes);
``connector_stats.py`` is what it counts in vLLM's connector stats. The worker
half is ``worker.py`` (page copies), ``page_copies.py`` (the copies between kvd extents
and vLLM blocks) and ``save_ledger.py`` (the kvd sequences it saves into). ``plans.py``
is what the halves exchange each step; ``kvd_link.py`` the fail-open session both call
kvd through; ``support.py`` what the installed vLLM offers the connector (``kvd doctor
--vllm``). Only these modules import vLLM; nothing here is imported unless the connector
is used.
"""
