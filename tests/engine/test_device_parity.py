"""The engine on a CUDA device against transformers on the same device (marked `gpu`).

Tiny randomly initialised Llama and Gemma 3 models (the real checkpoints run through
`bench/gpu.sh`): six prompts share a 40-token prefix, the first one fills the prefix cache and
the other five decode together, so the cascade path of the decode attention runs. Greedy tokens
must equal transformers' in float32; bfloat16 is reported, not asserted (near-ties round apart).
Ran on an H200 (2026-11-29, `pytest -m gpu`, with the CUDA cases of tests/kernels): all passed;
the same check as a script gave 6/6 equal tokens in bfloat16 too.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from workers.engine.engine import Engine, EngineConfig
from workers.engine.types import GenerationRequest, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen2", "qwen3"])
def test_engine_on_cuda_matches_transformers_float32(
    arch: str, tiny_config: Any, tiny_models: Any
) -> None:
    # no soft-caps: a capped attention takes the plain path, and cascade is what runs here
    no_caps = {"attn_logit_softcapping": None, "final_logit_softcapping": None}
    cfg = tiny_config(arch, vocab_size=512, **(no_caps if arch == "gemma3" else {}))
    hf, loaded = tiny_models(cfg, "cuda")
    engine = Engine(loaded, EngineConfig(device="cuda", kv_cache_tokens=4096))
    gen = torch.Generator().manual_seed(1)
    prefix = torch.randint(0, 512, (40,), generator=gen).tolist()
    prompts = [prefix + torch.randint(0, 512, (n,), generator=gen).tolist()
               for n in (3, 5, 9, 12, 17, 20)]  # fmt: skip
    params = SamplingParams(max_new_tokens=24, ignore_eos=True, stop_at_newline=False)
    results = engine.generate([GenerationRequest("first", prompts[0], params)])
    results += engine.generate(
        [GenerationRequest(f"r{i}", p, params) for i, p in enumerate(prompts[1:])]
    )
    assert [r.cached_tokens for r in results[1:]] == [32] * 5  # two full 16-token blocks
    with torch.inference_mode():
        for prompt, result in zip(prompts, results, strict=True):
            x = torch.tensor([prompt], device="cuda")
            y = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                            max_new_tokens=24, eos_token_id=None, pad_token_id=0)  # fmt: skip
            assert y[0, len(prompt) :].tolist() == result.token_ids
