"""One call of ``RedisConnections``: its pipeline sent on a connection to each server
concerned, then its replies read (``Call.finish``, on any thread), and how each server's
part went (``Group``); ``PendingExists``, a lookup's call begun and not yet read."""

from __future__ import annotations

import queue
import ssl
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvconnector.store.redis_backoff import Backoff
from kvconnector.store.redis_wire import Timeout, Wire, gather


class Counted(Protocol):
    """The store whose counters a lookup adds to (``RedisStore``)."""

    def _count(self, **deltas: int) -> None: ...

    def _note_reply_errors(self, errors: list[str]) -> None: ...


class Owner(Protocol):
    """What a call gives back to the connections it was begun on."""

    _slots: queue.Queue[None]

    def _release(self, held: Held, failed: bool, restore_timeout: bool) -> None: ...

    def _settle(self, begun: Call) -> list[bool]: ...


@dataclass
class Held:
    """A connection this store holds between calls, with its poller and read buffer."""

    __slots__ = ("pool", "conn", "poller", "wire", "used")
    pool: Any
    conn: Any
    poller: Any
    wire: Wire
    used: float



def read_all(wire: Wire, idx: Sequence[int], cmds: list[Any],
              read: Callable[[Wire, int], None], window: int | None) -> None:
    """Read the replies to ``idx``, the first ``window`` of which were sent (all without
    a window), sending the next command as each reply is read."""
    for j, i in enumerate(idx):
        read(wire, i)
        if window is not None and j + window < len(idx):
            wire.send(gather(cmds, [idx[j + window]]))


class Call:
    """One call's pipeline, sent, with its replies still to read (``RedisConnections``)."""

    def __init__(self, conns: Owner, op: str, rkeys: list[bytes],
                 cmds: list[Any], read: Callable[[Wire, int], None], deadline: float | None,
                 window: int | None) -> None:
        self.conns, self.op, self.rkeys, self.cmds, self.read = conns, op, rkeys, cmds, read
        self.deadline, self.window = deadline, window
        self.groups: list[Group] = []
        self.slot = False  # holds one of the call slots
        self.done = False

    def replied(self, by: float) -> bool:
        """Whether every reply is here, each a single line (an EXISTS pipeline's), waiting
        for them until ``by``. A server that sends part of its replies and stalls holds
        this wait, not the call's whole budget."""
        for g in self.groups:
            if g.error is not None or g.held is None:
                continue
            wire = g.held.wire
            while not wire.has_lines(len(g.idx)):
                if not (isinstance(wire.sock, ssl.SSLSocket) and wire.sock.pending()):
                    left = by - time.monotonic()
                    if left <= 0:
                        return False
                    try:
                        if not g.held.poller.poll(left * 1000):
                            continue
                    except InterruptedError:
                        continue
                try:
                    wire.fill()  # readable: a read that does not wait (TLS: a whole record)
                except Exception as e:
                    g.fail(e)  # finish reads no more of it, and counts the fault
                    break
        return True

    def restart_budget(self) -> Callable[[], None]:
        """For a call handed to another thread to finish: when called there, the call's
        deadline is as far away as it is now, so that time spent waiting for that thread
        does not make the replies late."""
        left = None if self.deadline is None else self.deadline - time.monotonic()

        def restart() -> None:
            if left is not None:
                self.deadline = time.monotonic() + left
                for g in self.groups:
                    if g.held is not None:
                        g.held.wire.deadline = self.deadline
        return restart

    def finish(self) -> list[bool]:
        """Read every reply within the call's deadline; per key, whether its server
        answered (``RedisConnections.call``)."""
        assert not self.done, "a call is finished once"
        self.done = True
        deadline, groups = self.deadline, self.groups
        try:
            for g in groups:
                g.attempt(lambda g=g: read_all(g.held.wire, g.idx, self.cmds, self.read,
                                                self.window))
            if deadline is not None and time.monotonic() > deadline:
                # every reply read (the connection is in sync), but too late to be used
                for g in groups:
                    g.late = g.error is None
                    g.fail(Timeout("replies came after the time budget"))
        finally:
            self.release()
        return self.conns._settle(self)

    def release(self) -> None:
        """Give back the connections and the call slot."""
        for g in self.groups:
            if g.held is not None:
                self.conns._release(g.held, g.error is not None and not g.late,
                                    self.deadline is not None)
                g.held = None
        if self.slot:
            self.slot = False
            self.conns._slots.put(None)


class Group:
    """The keys of one call that live on one server, and how their part went."""

    def __init__(self, pool: Any, idx: Sequence[int], backoff: Backoff, name: str,
                 state: str) -> None:
        self.pool, self.idx, self.backoff, self.name, self.state = (
            pool, idx, backoff, name, state)
        self.held: Held | None = None
        self.error: BaseException | None = None
        self.late = False  # all replies read, after the deadline: the connection is fine

    def attempt(self, step: Callable[[], Any]) -> None:
        if self.error is None:
            try:
                step()
            except Exception as e:
                self.error = e

    def fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error


class PendingExists:
    """An EXISTS pipeline sent, its replies still to read (``RedisStore.start_exists``)."""

    def __init__(self, store: Counted, call: Call, found: list[bool],
                 reply_errors: list[str]) -> None:
        self._store, self._call, self._found, self._errors = store, call, found, reply_errors

    def replied(self, by: float) -> bool:
        """Whether the replies are here, waiting for them until ``by`` (monotonic)."""
        return self._call.replied(by)

    def handed_over(self) -> Callable[[], list[bool]]:
        """``finish`` for another thread, with the time budget left now, counted from when
        that thread starts it (``Call.restart_budget``)."""
        restart = self._call.restart_budget()

        def finish() -> list[bool]:
            restart()
            return self.finish()
        return finish

    def finish(self, count: bool = True) -> list[bool]:
        """Which keys are stored, as ``exists_many`` answers; counted as one lookup."""
        answered = self._call.finish()
        self._store._note_reply_errors(self._errors)
        found = [f and a for f, a in zip(self._found, answered, strict=True)]
        if count:
            self._store._count(lookups=1, lookup_hits=sum(found))
        return found
