"""The start-up check of `tolk worker --device cuda` (workers/engine/device_select.py) with the
real Triton kernels, on the CPU under Triton's interpreter (tests/kernels/triton_interpreter.py):
the eager engine and an engine over the swapped model decode the same greedy tokens on a tiny
random Llama, so the kernels pass and stay swapped in; a swapped norm that computes another
function fails the check, which names the kernels and undoes the swap.
"""

from __future__ import annotations

import pytest

from tests.conftest import tiny_hf_config, tiny_random_models
from tests.kernels.triton_interpreter import checked_in_child
from workers.engine.device_select import check_fast_path
from workers.engine.engine import EngineConfig

pytestmark = pytest.mark.triton

ASKED = EngineConfig(
    model="m", kv_cache_tokens=512, pack_weights=False, screen_lm_head=False, triton_kernels=True
)
PROMPTS = [[5, 9, 2, 7, 31], [8, 1, 3, 3, 40, 14, 15, 16, 2, 9, 10, 41, 42, 43, 44, 45, 46, 47]]


def tiny_llama():
    _, loaded = tiny_random_models(tiny_hf_config("llama", vocab_size=64))
    return loaded


def test_the_kernels_pass_the_check_and_stay_swapped_in(request):
    if checked_in_child(request):
        return
    from workers.engine.triton_swaps import uses_triton_kernels

    loaded = tiny_llama()
    result = check_fast_path(loaded, ASKED, new_tokens=4, prompts=PROMPTS)
    assert result.kernels is None, result.kernels
    assert "2 prompts x 4 greedy tokens" in result.summary
    assert uses_triton_kernels(loaded.model)


def test_a_kernel_computing_another_function_fails_and_is_undone(request, monkeypatch):
    if checked_in_child(request):
        return
    from workers.engine.triton_swaps import TritonRMSNorm, uses_triton_kernels

    forward = TritonRMSNorm.forward
    monkeypatch.setattr(TritonRMSNorm, "forward", lambda self, x: -3.0 * forward(self, x))
    loaded = tiny_llama()
    result = check_fast_path(loaded, ASKED, new_tokens=4, prompts=PROMPTS)
    assert result.kernels is not None and "where the eager path gives" in result.kernels
    assert not uses_triton_kernels(loaded.model)
