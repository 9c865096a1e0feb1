from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kvconnector.blend.config import REQUEST_KEYS, BlendConfig
from kvconnector.config import ConfigError, ConnectorConfig, parse_size
from kvconnector.config_schema import Setting, check, human_size, settings


def test_defaults_need_no_config():
    cfg = ConnectorConfig.from_extra_config(None)
    assert cfg.chunk_size == 256 and cfg.memory_capacity == 2 << 30
    assert ConnectorConfig.from_extra_config({}) == cfg


def test_values_are_parsed():
    cfg = ConnectorConfig.from_extra_config(
        {"chunk_size": 512, "memory_capacity": "1.5GiB", "namespace": "prod-a",
         "save_decode_chunks": False})
    assert (cfg.chunk_size, cfg.memory_capacity, cfg.namespace, cfg.save_decode_chunks) == (
        512, 3 << 29, "prod-a", False)


@pytest.mark.parametrize("value, expected", [
    (1024, 1024), ("64MiB", 64 << 20), ("4GB", 4 * 10**9), ("100 kib", 100 << 10)])
def test_sizes(value, expected):
    assert parse_size("memory_capacity", value) == expected


def test_unknown_key_names_it_and_the_valid_keys():
    with pytest.raises(ConfigError) as e:
        ConnectorConfig.from_extra_config({"chunk_sise": 256})
    assert "chunk_sise" in str(e.value) and "chunk_size" in str(e.value)
    assert "memory_capacity" in str(e.value)


@pytest.mark.parametrize("extra, named", [
    ({"chunk_size": 0}, "chunk_size"), ({"chunk_size": "256"}, "chunk_size"),
    ({"chunk_size": True}, "chunk_size"), ({"memory_capacity": "lots"}, "memory_capacity"),
    ({"memory_capacity": -5}, "memory_capacity"), ({"memory_capacity": "3 parsecs"}, "units"),
    ({"namespace": "a b"}, "namespace"), ({"save_decode_chunks": "yes"}, "save_decode_chunks"),
])
def test_bad_values_name_the_key(extra, named):
    with pytest.raises(ConfigError, match=named):
        ConnectorConfig.from_extra_config(extra)


def test_chunk_size_must_be_a_multiple_of_block_size():
    cfg = ConnectorConfig.from_extra_config({"chunk_size": 200})
    cfg.check_block_size(8)
    with pytest.raises(ConfigError, match="block_size=16.*valid choices include \\[16, 32"):
        cfg.check_block_size(16)


REDIS = {"redis_url": "redis://127.0.0.1:6379"}


def test_secrets_come_from_the_environment_or_a_file(monkeypatch, tmp_path):
    monkeypatch.setenv("KVC_TEST_PW", "pw-from-env")
    (tmp_path / "mac").write_text("a-shared-secret-of-32-characters\n")
    cfg = ConnectorConfig.from_extra_config(
        {**REDIS, "redis_password_env": "KVC_TEST_PW",
         "chunk_mac_key_file": str(tmp_path / "mac")})
    assert cfg.secret("redis_password") == b"pw-from-env"
    assert cfg.secret("chunk_mac_key") == b"a-shared-secret-of-32-characters"
    # The config (which vLLM prints) names where the secrets are, never what they are.
    assert "pw-from-env" not in repr(cfg) and "shared-secret" not in repr(cfg)
    assert ConnectorConfig.from_extra_config(REDIS).secret("redis_password") is None


@pytest.mark.parametrize("extra, message", [
    ({**REDIS, "redis_password_env": "KVC_TEST_UNSET"},
     "redis_password_env: the environment variable KVC_TEST_UNSET is not set"),
    ({**REDIS, "redis_password_file": "/nonexistent/pw"},
     "redis_password_file: cannot read /nonexistent/pw"),
    ({**REDIS, "redis_password_env": "X", "redis_password_file": "/x"},
     "give redis_password_env or redis_password_file, not both"),
    ({"chunk_mac_key_env": "KVC_TEST_MAC"}, "chunk_mac_key_env needs redis_url"),
    ({**REDIS, "chunk_mac_key_env": "KVC_TEST_SHORT"},
     "chunk_mac_key: the secret has 5 bytes; use at least 16"),
])
def test_bad_secrets_name_the_key(monkeypatch, extra, message):
    monkeypatch.delenv("KVC_TEST_UNSET", raising=False)
    monkeypatch.setenv("KVC_TEST_SHORT", "short")
    with pytest.raises(ConfigError, match=message):
        ConnectorConfig.from_extra_config(extra)


def test_memory_capacity_must_hold_a_chunk():
    cfg = ConnectorConfig.from_extra_config({"memory_capacity": "1KiB"})
    with pytest.raises(ConfigError, match=r"memory_capacity=1KiB holds no chunk: one chunk of "
                                          r"256 tokens is 32MiB .* use at least '32MiB'"):
        cfg.memory_slots(32 << 20)
    assert ConnectorConfig.from_extra_config({"memory_capacity": "100MiB"}).memory_slots(
        32 << 20) == 3


