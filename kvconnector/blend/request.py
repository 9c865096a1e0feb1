"""What blend knows about one request (part of the scheduler half's ``RequestState``), and
the blended range it offers vLLM."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvconnector.blend.config import BlendConfig
from kvconnector.blend.segments import Document

if TYPE_CHECKING:
    from kvconnector.lookups import Asked


@dataclass
class BlendRequest:
    config: BlendConfig
    docs: list[Document]
    handled: set[int] = field(default_factory=set)  # documents saved or found stored
    blended: bool = False
    declined: bool = False  # blending would cost about what full prefill does
    # vLLM's block hashes are salted from this token on (the blended range): approximate KV
    salted_at: int | None = None
    lookup: Asked[Any] | None = None  # the last Redis question about its documents


@dataclass(frozen=True)
class BlendHit:
    """Tokens ``[start, end)`` offered to vLLM as a hit, from the stored documents ``found``
    (document index -> the tier holding it: "memory", "disk" or "redis")."""

    start: int
    end: int
    found: dict[int, str]
    load_async: bool

    @property
    def tokens(self) -> int:
        return self.end - self.start
