"""How a config key is declared and checked: one ``setting(...)`` per key, one checker.

Every key of ``kv_connector_extra_config`` is a field of a frozen dataclass
(``ConnectorConfig``, ``BlendConfig``) declared with ``setting``: its default, kind and
bounds, a one-line doc, and whether a request may override it in ``kv_transfer_params``.
``parse`` checks the keys of a dict against a dataclass's settings; every error names the
key and what it expects. The LMCache translation (``lmcache_rules``) checks LMCache's
values with the same ``check``, so both speak with the same messages.

A schema of our own rather than pydantic (which vLLM installs): pydantic reports
"Input should be greater than 0" under a location tuple and an error count, so each key
would need a custom validator or message to say what it expects (a size such as
'512MiB', letters and digits, a URL that must not be echoed because it may hold a
password): longer than these nine kinds, and pydantic stays out of our dependencies.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection
from dataclasses import Field, dataclass, field, fields
from typing import Any

KINDS = ("bool", "int", "number", "ratio", "size", "text", "url", "choice", "ids")

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


class ConfigError(ValueError):
    """A ``kv_connector_extra_config`` entry is unknown or has a bad value."""


def human_size(n: int, up: bool = False) -> str:
    """A size as the config would be written, e.g. '4MiB' (rounded up with ``up``)."""
    for unit, m in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= m:
            q = -(-n // m) if up else n / m
            return f"{q:g}{unit}" if up or n % m == 0 else f"{q:.1f}{unit}"
    return f"{n}B"


def parse_size(key: str, value: Any) -> int:
    """Bytes from an int or a string such as ``"512MiB"`` or ``"4GB"``."""
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected a size in bytes, got {value!r}")
    if isinstance(value, int):
        size = value
    elif isinstance(value, str) and (m := _SIZE.match(value)) and m[2].lower() in _UNITS:
        size = int(float(m[1]) * _UNITS[m[2].lower()])
    else:
        raise ConfigError(
            f"{key}: expected a size such as 1073741824, '512MiB' or '4GB' "
            f"(units: {', '.join(u for u in _UNITS if u)}), got {value!r}")
    if size <= 0:
        raise ConfigError(f"{key}: must be positive, got {value!r}")
    return size


@dataclass(frozen=True)
class Setting:
    """How one key is checked, by ``kind``: bool; int (>= ``lo``); number (> 0); ratio
    (0 to 1); size (bytes or '512MiB', ``parse_size``); text (matching ``pattern``, said
    in words by ``expected``); url (starting with one of ``choices``; never echoed, it may
    hold a password); choice (one of ``choices``); ids (a non-empty list of ints >= 0)."""

    kind: str
    doc: str = ""
    lo: int = 0
    choices: Collection[str] = ()  # url: a tuple; choice: read at each check (a registry)
    pattern: str = r"(?s).*"
    expected: str = ""
    optional: bool = False  # None keeps the default
    request: bool = False  # a request may override it (kv_transfer_params)
    key: str | None = None  # the config key, when it is not the prefix and the field name

    def __post_init__(self) -> None:
        assert self.kind in KINDS, self.kind

    def expects(self) -> str:
        """What a valid value is, in words."""
        return {"bool": "true or false",
                "int": "a positive integer" if self.lo == 1 else f"an integer >= {self.lo}",
                "number": "a positive number", "ratio": "a number from 0 to 1",
                "url": f"a URL starting with one of {self.choices}",
                "choice": f"one of {list(self.choices)}",
                "ids": "a non-empty list of token ids"}.get(self.kind, self.expected)


def setting(default: Any, kind: str, doc: str, **spec: Any) -> Any:
    """A dataclass field that is a config key; ``spec``: the other fields of ``Setting``."""
    return field(default=default, metadata={"setting": Setting(kind, doc, **spec)})


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check(key: str, s: Setting, v: Any, error: type[ConfigError] = ConfigError) -> Any:
    """``v`` as a value of ``key``, or ``error`` naming the key and what it expects."""
    if s.kind == "size":
        return parse_size(key, v)
    number = _is_int(v) or isinstance(v, float)
    if s.kind == "bool":
        ok = isinstance(v, bool)
    elif s.kind == "int":
        ok = _is_int(v) and v >= s.lo
    elif s.kind == "number":
        ok = number and v > 0
    elif s.kind == "ratio":
        ok = number and not math.isnan(v) and 0 <= v <= 1
    elif s.kind == "text":
        ok = isinstance(v, str) and re.fullmatch(s.pattern, v) is not None
    elif s.kind == "url":
        ok = isinstance(v, str) and v.startswith(s.choices)
    elif s.kind == "choice":
        ok = v in s.choices
    else:
        ok = isinstance(v, (list, tuple)) and bool(v) and all(
            _is_int(t) and t >= 0 for t in v)
    if not ok:
        raise error(f"{key}: expected {s.expects()}" + ("" if s.kind == "url" else
                                                         f", got {v!r}"))
    if s.kind in ("number", "ratio"):
        return float(v)
    return tuple(v) if s.kind == "ids" else v


def settings(cls: type, prefix: str = "") -> dict[str, tuple[Field[Any], Setting]]:
    """Config key -> (field, setting) of a dataclass's settings, in declaration order."""
    out = {}
    for f in fields(cls):
        s = f.metadata.get("setting")
        if s is not None:
            out[s.key or prefix + f.name] = (f, s)
    return out


def parse(cls: type, extra: dict[str, Any], prefix: str = "",
          error: type[ConfigError] = ConfigError) -> dict[str, Any]:
    """Field values of ``cls`` from the keys of ``extra`` (only those present)."""
    values = {}
    for key, (f, s) in settings(cls, prefix).items():
        if key in extra and not (s.optional and extra[key] is None):
            values[f.name] = check(key, s, extra[key], error)
    return values
