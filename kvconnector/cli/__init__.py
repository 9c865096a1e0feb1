"""The ``kvconnector`` command: look into, check and clean the Redis tier or a disk tier's
directory, and show the effective connector config.

    kvconnector stats WHERE              chunks and bytes per model fingerprint and namespace
    kvconnector verify WHERE [--delete]  read every chunk, check header and checksum (or MAC)
    kvconnector purge WHERE --model M | --namespace N | --fingerprint HEX | --all
    kvconnector config KV_TRANSFER_JSON

WHERE: a Redis URL (redis://, rediss://, unix:// or redis+cluster://; a cluster node's
redis:// works too), or a disk tier's directory (the engines' disk_path, or file://PATH).
Exit status: 0 fine, 1 problems found (verify) or not all done, 2 bad usage or no store.
Passwords never appear in the output.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from kvconnector.cli.disk import is_directory_target, open_root
from kvconnector.cli.inventory import CliError, Inventory, Target, connect, take_inventory
from kvconnector.cli.output import emit_json, human_age, human_bytes, shorten, table
from kvconnector.config import ConfigError, ConnectorConfig


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvconnector", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    def redis_command(name: str, help: str) -> argparse.ArgumentParser:
        c = sub.add_parser(name, help=help, description=help)
        c.add_argument("url", metavar="where", help="the Redis the engines use (their "
                       "redis_url), or their disk_path")
        c.add_argument("--prefix", default="kvc", help="redis_key_prefix (default: kvc)")
        pw = c.add_mutually_exclusive_group()
        pw.add_argument("--password-env", metavar="NAME",
                        help="environment variable holding the Redis password")
        pw.add_argument("--password-file", metavar="PATH", help="file holding it")
        c.add_argument("--json", action="store_true", help="machine-readable output")
        bar = c.add_mutually_exclusive_group()
        bar.add_argument("--progress", action="store_true", default=None,
                         help="progress bars on stderr (default: when it is a terminal)")
        bar.add_argument("--no-progress", action="store_false", dest="progress")
        return c

    redis_command("stats", "chunks, bytes and ages per model fingerprint and namespace")
    v = redis_command("verify", "read every stored value and check its header and checksum "
                      "(or MAC), as an engine would")
    v.add_argument("--delete", action="store_true", help="delete the bad values")
    mac = v.add_mutually_exclusive_group()
    mac.add_argument("--mac-key-env", metavar="NAME",
                     help="environment variable with the engines' chunk_mac_key: check MACs")
    mac.add_argument("--mac-key-file", metavar="PATH", help="file holding it")
    g = redis_command("purge", "delete the chunks of some models, namespaces or fingerprints")
    g.add_argument("--model", help="model as the engines name it (glob patterns work)")
    g.add_argument("--namespace", help="the engines' namespace ('' for none)")
    g.add_argument("--fingerprint", action="append", default=[], metavar="HEX",
                   help="a fingerprint (or its first hex digits), e.g. from stats")
    g.add_argument("--all", action="store_true", help="every kvconnector key under the prefix")
    g.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    g.add_argument("--dry-run", action="store_true", help="show what would go; delete nothing")
    c = sub.add_parser("config", help="the effective connector config of a kv-transfer JSON",
                       description="Print the settings an engine would run with (defaults "
                       "included, LMCache settings translated) or why it would not start.")
    c.add_argument("input", nargs="?", help="kv-transfer JSON (or its extra config), inline, "
                   "a file, @file, or - for stdin")
    c.add_argument("--lmcache", metavar="FILE",
                   help="an LMCache YAML file (same as \"lmcache_config_file\": FILE)")
    c.add_argument("--json", action="store_true", help="machine-readable output")
    return p


_SECRET_OPTIONS = {"redis_password": "--password", "chunk_mac_key": "--mac-key"}


def _secret(name: str, env: str | None, path: str | None) -> bytes | None:
    kw = {f"{name}_env": env, f"{name}_file": path}
    try:
        return ConnectorConfig(**kw).secret(name)  # the connector's own rules for secrets
    except ConfigError as e:
        option = _SECRET_OPTIONS[name]
        raise CliError(str(e).replace(f"{name}_env", f"{option}-env")
                       .replace(f"{name}_file", f"{option}-file")) from None


def _target(args: argparse.Namespace) -> Target:
    password = _secret("redis_password", args.password_env, args.password_file)
    return connect(args.url, args.prefix, password.decode() if password else None)


def _stats(args: argparse.Namespace, target: Target | Path) -> int:
    if isinstance(target, Path):
        from kvconnector.cli.disk import disk_inventory

        inv = disk_inventory(target, args.progress)
        if args.json:
            emit_json({"directory": str(target), "chunks": inv.chunks, "bytes": inv.bytes,
                       "fingerprints": [g.to_json() for g in _ordered(inv)]})
            return 0
        print(f"{target} (disk tier)")
        _print_groups(inv)
        print(f"total: {inv.chunks} chunk files, {human_bytes(inv.bytes)}, "
              f"{len(inv.groups)} fingerprint(s)")
        print("newest/oldest: time since a chunk file was last written or read")
        return 0
    inv = take_inventory(target, args.progress)
    if args.json:
        emit_json({"url": target.safe_url, "prefix": target.prefix, "cluster": target.cluster,
                   "nodes": target.names, "chunks": inv.chunks, "bytes": inv.bytes,
                   "other_keys": inv.other_keys,
                   "fingerprints": [g.to_json() for g in _ordered(inv)]})
        return 0
    where = f"cluster of {len(target.names)} primaries" if target.cluster else "1 server"
    print(f"{target.safe_url} (prefix {target.prefix!r}, {where})")
    _print_groups(inv)
    print(f"total: {inv.chunks} chunks, {human_bytes(inv.bytes)}, {len(inv.groups)} "
          f"fingerprint(s); {inv.other_keys} other key(s) under {target.prefix + ':'!r}")
    print("newest/oldest: time since a chunk was last written or read (Redis keeps no "
          "creation time)")
    return 0


def _print_groups(inv: Inventory) -> None:
    rows = []
    for g in _ordered(inv):
        d = g.descriptor
        rows.append([g.fingerprint[:16], shorten(d.model, 40) if d else "(no descriptor)",
                     (d.namespace or "''") if d else "?", d.dtype if d else "?",
                     g.chunks, human_bytes(g.bytes), human_age(g.idle_s[0] if g.idle_s else None),
                     human_age(g.idle_s[1] if g.idle_s else None)])
    if rows:
        print(table(["fingerprint", "model", "namespace", "dtype", "chunks", "size",
                     "newest", "oldest"], rows))
    if any(g.descriptor is None for g in inv.groups.values()):
        print("(no descriptor): chunks whose model is unknown (written by an older "
              "kvconnector, or its descriptor was purged); purge --fingerprint removes them")


def _ordered(inv: Inventory) -> list:
    return sorted(inv.groups.values(), key=lambda g: (-g.bytes, g.fingerprint))


def _verify(args: argparse.Namespace, target: Target | Path) -> int:
    from kvconnector.cli.disk import verify_disk
    from kvconnector.cli.verify import report_json, verify
    from kvconnector.store.codec import mac_key

    secret = args.mac_secret
    start = time.monotonic()
    key = mac_key(secret) if secret else None
    if isinstance(target, Path):
        report = verify_disk(target, mac_key=key, delete=args.delete, progress=args.progress)
        where: dict = {"directory": str(target)}
        title = f"{target} (disk tier)"
    else:
        report = verify(target, mac_key=key, delete=args.delete, progress=args.progress)
        where = {"url": target.safe_url, "prefix": target.prefix}
        title = f"{target.safe_url} (prefix {target.prefix!r})"
    if args.json:
        emit_json({**where, "mac": secret is not None, **report_json(report)})
    else:
        print(f"{title}: checked {report.checked} values "
              f"({human_bytes(report.checked_bytes)}) in {time.monotonic() - start:.1f} s, "
              f"{'MAC' if secret else 'checksum (XXH3-64)'} checked")
        for w in report.warnings:
            print(f"warning: {w}")
        if not report.problems:
            print("all values are intact")
        else:
            print(f"{len(report.problems)} bad: " + ", ".join(
                f"{n} {r}" for r, n in sorted(report.reasons().items())))
            for p in report.problems[:20]:
                print(f"  {p.key}: {p.reason}" + (f" ({p.detail})" if p.detail else ""))
            if len(report.problems) > 20:
                print(f"  ... and {len(report.problems) - 20} more (--json lists all)")
            print(f"deleted {report.deleted}" if args.delete else
                  "run with --delete to remove them (each costs one recompute at most)")
    return 1 if report.problems else 0


def _purge(args: argparse.Namespace, target: Target | Path) -> int:
    from kvconnector.cli.disk import disk_inventory, purge_disk
    from kvconnector.cli.purge import Selection, purge

    selection = Selection(args.all, args.model, args.namespace, tuple(args.fingerprint))
    disk = isinstance(target, Path)
    inv = disk_inventory(target, args.progress) if disk else take_inventory(target,
                                                                            args.progress)
    chosen = selection.chosen(inv)
    groups = [inv.groups[fp] for fp in sorted(chosen)]
    chunks, nbytes = sum(g.chunks for g in groups), sum(g.bytes for g in groups)
    where = ({"directory": str(target)} if disk else
             {"url": target.safe_url, "prefix": target.prefix})
    name = str(target) if disk else target.safe_url
    summary = {**where, "fingerprints": sorted(chosen), "chunks": chunks, "bytes": nbytes,
               "dry_run": args.dry_run}
    if not args.json:
        print(f"{name}{'' if disk else f' (prefix {target.prefix!r})'}: {chunks} chunks "
              f"({human_bytes(nbytes)}) of {len(chosen)} fingerprint(s)")
        for g in groups:
            d = g.descriptor
            print(f"  {g.fingerprint}  {d.model if d else '(no descriptor)'}  "
                  f"namespace {(d.namespace or repr('')) if d else '?'}  {g.chunks} chunks")
    if not chosen or args.dry_run:
        if args.json:
            emit_json({**summary, "deleted": 0})
        else:
            print("nothing to delete" if not chosen else "dry run: nothing deleted")
        return 0
    if not args.yes:
        if not sys.stdin.isatty():
            raise CliError("not a terminal: add --yes to delete without asking")
        answer = input(f"delete them from {name}? [y/N] ")
        if answer.strip().lower() not in ("y", "yes"):
            print("nothing deleted")
            return 1
    deleted = (purge_disk(target, chosen, args.progress) if disk
               else purge(target, chosen, args.progress))
    if args.json:
        emit_json({**summary, "deleted": deleted})
    else:
        print(f"deleted {deleted} {'files' if disk else 'keys'} (chunks and descriptors); "
              "engines still running with these fingerprints store new chunks again")
    return 0


def _config(args: argparse.Namespace) -> int:
    from kvconnector.cli.config_cmd import as_json, effective, read_input

    if args.input is None and args.lmcache is not None:
        data = {}
    else:
        data = read_input(args.input)
    if args.lmcache is not None:
        extra = data.setdefault("kv_connector_extra_config", {}) if (
            "kv_connector" in data or "kv_connector_extra_config" in data) else data
        extra["lmcache_config_file"] = args.lmcache
    try:
        eff = effective(data)
    except ConfigError as e:
        if args.json:
            emit_json(as_json(None, e))
        else:
            print(f"kvconnector would not start: {e}", file=sys.stderr)
        return 2
    if args.json:
        emit_json(as_json(eff, None))
        return 0
    print(table(["setting", "value", "from"],
                [[k, "-" if v is None else v, eff.sources.get(k, "")]
                 for k, v in eff.settings.items()]))
    for a in eff.lmcache_accepted:
        print(f"LMCache: {a}")
    for w in eff.warnings:
        print(f"warning: {w}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "config":
            return _config(args)
        if args.command == "verify":  # a missing secret is found before connecting
            args.mac_secret = _secret("chunk_mac_key", args.mac_key_env, args.mac_key_file)
        run = {"stats": _stats, "verify": _verify, "purge": _purge}[args.command]
        if is_directory_target(args.url):
            return run(args, open_root(args.url))
        target = _target(args)
        try:
            return run(args, target)
        finally:
            target.close()
    except CliError as e:
        print(f"kvconnector {args.command}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
