"""LMCache configurations (YAML files as LMCache documents them, LMCACHE_* variables,
``lmcache.*`` keys) read as kvconnector settings: mapped, accepted or refused by name."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvconnector import lmcache_config
from kvconnector.blend.config import BLEND_KEYS
from kvconnector.config import ConfigError, ConnectorConfig
from kvconnector.config_schema import settings
from kvconnector.lmcache_config import RULES, translate

ROOT = Path(__file__).resolve().parent.parent
GIB = 1 << 30

REDIS_YAML = """\
# LMCache: CPU offloading with a Redis remote backend
chunk_size: 256
local_cpu: True
max_local_cpu_size: 5.0

remote_url: "redis://localhost:6379"
remote_serde: "naive"
"""

TUNED_YAML = """\
chunk_size: 512
pre_caching_hash_algorithm: "sha256_cbor"

local_cpu: true
max_local_cpu_size: 80.0

remote_url: "rediss://cache.internal:6380/2"
remote_serde: "naive"

local_disk: null
max_local_disk_size: 0

save_decode_cache: true
cache_policy: "LRU"
numa_mode: null
"""

UNSUPPORTED_YAML = """\
chunk_size: 256
local_device: "cpu"
local_cpu: False
local_disk: 5
max_local_disk_size: -1
remote_url: "lm://localhost:65432"
remote_serde: "cachegen"
use_layerwise: True
save_unfull_chunk: True
"""

BLEND_YAML = """\
chunk_size: 256
local_cpu: True
max_local_cpu_size: 5
enable_blending: True
blend_special_str: " # # "
blend_recompute_ratios: 0.15
blend_check_layers: 1
use_layerwise: False
"""

VALKEY_CLUSTER_YAML = """\
chunk_size: 256
remote_url: "valkey://10.0.0.1:7000,10.0.0.2:7000,10.0.0.3:7000"
extra_config:
  valkey_mode: "cluster"
  valkey_username: "kv"
