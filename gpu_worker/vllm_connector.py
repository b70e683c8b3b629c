"""The import path of the vLLM connector that users' configurations name
(``"kv_connector_module_path": "gpu_worker.vllm_connector"``); the connector itself is
gpu_worker/vllm/connector.py.
"""

from gpu_worker.vllm.connector import KVDConnector

__all__ = ["KVDConnector"]
