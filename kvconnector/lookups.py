"""Questions to Redis asked on one background thread, so that a scheduler step never waits
on the network: a step asks, and a later step reads the answer. A step that schedules
nothing may wait a little for the answers (``wait``): vLLM steps an idle engine back to
back, and that loop would hold the GIL the lookup thread needs to read its reply."""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from kvconnector.store.redis_store import RedisStore
from kvconnector.threads import name_os_thread

logger = logging.getLogger("kvconnector.lookups")

T = TypeVar("T")


@dataclass
class Asked(Generic[T]):
    """The last question a request asked, and its answer to come."""

    question: Hashable
    answer: Future[T]


class Lookups:
    def __init__(self, redis: RedisStore, budget_s: float) -> None:
        self.redis = redis
        self.budget_s = budget_s
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="kvconnector-lookup",
                                          initializer=name_os_thread,
                                          initargs=("kvconnector-lookup",))
        self._last: Future[Any] | None = None  # one thread: answered last of those asked

    def answer(self, asked: Asked[T] | None, question: Hashable,
               ask: Callable[[RedisStore, float], T], miss: T) -> tuple[Asked[T], T | None]:
        """``(what is now asked, its answer or None while Redis is asked)``. A new question
        replaces an old one; a failed lookup answers ``miss`` (the store counts its faults)."""
        if asked is None or asked.question != question:
            asked = Asked(question, self._thread.submit(ask, self.redis, self.budget_s))
            self._last = asked.answer
        if not asked.answer.done():
            return asked, None
        try:
            return asked, asked.answer.result()
        except Exception:
            logger.debug("kvconnector: Redis lookup failed", exc_info=True)
            return asked, miss

    def wait(self, timeout: float) -> None:
        """Until every question asked so far is answered, at most ``timeout`` seconds."""
        last = self._last
        if last is not None and not last.done():
            wait([last], timeout)

    def shutdown(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)
