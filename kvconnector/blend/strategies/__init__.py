"""Blend's selection strategies: which loaded tokens a blend recomputes (docs/blend.md).

    base.py        the interface (``Strategy``), what it sees at a check layer, the registry
    attention.py   the loaded tokens the prompt's last queries attend to most (the default)
    cacheblend.py  the loaded tokens whose K/V deviates most from the fresh
    epic.py        the first tokens of every loaded document

A new strategy is a file: a ``Strategy`` subclass decorated with ``@register``, imported
below.
"""

from kvconnector.blend.strategies import attention, cacheblend, epic  # noqa: F401 (register)
from kvconnector.blend.strategies.base import STRATEGIES, Check, Strategy, register

__all__ = ["STRATEGIES", "Check", "Strategy", "register"]
