"""``kvconnector purge``: delete the chunks (and descriptors) of chosen fingerprints."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

import redis

from kvconnector.cli.inventory import CliError, Inventory, Target, classify, glob_escape, scan


@dataclass(frozen=True)
class Selection:
    """Which fingerprints to purge: all of them, or those whose descriptor matches
    ``model`` (a glob) and ``namespace``, plus any fingerprint starting with one of
    ``fingerprints``."""

    all: bool = False
    model: str | None = None
    namespace: str | None = None
    fingerprints: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not (self.all or self.model is not None or self.namespace is not None
                or self.fingerprints):
            raise CliError("say what to purge: --model, --namespace, --fingerprint or --all")
        if self.all and (self.model is not None or self.namespace is not None
                         or self.fingerprints):
            raise CliError("--all purges everything: give it alone")
        for fp in self.fingerprints:
            if not fp or any(c not in "0123456789abcdef" for c in fp):
                raise CliError(f"--fingerprint {fp!r}: expected a lowercase hex prefix")

    def chosen(self, inv: Inventory) -> set[str]:
        out = set()
        for fp, group in inv.groups.items():
            if self.all or any(fp.startswith(p) for p in self.fingerprints):
                out.add(fp)
                continue
            d = group.descriptor
            if d is None or (self.model is None and self.namespace is None):
                continue
            if self.model is not None and not fnmatch.fnmatchcase(d.model, self.model):
                continue
            if self.namespace is not None and d.namespace != self.namespace:
                continue
            out.add(fp)
        return out


def purge(target: Target, fingerprints: set[str], progress: bool | None = None) -> int:
    """Delete every chunk and descriptor of ``fingerprints``; returns how many keys went."""
    deleted = 0
    try:
        for client, keys in scan(target, glob_escape(target.prefix) + ":*", progress,
                                 "purge"):
            doomed = [k for k in keys
                      if (c := classify(target.prefix, k)) is not None and c[1] in fingerprints]
            if not doomed:
                continue
            pipe = client.pipeline(transaction=False)
            for k in doomed:  # one key per command: a cluster node refuses multi-slot UNLINK
                pipe.unlink(k)
            deleted += sum(int(n) for n in pipe.execute())
    except redis.RedisError as e:
        raise CliError(f"{target.safe_url}: {type(e).__name__}: {e} ({deleted} keys deleted "
                       "before it)") from None
    return deleted
