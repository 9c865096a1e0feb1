"""kvconnector's background threads run torch on themselves, never on an OpenMP team of their
own (which would throttle the forward pass's team: ``kvconnector/threads.py``)."""

import os
import threading

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