"""


@pytest.fixture(autouse=True)
def no_lmcache_env(monkeypatch):
    import os

    for name in list(os.environ):
        if name.startswith("LMCACHE_"):
            monkeypatch.delenv(name)


def write(tmp_path: Path, text: str, name: str = "lmcache.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def refusals(extra: dict) -> list[str]:
    with pytest.raises(ConfigError) as e:
        ConnectorConfig.from_extra_config(extra)
    return [line.strip() for line in str(e.value).splitlines()[1:]]


def test_redis_file_maps_to_the_same_settings(tmp_path):
    path = write(tmp_path, REDIS_YAML)
    cfg = ConnectorConfig.from_extra_config({"lmcache_config_file": path})
    assert cfg.chunk_size == 256
    assert cfg.memory_capacity == 5 * GIB  # LMCache's GB are GiB
    assert cfg.redis_url == "redis://localhost:6379"
    assert cfg.save_decode_chunks is False  # LMCache's default, not kvconnector's
    _, tr = translate({"lmcache_config_file": path})
    assert tr.sources["redis_url"] == f"LMCache file {path} (remote_url)"
    assert tr.sources["save_decode_chunks"] == "LMCache default (save_decode_cache)"
    assert any(a.startswith("remote_serde") for a in tr.accepted)


def test_tuned_file_and_accepted_defaults(tmp_path):
    cfg = ConnectorConfig.from_extra_config({"lmcache_config_file": write(tmp_path,
                                                                          TUNED_YAML)})
    assert (cfg.chunk_size, cfg.memory_capacity, cfg.save_decode_chunks) == (512, 80 * GIB,
                                                                             True)
    assert cfg.redis_url == "rediss://cache.internal:6380/2"


def test_kvconnector_keys_override_lmcache_ones(tmp_path):
    cfg = ConnectorConfig.from_extra_config({
        "lmcache_config_file": write(tmp_path, REDIS_YAML), "memory_capacity": "1GiB",
        "redis_url": "redis+cluster://10.0.0.1:7000", "lmcache.chunk_size": 512})
    assert cfg.memory_capacity == GIB
    assert cfg.redis_url == "redis+cluster://10.0.0.1:7000"
    assert cfg.chunk_size == 512  # lmcache.* keys override the file, as in LMCache


def test_lmcache_keys_in_extra_config_without_a_file():
    cfg = ConnectorConfig.from_extra_config({
        "lmcache.chunk_size": 512, "lmcache.remote_url": "redis://r:6379",
        "lmcache.local_cpu": True, "lmcache.max_local_cpu_size": 0.5,
        "discard_partial_chunks": True})  # read by LMCache's vLLM connector, unprefixed
    assert (cfg.chunk_size, cfg.redis_url, cfg.memory_capacity) == (512, "redis://r:6379",
                                                                    GIB // 2)
    with pytest.raises(ConfigError, match=r"skip_last_n_tokens=2"):
        ConnectorConfig.from_extra_config({"lmcache.chunk_size": 256,
                                           "skip_last_n_tokens": 2})


def test_local_disk_maps_onto_the_disk_tier(tmp_path):
    """LMCache's ``local_disk`` (a path or a file:// URL) and ``max_local_disk_size`` (GiB)
    become disk_path and disk_capacity; a size of 0 (LMCache's default) leaves ours."""
    d = tmp_path / "kv"
    cfg = ConnectorConfig.from_extra_config({"lmcache.local_disk": f"file://{d}/",
                                             "lmcache.max_local_disk_size": 2.5,
                                             "lmcache.local_disk_path_sharding": "by_gpu"})
    assert (cfg.disk_path, cfg.disk_capacity) == (f"{d}/", int(2.5 * GIB))
    cfg = ConnectorConfig.from_extra_config({"lmcache.local_disk": str(d),
                                             "lmcache.max_local_disk_size": 0})
    assert (cfg.disk_path, cfg.disk_capacity) == (str(d), None)


def test_environment_variables_override_the_file(tmp_path, monkeypatch):
    path = write(tmp_path, REDIS_YAML)
    monkeypatch.setenv("LMCACHE_CONFIG_FILE", path)
    monkeypatch.setenv("LMCACHE_CHUNK_SIZE", "512")
    monkeypatch.setenv("LMCACHE_SAVE_DECODE_CACHE", "True")
    monkeypatch.setenv("LMCACHE_MAX_LOCAL_CPU_SIZE", "2")
    cfg = ConnectorConfig.from_extra_config({"lmcache_config_file": "$LMCACHE_CONFIG_FILE"})
    assert (cfg.chunk_size, cfg.save_decode_chunks, cfg.memory_capacity) == (512, True,
                                                                             2 * GIB)
    monkeypatch.setenv("LMCACHE_REMOTE_SERDE", "cachegen")
    assert any("$LMCACHE_REMOTE_SERDE: remote_serde='cachegen'" in r
               for r in refusals({"lmcache_config_file": path}))


def test_everything_without_a_meaning_is_refused_by_name(tmp_path):
    path = write(tmp_path, UNSUPPORTED_YAML)
    found = refusals({"lmcache_config_file": path})
    expect = {"local_device": "not a key of LMCache", "local_cpu": "always keeps chunks in "
              "host memory", "local_disk": "expected a directory path",
              "max_local_disk_size": "expected a positive size in GB",
              "remote_url": "LMCache's own cache server", "remote_serde": "uncompressed",
              "use_layerwise": "all layers of a chunk"}
    assert len(found) == len(expect), found
    for key, why in expect.items():
        line = next((f for f in found if re.search(rf"\b{key}\b", f)), None)
        assert line is not None, f"{key} not refused: {found}"
        assert why in line and path in line, line
        assert re.search(r"\b(remove|set|use)\b", line), f"no advice in: {line}"


def test_blend_keys_map_onto_kvconnector_blend(tmp_path):
    cfg = ConnectorConfig.from_extra_config({"lmcache_config_file": write(tmp_path, BLEND_YAML)})
    b = cfg.blending
    assert (b.enabled, b.separator, b.recompute_ratio, b.check_layer, b.min_tokens) == (
        True, " # # ", 0.15, 1, 256)  # blend_min_tokens: LMCache's default comes with it
    # Blend switched off (LMCache's default) is fine, and stays off.
    off = ConnectorConfig.from_extra_config({"lmcache.enable_blending": False,
                                             "lmcache.blend_special_str": " # # "})
    assert not off.blending.enabled
    found = refusals({"lmcache.enable_blending": True, "lmcache.blend_thresholds": [0.1]})
    assert len(found) == 1 and "blend_thresholds" in found[0]


def test_valkey_urls(tmp_path):
    cfg = ConnectorConfig.from_extra_config(
        {"lmcache_config_file": write(tmp_path, VALKEY_CLUSTER_YAML)})
    assert cfg.redis_url == "redis+cluster://kv@10.0.0.1:7000"
    extra, _ = translate({"lmcache.remote_url": "valkey://10.0.0.1:6379",
                          "lmcache.extra_config": {"valkey_database": 3}})
    assert extra["redis_url"] == "redis://10.0.0.1:6379/3"
    with pytest.raises(ConfigError, match="valkey_password.*redis_password_env"):
        translate({"lmcache.remote_url": "valkey://h:1",
                   "lmcache.extra_config": {"valkey_password": "hunter2"}})
    with pytest.raises(ConfigError, match=r"extra_config.nixl_backend: it has no equivalent"):
        translate({"lmcache.extra_config": {"nixl_backend": "POSIX"}})


def test_other_remote_urls_are_refused_with_what_to_do():
    with pytest.raises(ConfigError, match=r"Sentinel is not supported: point it at the primary"):
        translate({"lmcache.remote_url": "redis-sentinel://a:26379,b:26379"})
    with pytest.raises(ConfigError, match=r"'s3' is not supported"):
        translate({"lmcache.remote_url": "s3://bucket"})


def test_unreadable_files(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match=r"lmcache_config_file: cannot read .*nope.yaml"):
        ConnectorConfig.from_extra_config({"lmcache_config_file": str(tmp_path / "nope.yaml")})
    monkeypatch.delenv("LMCACHE_CONFIG_FILE", raising=False)
    with pytest.raises(ConfigError, match="environment variable that is not set"):
        ConnectorConfig.from_extra_config({"lmcache_config_file": "$LMCACHE_CONFIG_FILE"})
    with pytest.raises(ConfigError, match="not valid YAML"):
        ConnectorConfig.from_extra_config({"lmcache_config_file": write(tmp_path, "a: [")})
    with pytest.raises(ConfigError, match="chunk_size: expected a positive integer"):
        ConnectorConfig.from_extra_config({"lmcache.chunk_size": "big"})


def test_without_lmcache_settings_nothing_changes():
    assert translate({"memory_capacity": "1GiB"}) == ({"memory_capacity": "1GiB"},
                                                       lmcache_config.Translation())
    assert ConnectorConfig.from_extra_config({}).save_decode_chunks is True


def test_the_docs_table_covers_every_mapped_or_special_key():
    doc = (ROOT / "docs" / "operations.md").read_text()
    table = doc[doc.index("## LMCache"):]
    special = [k for k, r in RULES.items() if r.target or r.refusal != RULES["mp_port"].refusal
               or r.also_ok]
    for key in special:
        assert f"`{key}`" in table, f"docs/operations.md: the LMCache table misses {key}"


def test_a_remote_url_with_no_scheme_is_refused_without_echoing_it():
    """A URL without a scheme may still carry a password: the error names the problem,
    never the URL (issue 21)."""
    with pytest.raises(ConfigError, match="a URL with no scheme") as e:
        lmcache_config._remote_url("user:Pw0rd@host:6379", {})
    assert "Pw0rd" not in str(e.value)


def test_every_mapped_key_maps_onto_a_kvconnector_key():
    known = set(settings(ConnectorConfig)) | BLEND_KEYS
    assert {r.target for r in RULES.values() if r.target} <= known
