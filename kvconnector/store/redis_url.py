"""Redis URLs: which schemes a store takes, and how a URL is shown without its secrets.

URL schemes: ``redis://``, ``rediss://`` (TLS), ``unix://`` (redis-py's syntax, including
``?db=``, ``?password=``), and ``redis+cluster://`` / ``rediss+cluster://`` for Redis Cluster
(the same as ``cluster=True``). Passwords go to logs only through ``redact_url``.
"""

from __future__ import annotations

import re

_SECRET_QUERY_KEYS = {"password", "pass", "passwd", "pwd", "auth", "token", "secret"}
_CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
_SCHEMES = {"redis", "rediss", "unix", *_CLUSTER_SCHEMES}

# One host of a URL's netloc: a name or IPv4 address, or [IPv6], with an optional port.
_HOSTPORT = r"(?:[A-Za-z0-9._-]+|\[[0-9A-Za-z:.%]+\])(?::[0-9]{1,5})?"
_HOSTS_RE = re.compile(rf"(?:{_HOSTPORT}(?:,{_HOSTPORT})*)?")  # empty: unix://...@/path
_HOSTPORT_RE = re.compile(_HOSTPORT)
# A secret query parameter and its value (to the next & or #), wherever it is.
_SECRET_RE = re.compile(r"(?i)(?<=[?&])(" + "|".join(sorted(_SECRET_QUERY_KEYS))
                        + r")=[^&#]*")


def checked_url(url: str, cluster: bool) -> tuple[str, bool]:
    """The URL redis-py is given for ``url``, and whether it is a cluster's: a
    ``redis+cluster://`` / ``rediss+cluster://`` URL becomes ``redis://`` / ``rediss://``
    with ``cluster`` True. Raises ValueError (naming the URL redacted) for an unsupported
    scheme, a userinfo redis-py would misread, or a cluster on a unix socket."""
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme not in _SCHEMES:
        raise ValueError(f"unsupported Redis URL {redact_url(url)!r}: use redis://, "
                         "rediss://, unix://, redis+cluster:// or rediss+cluster://")
    problem = url_userinfo_problem(url)
    if problem is not None:
        raise ValueError(f"Redis URL {redact_url(url)!r}: {problem}")
    if scheme in _CLUSTER_SCHEMES:
        cluster = True
        url = _CLUSTER_SCHEMES[scheme] + url[len(scheme):]
    if cluster and scheme == "unix":
        raise ValueError("Redis Cluster needs a TCP URL (redis:// or rediss://)")
    return url, cluster


def _userinfo_end(rest: str) -> int | None:
    """Where the userinfo of ``rest`` (a URL after "://") ends: the last "@" that is followed
    by a list of hosts (up to the next "/", "?", "#" or the end) and is not inside a secret
    query value. A password may hold "@", ":", "/", "?", "#" unencoded: with the last such
    "@", all of it goes with the userinfo. None: no userinfo (and -1: one that cannot be
    told apart from the rest, so nothing of the URL is safe to show)."""
    secret_spans = [m.span() for m in _SECRET_RE.finditer(rest)]
    found = False
    for i in range(len(rest) - 1, -1, -1):
        if rest[i] != "@":
            continue
        found = True
        if any(a <= i < b for a, b in secret_spans):
            continue
        end = len(rest)
        for sep in "/?#":
            j = rest.find(sep, i + 1)
            if j >= 0:
                end = min(end, j)
        if _HOSTS_RE.fullmatch(rest, i + 1, end):
            return i
    return -1 if found else None


def _redact_userinfo(userinfo: str) -> str:
    """``***`` for the userinfo; for a cluster URL with a userinfo per host
    (``:pw@h1:7000,:pw@h2:7001``, the userinfo before the last "@" is
    ``:pw@h1:7000,:pw``), ``***@h1:7000,***``: the hosts stay, only when every piece but
    the last reads as userinfo@host (a "," in a password collapses it all to ``***``)."""
    *pieces, _last = userinfo.split(",")
    hosts = [piece.rpartition("@")[2] for piece in pieces]
    if not all("@" in p and _HOSTPORT_RE.fullmatch(h) for p, h in zip(pieces, hosts,
                                                                       strict=True)):
        return "***"
    return ",".join([*(f"***@{h}" for h in hosts), "***"])


def redact_url(url: str) -> str:
    """``url`` without its secrets, safe to log: the userinfo (user and password, which
    ``redis://PASSWORD@host`` puts in the user field) is replaced by ``***`` as a whole, for
    each host of a cluster URL, and so are the values of secret query parameters
    (``?password=``). Found by parsing the netloc, not by a pattern for a password: see
    ``_userinfo_end``."""
    try:
        scheme, sep, rest = url.partition("://")
        if not sep:
            scheme, rest = "", url
        head = f"{scheme}{sep}"
        at = _userinfo_end(rest)
        if at == -1:
            return f"{head}***"
        if at is not None:
            rest = f"{_redact_userinfo(rest[:at])}@{rest[at + 1:]}"
        return head + _SECRET_RE.sub(lambda m: f"{m.group(1)}=***", rest)
    except Exception:
        return "<unparseable url>"


def url_userinfo_problem(url: str) -> str | None:
    """Why redis-py would misread the userinfo of ``url``, or None. A "/", "?" or "#" in a
    password ends the netloc for a URL parser: redis-py would connect to a host and port
    cut from the password (and name them in its errors). Such a URL is refused."""
    rest = url.partition("://")[2]
    at = _userinfo_end(rest)
    if at == -1 or (at is not None and any(c in rest[:at] for c in "/?#")):
        return ("its userinfo holds '/', '?' or '#' (or cannot be told from the host): "
                "percent-encode them in the password (%2F, %3F, %23) and any '@' after the "
                "host (%40), or give the password with redis_password_env / "
                "redis_password_file")
    return None


def url_has_password(url: str) -> bool:
    """Whether ``url`` carries a password (userinfo or a secret query key)."""
    return redact_url(url) != url
