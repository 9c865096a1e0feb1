"""kvconnector's background threads run torch on themselves, never on an OpenMP team of their
own (which would throttle the forward pass's team: ``kvconnector/threads.py``)."""

import os
import sys
import threading
from pathlib import Path

import pytest
import torch

from kvconnector import threads


def _threads_of_a_new_plain_thread() -> int:
    got: list[int] = []
    t = threading.Thread(target=lambda: got.append(torch.get_num_threads()))
    t.start()
    t.join()
    return got[0]


def test_background_threads_compute_alone_and_leave_everyone_else_as_they_were():
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # as vLLM's worker on 2 cores, whatever this machine has
    try:
        default = _threads_of_a_new_plain_thread()
        executor = threads.pool("test-pool", os.sched_getaffinity(0))
        assert executor.submit(torch.get_num_threads).result() == 1
        assert executor.submit(os.sched_getaffinity, 0).result() == os.sched_getaffinity(0)
        got: list[int] = []
        loop = threads.start("test-loop", lambda: got.append(torch.get_num_threads()))
        loop.join(10)
        assert got == [1] and loop.daemon
        # the caller's threads and the default for threads to come are untouched
        assert torch.get_num_threads() == 2
        assert _threads_of_a_new_plain_thread() == default
        executor.shutdown()
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread names from /proc")
def test_background_threads_carry_short_names_the_os_shows():
    """``top -H``, ``perf`` and ``py-spy`` tell kvconnector's threads apart by these."""

    def os_name(tid: int) -> str:
        return Path(f"/proc/self/task/{tid}/comm").read_text().strip()

    executor = threads.pool("kvconnector-redis-put")
    assert os_name(executor.submit(threading.get_native_id).result()) == "kvc-redis-put"
    executor.shutdown()
    release = threading.Event()
    thread = threads.start("kvconnector-layer-loads-x", lambda: release.wait(10))
    assert os_name(thread.native_id) == "kvc-layer-loads"  # 15 bytes at most
    release.set()
    thread.join(5)
