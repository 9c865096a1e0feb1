"""kvconnector: keep vLLM's KV cache outside GPU memory and reuse shared prefixes."""

from kvconnector.config import ConfigError, ConnectorConfig

__all__ = ["ConfigError", "ConnectorConfig", "KVConnector"]


def __getattr__(name: str):
    # The connector pulls in vLLM; import it only when asked for.
    if name == "KVConnector":
        from kvconnector.connector import KVConnector

        return KVConnector
    raise AttributeError(name)
