"""Questions to Redis asked on one background thread, so that a scheduler step never waits
on the network: a step asks, and a later step reads the answer. A step that schedules
nothing may wait a little for the answers (``wait``): vLLM steps an idle engine back to
back, and that loop would hold the GIL the lookup thread needs to read its reply.

A request alone in the engine delays nobody by a short wait: its question is sent from the
scheduler's thread and its reply read there if it comes within a few milliseconds.

With a key mirror (``store/redis_mirror.py``) in sync, a question is answered at once from
it, on the scheduler's thread, and Redis is not asked."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from kvconnector.keys import ChunkKey
from kvconnector.store.redis_mirror import RedisKeyMirror
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
    def __init__(self, redis: RedisStore, budget_s: float,
                 mirror: RedisKeyMirror | None = None) -> None:
        self.redis = redis
        self.budget_s = budget_s
        self.mirror = mirror
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="kvconnector-lookup",
                                          initializer=name_os_thread,
                                          initargs=("kvconnector-lookup",))
        self._last: Future[Any] | None = None  # one thread: answered last of those asked

    def answer(self, asked: Asked[T] | None, question: Hashable, keys: Sequence[ChunkKey],
               interpret: Callable[[list[bool]], T], miss: T,
               wait_s: float = 0.0) -> tuple[Asked[T] | None, T | None]:
        """``(what is now asked, its answer or None while Redis is asked)``: which of
        ``keys`` Redis holds, as ``interpret`` reads it. A new question replaces an old
        one; a failed lookup answers ``miss`` (the store counts its faults).

        With ``wait_s``, a new question is sent from this thread and its reply awaited
        that long: a lone request's lookup then costs its round trip, not the hand-offs to
        the lookup thread and back. A reply still out then is read by the lookup thread,
        within the whole budget, as any other."""
        if self.mirror is not None:
            found = self.mirror.answer([self.redis.redis_key(k) for k in keys])
            if found is not None:
                self.redis.count_lookup(sum(found))
                return None, interpret(found)
        if asked is None or asked.question != question:
            asked = Asked(question, self._ask(keys, interpret, wait_s))
            self._last = asked.answer
        if not asked.answer.done():
            return asked, None
        try:
            return asked, asked.answer.result()
        except Exception:
            logger.debug("kvconnector: Redis lookup failed", exc_info=True)
            return asked, miss

    def _ask(self, keys: Sequence[ChunkKey], interpret: Callable[[list[bool]], T],
             wait_s: float) -> Future[T]:
        pending = self.redis.start_exists(keys, self.budget_s) if wait_s > 0 and keys else None
        if pending is None:
            return self._thread.submit(
                lambda: interpret(self.redis.exists_many(keys, self.budget_s)))
        if not pending.replied(time.monotonic() + wait_s):
            finish = pending.handed_over()  # a busy thread does not make the reply late
            return self._thread.submit(lambda: interpret(finish()))
        answer: Future[T] = Future()
        try:
            found = pending.finish()
            self.redis.count_inline_lookup()
            answer.set_result(interpret(found))
        except Exception as e:
            answer.set_exception(e)
        return answer

    def wait(self, timeout: float) -> None:
        """Until every question asked so far is answered, at most ``timeout`` seconds."""
        last = self._last
        if last is not None and not last.done():
            wait([last], timeout)

    def forget(self, keys: Sequence[ChunkKey]) -> None:
        """Keys a load did not find where a lookup had: the mirror must not offer them."""
        if self.mirror is not None:
            self.mirror.forget([self.redis.redis_key(k) for k in keys])

    def shutdown(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)
        if self.mirror is not None:
            self.mirror.close()