def test_memory_capacity_above_what_the_machine_has_is_refused():
    cfg = ConnectorConfig.from_extra_config({"memory_capacity": "10TB"})
    with pytest.raises(ConfigError, match=r"memory_capacity=9.1TiB is more than this machine "
                                          r"can give: 16GiB available now, of 32GiB"):
        cfg.check_memory_available(16 << 30, 32 << 30)
    cfg.check_memory_available(10 ** 13, 10 ** 13)
    with pytest.raises(ConfigError, match=r"available now, of 32GiB, once vLLM took 20GiB for "
                                          r"its KV cache; lower memory_capacity or vLLM's KV "
                                          r"cache \(kv_cache_memory_bytes"):
        cfg.check_memory_available(16 << 30, 32 << 30, kv_cache_bytes=20 << 30)


def _doc_default(key: str, value: object) -> str:
    """A default as docs/configuration.md writes it."""
    if value is None:
        return "none"
    if key == "memory_capacity":
        return f'`"{human_size(value)}"`'
    if isinstance(value, float):
        return f"`{value:g}`"
    return f"`{json.dumps(value)}`"


def test_the_docs_tables_hold_every_key_with_its_default():
    """docs/configuration.md stays true to the schema: every key, its default, and the
    keys a request may override."""
    doc = (Path(__file__).resolve().parent.parent / "docs" / "configuration.md").read_text()
    cfg = ConnectorConfig()
    for prefix, cls, obj in (("", ConnectorConfig, cfg), ("blend_", BlendConfig, cfg.blending)):
        for key, (f, s) in settings(cls, prefix).items():
            assert s.doc, f"{key}: no doc"
            row = f"| `{key}` | {_doc_default(key, getattr(obj, f.name))} |"
            assert row in doc, f"docs/configuration.md has no row {row}"
    overrides = doc[doc.index("A request can override"):doc.index("`kv_transfer_params`")]
    assert set(re.findall(r"`(\w+)`", overrides)) == REQUEST_KEYS


@pytest.mark.parametrize("kind, good, bad, message", [
    ("int", 3, 0, "k: expected a positive integer, got 0"),
    ("ratio", 1, float("nan"), "k: expected a number from 0 to 1, got nan"),
    ("number", 2, float("nan"), "k: expected a positive number, got nan"),
    ("url", "redis://pw@h", "http://pw@h", r"k: expected a URL starting with one of \("),
    ("ids", [1, 2], [1, True], "k: expected a non-empty list of token ids, got"),
])
def test_the_checker_names_the_key_and_what_it_expects(kind, good, bad, message):
    s = Setting(kind, lo=1, choices=("redis://",))
    check("k", s, good)
    with pytest.raises(ConfigError, match=message) as e:
        check("k", s, bad)
    assert "pw" not in str(e.value)  # a URL may hold a password: never echoed


def test_a_lone_requests_fetch_bound_is_larger_where_redis_loads_go_by_layer():
    mib = 1 << 20
    plain = ConnectorConfig.from_extra_config({})
    redis = ConnectorConfig.from_extra_config({"redis_url": "redis://127.0.0.1:6379"})
    assert plain.sync_fetch_max_bytes(by_layer=True) == 64 * mib  # no Redis: disk only
    assert redis.sync_fetch_max_bytes(by_layer=False) == 64 * mib
    assert redis.sync_fetch_max_bytes(by_layer=True) == 256 * mib
    for asked in (0, 32):
        cfg = ConnectorConfig.from_extra_config({"redis_url": "redis://127.0.0.1:6379",
                                                 "sync_fetch_max_mib": asked})
        assert cfg.sync_fetch_max_bytes(by_layer=True) == asked * mib


def test_loads_go_by_layer_for_deep_models_unless_told():
    auto = ConnectorConfig.from_extra_config({})
    assert auto.load_by_layer == "auto"
    assert auto.by_layer(30) and auto.by_layer(8) and not auto.by_layer(2)
    assert ConnectorConfig.from_extra_config({"load_by_layer": True}).by_layer(2)
    assert not ConnectorConfig.from_extra_config({"load_by_layer": False}).by_layer(30)
    with pytest.raises(ConfigError, match="load_by_layer"):
        ConnectorConfig.from_extra_config({"load_by_layer": "yes"})


@pytest.mark.parametrize("extra, problem", [
    ({"redis_key_mirror": True}, "needs redis_url"),
    ({"redis_key_mirror": True, "redis_url": "redis+cluster://h:7000"}, "Redis Cluster"),
    ({"redis_key_mirror": "yes", "redis_url": "redis://h:6379"}, "expected true or false"),
])
def test_the_key_mirror_is_refused_where_it_cannot_work(extra, problem):
    with pytest.raises(ConfigError, match=problem):
        ConnectorConfig.from_extra_config(extra)
    assert ConnectorConfig.from_extra_config(
        {"redis_key_mirror": True, "redis_url": "redis://h:6379"}).redis_key_mirror
