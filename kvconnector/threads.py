"""The worker's background threads, and the rule they share: their torch ops run on the
thread itself, never on an OpenMP team of their own.

vLLM's CPU worker computes its forward pass on an OpenMP team. A torch op big enough to go
parallel on any other thread starts a second team, and libgomp, then managing more threads
than there are CPUs, throttles how long every team spin-waits, the forward's included.
Measured with the engine in one process on 2 cores (docs/benchmarks.md section 14): once the
copy thread had saved a chunk, every forward took about twice as long, and a memory hit of
1024 tokens (tiny model) 5.1 ms against 3.4 ms with this rule.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

logger = logging.getLogger("kvconnector.threads")
_PR_SET_NAME = 15  # prctl(2)
START_TIMEOUT_S = 30.0


def name_os_thread(name: str) -> None:
    """Give the calling thread ``name`` where the OS shows it (``top -H``, ``perf``,
    ``py-spy``): as ``kvc-...``, at most 15 bytes. Python's thread names stay in Python."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_NAME, name.replace("kvconnector-", "kvc-").encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):  # only a name: the thread works the same
        logger.debug("kvconnector: thread %s not named for the OS", name)


def _own_thread(cores: set[int] | None, name: str = "") -> None:
    if name:
        name_os_thread(name)
    # torch sets a thread's OpenMP threads to the default on its first op: that first, so
    # the setting stays. torch._C's, not torch.set_num_threads: vLLM's CPU worker replaces
    # the latter with a warning. It also sets the default for threads to come.
    try:
        torch.get_num_threads()
        torch._C.set_num_threads(1)
    except Exception:  # a torch without it: the thread still works, only the rule is lost
        logger.warning("kvconnector: %s could not keep torch to itself",
                       threading.current_thread().name, exc_info=True)
    if cores:
        try:
            os.sched_setaffinity(0, cores)
        except OSError as e:  # still correct where it runs; only slower
            logger.debug("kvconnector: %s not moved to cores %s: %s",
                         threading.current_thread().name, sorted(cores), e)


def pool(name: str, cores: set[int] | None = None, workers: int = 1) -> ThreadPoolExecutor:
    """``workers`` background threads, all started now, on ``cores`` if given."""
    threads = torch.get_num_threads()
    executor = ThreadPoolExecutor(workers, name, initializer=_own_thread,
                                  initargs=(cores, name))
    # Every thread now, each held until all exist (an idle one would take the next
    # task): one started later would reset torch's default for threads to come.
    started = threading.Barrier(workers + 1, timeout=START_TIMEOUT_S)
    for _ in range(workers):
        executor.submit(started.wait)
    try:
        started.wait()
    except threading.BrokenBarrierError:
        executor.shutdown(wait=False, cancel_futures=True)
        raise RuntimeError(f"kvconnector: {workers} {name} threads did not start within "
                           f"{START_TIMEOUT_S:.0f} s") from None
    _restore_default(threads)
    return executor


def start(name: str, loop: Callable[[], None],
          cores: set[int] | None = None) -> threading.Thread:
    """A daemon thread running ``loop`` (on ``cores`` if given), started once its torch
    setting is made."""
    threads = torch.get_num_threads()
    ready = threading.Event()

    def run() -> None:
        _own_thread(cores, name)
        ready.set()
        loop()

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    ready.wait()
    _restore_default(threads)
    return thread


def _restore_default(threads: int) -> None:
    """The default for threads to come: the caller's own count. Where vLLM leaves the
    default unset (from ``OMP_NUM_THREADS``, which it sets to the worker's cores) that is the
    same number; the caller's own setting does not change."""
    try:
        torch._C.set_num_threads(threads)
    except Exception:
        logger.debug("kvconnector: torch's default threads not restored", exc_info=True)
