"""The worker's copy thread: order, waits and bookkeeping (real threads, no engine)."""

from __future__ import annotations

import threading
import time

from kvconnector.background import CopyThread


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
