"""``vllm.general_plugins`` entry point: makes ``"kv_connector": "kvconnector"`` work."""

from __future__ import annotations

SHORT_NAME = "kvconnector"


def register() -> None:
    # Runs in every vLLM process, possibly more than once; the factory raises on a repeat.
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from kvconnector import compat

    compat.install_model_hook()  # blend runs the model's layers (kvconnector/blend/)

    if SHORT_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(SHORT_NAME, "kvconnector.connector", "KVConnector")
