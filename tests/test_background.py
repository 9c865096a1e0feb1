"""The worker's copy thread: order, waits and bookkeeping (real threads, no engine)."""

from __future__ import annotations

import os
import threading
import time

import pytest

from kvconnector.background import CopyThread
from kvconnector.placement import WritePlacement


def test_jobs_run_in_submission_order_and_are_forgotten():
    copies, order = CopyThread(), []
    for i in range(20):
        copies.submit(lambda i=i: order.append(i), [f"r{i % 3}"], [i % 4])
    copies.drain()
    assert order == list(range(20))
    assert copies.pending == 0 and not copies.busy("r0")
    assert copies.close(1.0)


def test_waits_cover_exactly_the_named_requests_and_slots():
    copies, gate = CopyThread(), threading.Event()
    copies.submit(gate.wait, ["stuck"], [7])
    assert copies.busy("stuck") and not copies.busy("other")
    copies.wait_for_requests(["other"])  # nothing queued for it: returns at once
    copies.wait_for_slots([3])
    waiter = threading.Thread(target=copies.wait_for_slots, args=([7],))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive(), "returned while the slot's job was still queued"
    gate.set()
    waiter.join(5)
    assert not waiter.is_alive()
    copies.wait_for_requests(["stuck"])
    assert copies.pending == 0
    assert copies.close(1.0)


def test_a_failing_job_is_logged_and_does_not_stop_the_thread(caplog):
    copies, ran = CopyThread(), []

    def fail():
        raise RuntimeError("boom")

    copies.submit(fail, ["r"], [1])
    copies.submit(lambda: ran.append(True), ["r"], [1])
    copies.wait_for_requests(["r"])
    copies.drain()
    assert ran == [True] and copies.pending == 0
    assert "background copy failed" in caplog.text
    assert copies.close(1.0)


def test_close_drops_queued_jobs_and_waits_only_so_long(caplog):
    copies, gate, started, ran = CopyThread(), threading.Event(), threading.Event(), []
    copies.submit(lambda: (started.set(), gate.wait()), ["running"], [1])
    assert started.wait(10)  # running, not queued, when close comes
    for i in range(5):
        copies.submit(lambda i=i: ran.append(i), [f"queued{i}"], [2 + i])
    start = time.monotonic()
    assert not copies.close(0.3)  # the running job is still stuck
    assert time.monotonic() - start < 10  # bounded: the feature (generous for busy CI)
    gate.set()
    copies._executor.shutdown(wait=True)  # the thread has finished: nothing else can run
    assert ran == [], "jobs queued behind the running one ran after close"
    assert "callback" not in caplog.text  # cancelled jobs are forgotten quietly


def held(hold_s: float = 5.0, cores: set[int] | None = None) -> tuple[CopyThread, threading.Event]:
    gate = threading.Event()
    return CopyThread(WritePlacement(cores, gate, hold_s)), gate


def test_a_save_waits_for_the_gate_and_other_jobs_do_not():
    """On the CPU build a step's save is held until the next forward pass opens the gate
    (placement.py); a job that is not a save is not."""
    copies, gate = held()
    ran: list[str] = []
    copies.submit(lambda: ran.append("save"), ["a"], [1], save=True)
    time.sleep(0.3)
    assert ran == [] and copies.busy("a")
    gate.set()  # a forward pass began
    copies.wait_for_requests(["a"])
    assert ran == ["save"]
    gate.clear()  # it ended
    copies.submit(lambda: ran.append("load"), ["b"], [2])
    copies.wait_for_requests(["b"])
    assert ran == ["save", "load"] and not gate.is_set()  # nothing held: the gate stays shut
    assert copies.close(1.0)


def test_a_held_save_goes_after_its_hold_when_no_forward_pass_comes():
    copies, gate = held(hold_s=0.3)
    done = threading.Event()
    start = time.monotonic()
    copies.submit(done.set, ["a"], [1], save=True)
    assert done.wait(10)
    assert time.monotonic() - start >= 0.29 and not gate.is_set()
    assert copies.close(1.0)


@pytest.mark.parametrize("what", ["slot", "request", "job behind it", "drain"])
def test_whatever_must_not_wait_for_a_held_save_lets_it_go(what):
    """A wait for a held save's slot (a load reading it) or request (vLLM handing its
    blocks out again), a job queued behind it, or a drain: the save runs at once, not a
    hold later."""
    copies, gate = held(hold_s=60.0)
    ran: list[str] = []
    copies.submit(lambda: ran.append("save"), ["a"], [1], save=True)
    start = time.monotonic()
    if what == "slot":
        copies.wait_for_slots([1])
    elif what == "request":
        copies.wait_for_requests(["a"])
    elif what == "job behind it":
        copies.submit(lambda: ran.append("load"), ["b"], [2])
        copies.wait_for_requests(["b"])
    else:
        copies.drain()
    assert ran[0] == "save" and time.monotonic() - start < 10
    assert gate.is_set()  # open until the worker closes it after the next forward pass
    assert copies.close(1.0)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to move between")
def test_the_thread_runs_on_the_placement_s_cores():
    mine = sorted(os.sched_getaffinity(0))
    copies, gate = held(cores={mine[-1]})
    seen: list[set[int]] = []
    gate.set()
    copies.submit(lambda: seen.append(os.sched_getaffinity(0)), ["a"], [1], save=True)
    copies.submit(lambda: seen.append(os.sched_getaffinity(0)), ["b"], [2])
    copies.drain()
    assert seen == [{mine[-1]}, {mine[-1]}] and os.sched_getaffinity(0) == set(mine)
    assert copies.close(1.0)

