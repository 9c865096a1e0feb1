"""The worker's side of loading layer by layer: which layer a hook names, whether vLLM has
shown that it waits for every layer, and the one load a step may have in flight.

A load goes by layer only once vLLM has called ``wait_for_layer_load`` for every layer of
the attention group (its attention ops carry the connector's per-layer hooks; a model or
backend whose ops do not would read layers before they land). A step whose load then finds a
layer that was never waited for has its chunks recomputed, and loads go back to landing
before the forward pass for good.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from kvconnector.kernels.by_layer import LayerLoad
from kvconnector.metadata import ChunkTransfer

logger = logging.getLogger("kvconnector.worker")

# Below this a load is copied before the forward pass, as before: waking the helper costs
# about what copying half a MiB does on one thread (docs/benchmarks.md section 16).
MIN_BYTES = 1 << 20
# The forward waits for the first layer's share of the helper's copy, and the helper, on the
# core vLLM's engine core spins on, copied 2.5x slower than the forward's thread: with the
# tiny model's 2 layers hits got 8-10% slower by layer, with SmolLM2's 30 faster (section 16).
MIN_LAYERS = 8


@dataclass(frozen=True)
class Landed:
    """A load's outcome once the forward pass is over."""

    transfers: list[ChunkTransfer]
    load: LayerLoad
    handed_over_s: float  # the forward's thread: checks and hand-over
    problem: str | None  # why its chunks must be recomputed, if they must


class LoadsByLayer:
    def __init__(self, layer_names: Sequence[str], on: bool = True) -> None:
        self._index = {name: i for i, name in enumerate(layer_names)}
        self._unseen = set(self._index.values())
        self.enabled = on
        self._load: LayerLoad | None = None
        self._transfers: list[ChunkTransfer] = []
        self._handed_over_s = 0.0

    def usable(self, nbytes: int) -> bool:
        return (self.enabled and not self._unseen and self._load is None
                and len(self._index) >= MIN_LAYERS and nbytes >= MIN_BYTES)

    def begin(self, load: LayerLoad, transfers: list[ChunkTransfer],
              handed_over_s: float) -> None:
        assert self._load is None, "a load by layer is still in flight"
        self._load, self._transfers, self._handed_over_s = load, transfers, handed_over_s

    def wait(self, layer_name: str) -> None:
        """vLLM's ``wait_for_layer_load``: on the forward's thread, once per layer."""
        i = self._index.get(layer_name)
        if i is None:
            return
        if self._unseen:
            self._unseen.discard(i)
        if self._load is not None:
            self._load.wait(i)

    def land(self) -> Landed | None:
        """The forward pass is over: the load in flight, complete, if there is one."""
        load = self._load
        if load is None:
            return None
        self._load = None
        error = load.finish()
        problem = None
        if error is not None:
            problem = f"copying by layer failed: {error!r}"
        elif load.unwaited:
            problem = (f"vLLM did not wait for layers {load.unwaited} of a load by layer; "
                       "loads land before the forward pass from now on")
            self.enabled = False
        return Landed(self._transfers, load, self._handed_over_s, problem)
