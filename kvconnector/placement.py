"""Where and when the worker's background writes run: its saves (a step's blocks copied into
the memory pool), Redis puts and disk writes.

On the CPU build each waits for a forward pass to run, at most ``WRITE_HOLD_MAX_S``, and runs
on the cores vLLM left spare. Between forward passes both cores of a small machine are on
the request's path: the worker finishes its step on one, vLLM's engine-core process hands
the output over and schedules the next step on the other. During a forward pass the spare
core only runs the engine-core process's wait for the worker. Measured on 1024-token
tiny-model misses (docs/benchmarks.md): a Redis put after the forward pass cost each miss
2.4 ms, held and on the spare core about 1 ms (section 33); disk writes 1.4-1.6 ms at once,
0.9-1.2 ms held (section 34). Held on the worker's core, or at once on the spare core, each
was slower. With a step's saves held as well, a Redis miss's step took 0.9-1.1 ms more than
a request's that opts out, against 1.2-2.1 ms with the saves made at once after the forward
pass (section 37). The CUDA build does not hold them (not measured there).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

# Longer than the gap between two requests' forward passes in a stream of misses (5-8 ms);
# an engine with nothing more to compute gets its writes after this.
WRITE_HOLD_MAX_S = 0.02


@dataclass(frozen=True)
class WritePlacement:
    """Background writes run on ``cores`` (None: wherever the thread starting them runs),
    and with a ``gate``, once it is set (at most ``hold_s`` later)."""

    cores: set[int] | None = None
    gate: threading.Event | None = None
    hold_s: float = WRITE_HOLD_MAX_S

    @staticmethod
    def for_worker(spare_cores: set[int] | None, gate: threading.Event,
                   cuda: bool) -> WritePlacement:
        """A worker's: on the spare cores, held for a forward pass (``gate``) on the CPU
        build."""
        return WritePlacement(spare_cores, None if cuda else gate)


AT_ONCE = WritePlacement()  # a write goes when queued, from wherever (tests and tools)
