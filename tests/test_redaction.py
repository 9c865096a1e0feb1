"""Redis URLs made safe for logs (issue 21): the userinfo (user and password) is replaced by
``***`` as a whole, found by parsing the URL (everything before the last ``@`` of the
netloc, for each host of a cluster URL), and secret query parameters are hidden; the
hosts and ports stay readable."""

from __future__ import annotations

import logging

import pytest

from kvconnector.store.redis_store import RedisStore
from kvconnector.store.redis_url import redact_url, url_has_password

# (url, secrets that must not appear, what must still appear)
HOSTILE = [
    ("redis://:a?Pw0rd@host", ["a?Pw0rd", "Pw0rd"], ["host"]),
    ("redis://Pw0rd@host", ["Pw0rd"], ["host"]),
    ("redis://Pw0rd@host:6379/2", ["Pw0rd"], ["host:6379", "/2"]),
    ("rediss://user:p%40ss@host:6380/0", ["p%40ss", "user"], ["host:6380", "/0"]),
    ("redis+cluster://:pw-x@h1:7000,h2:7001", ["pw-x"], ["h1:7000", "h2:7001"]),
    ("redis+cluster://:pw-x@h1:7000,:pw-y@h2:7001", ["pw-x", "pw-y"], ["h1:7000", "h2:7001"]),
    ("rediss+cluster://admin:pw-x@h1:7000,h2:7001,h3:7002",
     ["admin", "pw-x"], ["h1:7000", "h2:7001", "h3:7002"]),
    ("unix://:pw-x@/tmp/redis.sock", ["pw-x"], ["/tmp/redis.sock"]),
    ("unix://user:pw-x@/tmp/redis.sock?db=3", ["pw-x", "user"], ["/tmp/redis.sock", "db=3"]),
    ("unix:///tmp/redis.sock?db=2&password=pw-x", ["pw-x"], ["/tmp/redis.sock", "db=2"]),
    ("redis://:hun@ter2@host:6379", ["hun", "ter2"], ["host:6379"]),
    ("redis://:hun#ter2@host:6379", ["hun", "ter2"], ["host:6379"]),
    ("redis://:hun/ter2@host:6379/1", ["hun", "ter2"], ["host:6379", "/1"]),
    ("redis://:hun:ter2@host:6379", ["hun", "ter2"], ["host:6379"]),
    ("redis://us:er:hun@t/e#r?2@host:6379", ["us", "hun", "t/e#r?2", "e#r"], ["host:6379"]),
    ("redis://:a/b@c@host:6379", ["a/b@c", "a/b", "b@c"], ["host:6379"]),
    ("redis://:p,w-x@host:6379", ["p,w-x", "w-x"], ["host:6379"]),
    ("redis://u:pw-x@[::1]:6379/0", ["pw-x"], ["[::1]:6379"]),
    ("redis://u:pw-x@host/0?password=pw-y@z&x=1", ["pw-x", "pw-y"], ["host", "x=1"]),
    ("redis://host:6379/0?PassWord=pw-x", ["pw-x"], ["host:6379"]),
    ("redis://:a?password=pw-x@host", ["pw-x", "a?"], []),
]


@pytest.mark.parametrize("url, secrets, kept", HOSTILE, ids=[u for u, _, _ in HOSTILE])
def test_hostile_urls_never_show_their_secret(url, secrets, kept):
    safe = redact_url(url)
    for secret in secrets:
        assert secret not in safe, (url, safe)
    for part in kept:
        assert part in safe, (url, safe)
    assert url_has_password(url)


@pytest.mark.parametrize("url, expected", [
    ("redis://:a?Pw0rd@host", "redis://***@host"),
    ("redis://Pw0rd@host", "redis://***@host"),
    ("rediss://user:p%40ss@host:6380/0", "rediss://***@host:6380/0"),
    ("redis+cluster://:pw@h1:7000,h2:7001", "redis+cluster://***@h1:7000,h2:7001"),
    ("redis+cluster://:pw@h1:7000,:pw@h2:7001", "redis+cluster://***@h1:7000,***@h2:7001"),
    ("unix://:pw@/tmp/redis.sock", "unix://***@/tmp/redis.sock"),
    ("redis://:hun@ter2@host:6379", "redis://***@host:6379"),
    ("unix:///run/redis.sock?db=2&password=hunter2", "unix:///run/redis.sock?db=2&password=***"),
])
def test_redacted_forms(url, expected):
    assert redact_url(url) == expected


@pytest.mark.parametrize("url", [
    "redis://host:6379/0", "redis://127.0.0.1:6379", "rediss://[::1]:6380/1",
    "redis+cluster://h1:7000,h2:7001", "unix:///tmp/redis.sock?db=2",
])
def test_urls_without_secrets_are_unchanged(url):
    assert redact_url(url) == url and not url_has_password(url)


@pytest.mark.parametrize("url, secrets, kept", HOSTILE[:4], ids=[u for u, _, _ in HOSTILE[:4]])
def test_the_store_logs_only_the_redacted_url(caplog, url, secrets, kept):
    caplog.set_level(logging.DEBUG, logger="kvconnector.store.redis")
    try:
        s = RedisStore.from_url(url, connect_timeout_s=0.05, timeout_s=0.05)
    except ValueError as e:  # redis-py refuses some of them; the message is ours
        text = str(e)
    else:
        with s:
            s.exists_prefix(["x"], 0.05)
            text = repr(s)
    text += "\n" + caplog.text
    for secret in secrets:
        assert secret not in text, (url, text)


@pytest.mark.parametrize("url, secret", [
    ("redis://:a?Pw0rd@host", "a?Pw0rd"),
    ("redis://:hun/ter2@host:6379/1", "hun/ter2"),
    ("redis://:12#34@host:6379", "12#34"),
    ("rediss+cluster://:pw/x@h1:7000,h2:7001", "pw/x"),
])
def test_a_url_redis_py_would_misread_is_refused_without_its_secret(capsys, url, secret):
    """A "/", "?" or "#" in a password ends the netloc for redis-py's URL parser: it then
    connects to a host and port cut from the password and names them in its errors
    (``Port could not be cast to integer value as 'hun'``, ``connecting to localhost:12``),
    which reached kvconnector's logs. Such URLs are refused, naming only the safe form."""
    from kvconnector.cli import main

    with pytest.raises(ValueError, match="percent-encode") as info:
        RedisStore.from_url(url)
    # the secret, and each piece redis-py would have cut from it (as host or port)
    fragments = {secret, *secret.replace("?", "/").replace("#", "/").split("/")}
    fragments = {f for f in fragments if len(f) >= 2}
    text = str(info.value)
    assert redact_url(url) in text and not any(f in text for f in fragments), text
    assert main(["stats", url]) == 2
    err = capsys.readouterr().err
    assert "percent-encode" in err and "--password-env" in err
    assert not any(f in err for f in fragments), err
