"""Which real vLLM requests may share KV by token ids alone."""

from __future__ import annotations

import torch
from vllm import SamplingParams
from vllm.lora.request import LoRARequest
from vllm.v1.request import Request

from kvconnector.compat import uncacheable_reason


def _request(**kw) -> Request:
    return Request("r", kw.pop("prompt_token_ids", [1, 2, 3]), SamplingParams(max_tokens=1),
                   None, **kw)


def test_plain_requests_are_cached():
    assert uncacheable_reason(_request()) is None
    assert uncacheable_reason(_request(cache_salt="tenant")) is None  # salt goes in the key


def test_lora_requests_are_not_cached():
    lora = LoRARequest("adapter", 1, "/nonexistent/adapter")
    assert uncacheable_reason(_request(lora_request=lora)) == "LoRA adapter"


def test_prompt_embeddings_are_not_cached():
    assert uncacheable_reason(_request(prompt_embeds=torch.zeros(3, 8))) == "prompt embeddings"


def test_a_request_can_keep_out_of_the_cache(caplog):
    def with_params(params):
        sp = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": params})
        return Request("r", [1, 2, 3], sp, None)

    assert uncacheable_reason(with_params({"kvconnector": False})) == \
        "kv_transfer_params: kvconnector false"
    assert uncacheable_reason(with_params({"kvconnector": True})) is None
    assert uncacheable_reason(with_params({"blend": True})) is None
    assert uncacheable_reason(with_params({"kvconnector": "no"})) is None  # ignored, said
    assert "expected true or false" in caplog.text
