"""kvd's vLLM v1 KV connector, apart from the reference engine in gpu_worker/.

``connector.py`` is the facade vLLM instantiates (``KVDConnector``; users' configs name it
by its old path, ``gpu_worker.vllm_connector``, which re-exports it); ``scheduler.py`` and
``worker.py`` are its two halves and ``plans.py`` what they exchange each step;
``kvd_link.py`` is the fail-open session both halves call kvd through, and
``kvd_events.py`` turns kvd's removals into vLLM KV events. Only these modules import
vLLM; nothing here is imported unless the connector is used.
"""
