"""FetchFirst: on one tier, a put waits while a fetch runs, and a fetch lets the put already
on the wire finish first; both waits are bounded."""

from __future__ import annotations

import threading
import time

from kvconnector.store.fetch_first import FetchFirst


def test_a_put_waits_for_the_fetch_that_runs():
    order = FetchFirst()
    log: list[str] = []
    fetching, put_done = threading.Event(), threading.Event()

    def put() -> None:
        fetching.wait()
        with order.put():
            log.append("put")
        put_done.set()

    t = threading.Thread(target=put)
    t.start()
    with order.fetch():
        fetching.set()
        time.sleep(0.1)  # the put asks meanwhile
        log.append("fetch")
    assert put_done.wait(5)
    t.join()
    assert log == ["fetch", "put"]
    assert order.puts_delayed == 1


def test_a_fetch_waits_for_the_put_on_the_wire():
    order = FetchFirst()
    log: list[str] = []
    putting = threading.Event()

    def put() -> None:
        with order.put():
            putting.set()
            time.sleep(0.1)
            log.append("put")

    t = threading.Thread(target=put)
    t.start()
    assert putting.wait(5)
    with order.fetch():
        log.append("fetch")
    t.join()
    assert log == ["put", "fetch"]
    assert order.fetch_waited_s > 0.05


def test_the_waits_are_bounded():
    order = FetchFirst(fetch_wait_s=0.05, put_wait_s=0.05)
    with order.put():  # a put that never ends in time: the fetch goes anyway
        start = time.monotonic()
        with order.fetch():
            assert time.monotonic() - start < 1
            with order.put():  # and a put under a fetch that never ends goes anyway
                pass
    assert order.puts_delayed == 1
