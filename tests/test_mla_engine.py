"""An MLA model (tiny random-weight DeepSeek-V2) on a real engine: vLLM registers its KV as
``[blocks, 1, block_size, 576]`` latents, which the connector stores and loads back."""

from __future__ import annotations

import pytest

from tests.conftest import prompt, run_engine

pytestmark = pytest.mark.engine

CHUNK = 256
BLOCK = 16  # the CPU build's MLA block size: a real engine at GPU-sized blocks
P1 = prompt(1, 700)
HIT = (len(P1) - 1) // BLOCK * BLOCK  # 688: 2 chunks and 11 blocks of a partial chunk
MEM = {"memory_capacity": "64MiB"}
# vLLM prefers its AMX MLA kernels where the CPU has AMX tiles, and they take bf16 weights
# only; the reference CPU MLA backend runs the fp32 model everywhere.
CPU_MLA = {"attention_backend": "CPU_MLA"}


def test_mla_model_reloads_its_latents(tiny_mla_model, tmp_path_factory):
    base = run_engine(tmp_path_factory.mktemp("mla-base"), {
        "model": tiny_mla_model, "connector": None, "llm": CPU_MLA,
        "steps": [{"op": "generate", "prompts": [P1]}]}, timeout=300)
    res = run_engine(tmp_path_factory.mktemp("mla"), {
        "model": tiny_mla_model, "connector": MEM, "llm": CPU_MLA, "steps": [
            {"op": "generate", "prompts": [P1]},  # 0
            {"op": "generate", "prompts": [P1]},  # 1: both chunks from the store
            {"op": "corrupt", "prompt": P1, "chunk": 0, "reseal": True},  # 2
            {"op": "corrupt", "prompt": P1, "chunk": 1, "reseal": True},  # 3
            {"op": "generate", "prompts": [P1]},  # 4: sealed noise is loaded
            {"op": "totals"}]}, timeout=300)
    want = base[0][0]["tokens"]
    assert res[0][0]["tokens"] == want
    assert res[1][0]["cached"] == HIT and res[1][0]["tokens"] == want
    assert res[2] == [True] and res[3] == [True]
    assert res[4][0]["cached"] == HIT and res[5]["load_errors"] == 0
    assert res[4][0]["tokens"] != want, "the loaded latents were not used"
