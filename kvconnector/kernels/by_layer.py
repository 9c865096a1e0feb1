"""A load whose layers land one at a time, on a helper thread, while the forward pass runs.

The forward pass reads a layer's KV only in that layer's attention, and vLLM calls the
connector's ``wait_for_layer_load`` just before it: a load copied in layer order on another
core costs the forward only what it waits there, the first layer's share when the helper
keeps ahead. The caller checks that every layer was waited for before it trusts the step
(``waited``); a layer read before it landed is a recompute, never an answer.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future


class LayerLoad:
    """Runs ``copy(landed)`` on ``executor``: it copies the load's layers in order and calls
    ``landed(i)`` once layer ``i`` is in place."""

    def __init__(self, executor: Executor, num_layers: int,
                 copy: Callable[[Callable[[int], None]], None]) -> None:
        self._landed = [threading.Event() for _ in range(num_layers)]
        self.waited = [False] * num_layers
        self.wait_seconds = 0.0  # the forward's, in ``wait``
        self.copy_seconds = 0.0  # the helper's
        self.error: BaseException | None = None
        self._done: Future[None] = executor.submit(self._run, copy)

    def _run(self, copy: Callable[[Callable[[int], None]], None]) -> None:
        start = time.perf_counter()
        try:
            copy(lambda i: self._landed[i].set())
        except BaseException as e:  # the load's error, reported by ``finish``
            self.error = e
        finally:
            self.copy_seconds = time.perf_counter() - start
            for landed in self._landed:  # nobody waits forever on a failed copy
                landed.set()

    def wait(self, layer: int) -> None:
        """Returns once layer ``layer`` has landed (or the copy failed)."""
        self.waited[layer] = True
        landed = self._landed[layer]
        if not landed.is_set():
            start = time.perf_counter()
            landed.wait()
            self.wait_seconds += time.perf_counter() - start

    def finish(self) -> BaseException | None:
        """Waits for every layer; the copy's error, if it had one."""
        self._done.result()
        return self.error

    @property
    def unwaited(self) -> list[int]:
        """Layers the forward pass may have read without waiting for them."""
        return [i for i, w in enumerate(self.waited) if not w]
