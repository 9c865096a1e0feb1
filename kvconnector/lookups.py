"""Questions to Redis asked on one background thread, so that a scheduler step never waits
on the network: a step asks, and a later step reads the answer. A step that schedules
nothing may wait a little for the answers (``wait``): vLLM steps an idle engine back to
back, and that loop would hold the GIL the lookup thread needs to read its reply.

With a key mirror (``store/redis_mirror.py``) in sync, a question is answered at once from
it, on the scheduler's thread, and Redis is not asked."""

from __future__ import annotations

import logging
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


class OutOfSync(Exception):
    """The mirror stopped answering while a question was read from it."""


class MirrorAnswers:
    """``RedisStore``'s lookup calls, answered from the key mirror."""

    def __init__(self, redis: RedisStore, mirror: RedisKeyMirror) -> None:
        self.redis = redis
        self.mirror = mirror

    def exists_many(self, keys: Sequence[ChunkKey], budget_s: float = 0.0) -> list[bool]:
        found = self.mirror.answer([self.redis.redis_key(k) for k in keys])
        if found is None:
            raise OutOfSync
        self.redis.count_lookup(sum(found))
        return found

    def exists_prefix(self, keys: Sequence[ChunkKey], budget_s: float = 0.0) -> int:
        found = self.exists_many(keys)
        return next((i for i, ok in enumerate(found) if not ok), len(found))


class Lookups:
    def __init__(self, redis: RedisStore, budget_s: float,
                 mirror: RedisKeyMirror | None = None) -> None:
        self.redis = redis
        self.budget_s = budget_s
        self.mirror = mirror
        self._from_mirror = MirrorAnswers(redis, mirror) if mirror is not None else None
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="kvconnector-lookup",
                                          initializer=name_os_thread,
                                          initargs=("kvconnector-lookup",))
        self._last: Future[Any] | None = None  # one thread: answered last of those asked

    def answer(self, asked: Asked[T] | None, question: Hashable,
               ask: Callable[[Any, float], T], miss: T) -> tuple[Asked[T] | None, T | None]:
        """``(what is now asked, its answer or None while Redis is asked)``. A new question
        replaces an old one; a failed lookup answers ``miss`` (the store counts its faults).
        ``ask`` calls ``exists_many`` or ``exists_prefix`` of what it is given: the store,
        or the mirror's answers."""
        if self._from_mirror is not None and self._from_mirror.mirror.synced:
            try:
                return None, ask(self._from_mirror, self.budget_s)
            except OutOfSync:
                pass
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

    def forget(self, keys: Sequence[ChunkKey]) -> None:
        """Keys a load did not find where a lookup had: the mirror must not offer them."""
        if self.mirror is not None:
            self.mirror.forget([self.redis.redis_key(k) for k in keys])

    def shutdown(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)
        if self.mirror is not None:
            self.mirror.close()
