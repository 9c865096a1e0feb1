"""The put queue behind the disk and Redis tiers (store/tiering.py)."""

import threading

from kvconnector.keys import ChunkKey
from kvconnector.store.tiering import PutQueue


def test_flush_gives_up_on_a_stuck_copy_and_says_so():
    release, made = threading.Event(), []

    def put(slot: int, key: ChunkKey, blocks: int) -> None:
        release.wait(10)
        made.append(slot)

    q = PutQueue("test", put)
    key = ChunkKey(b"f" * 16, 0, b"h" * 16)
    q.offload(0, key)
    q.offload(1, key)
    assert q.flush(0.2) is False and q.queued == 2  # stuck: the caller hears of it
    release.set()
    assert q.flush(5) is True and made == [0, 1] and q.queued == 0
    assert q.flush(0) is True  # nothing queued: at once
    assert q.close(5)
