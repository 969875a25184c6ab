"""The fused small ops of `kernels/triton_norm_rope.py` against their torch references, and
the references against the model's own modules (`workers/engine/model.py`).

The reference checks run here (plain torch, exact); the kernel cases run in a
`TRITON_INTERPRET=1` child process (tests/kernels/triton_interpreter.py) and assert their
outcome there. Shapes are small and ragged: rows whose width is not a power of two (the
kernel's tile is masked), a slot mapping that skips a token (-1) and writes into partially
filled blocks; float32 and bfloat16. NaN never passes.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")  # torch's Linux wheels bring it; the references import it too

from kernels.triton_norm_rope import (  # noqa: E402
    add_rms_norm_reference,
    rms_norm_reference,
    rope_write_kv_reference,
)
from tests.kernels.triton_interpreter import checked_in_child  # noqa: E402
from workers.engine.model import RMSNorm, apply_rope  # noqa: E402

pytestmark = pytest.mark.triton

DTYPES = [torch.float32, torch.bfloat16]
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {  # (atol, rtol)
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (2e-2, 2e-2),  # the interpreter's bfloat16 casts round toward zero
}
WIDTH = 40  # hidden size: not a power of two, so the kernel's tile is masked


def norm_inputs(dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(5, WIDTH, generator=gen) * 3).to(dtype)
    residual = torch.randn(5, WIDTH, generator=gen).to(dtype)
    weight = (torch.randn(WIDTH, generator=gen) * 0.3 + 1).to(dtype)
    pre_weight = (torch.randn(WIDTH, generator=gen) * 0.3).to(dtype)
    return x, residual, weight, pre_weight


def assert_matches(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert torch.isfinite(out).all(), "the kernel returned NaN or inf"
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("one_plus", [False, True])
def test_rms_norm_reference_is_the_model_norm(dtype, one_plus):
    """Bit for bit: the kernel's reference is the model's `RMSNorm` (Llama `w`, Gemma `1 + w`)."""
    x, _, weight, _ = norm_inputs(dtype)
    norm = RMSNorm(WIDTH, 1e-6, one_plus).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
    assert torch.equal(rms_norm_reference(x, norm.weight, 1e-6, one_plus), norm(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_reference_is_the_model_rope(dtype):
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(4, 3, 16, generator=gen).to(dtype)
    k = torch.randn(4, 1, 16, generator=gen).to(dtype)
    cos = torch.randn(4, 16, generator=gen).to(dtype)
    sin = torch.randn(4, 16, generator=gen).to(dtype)
    k_cache = torch.zeros(3, 4, 1, 16, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([1, 2, 3, 4])
    q_rot, k_rot = rope_write_kv_reference(q, k, k, cos, sin, k_cache, v_cache, slots)
    assert torch.equal(q_rot, apply_rope(q, cos, sin))
    assert torch.equal(k_rot, apply_rope(k, cos, sin))
    assert torch.equal(k_cache.view(-1, 1, 16)[1:5], k_rot)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("one_plus", [False, True])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("with_pre_norm", [False, True])
def test_add_rms_norm_matches_reference(
    request, dtype, one_plus, with_residual, with_pre_norm
):  # fmt: skip
    if checked_in_child(request):
        return
    from kernels import triton_norm_rope as nr

    x, residual, weight, pre_weight = norm_inputs(dtype, seed=3)
    args = (
        x,
        residual if with_residual else None,
        weight,
        1e-6,
        one_plus,
        pre_weight if with_pre_norm else None,
    )
    normed, summed = nr.add_rms_norm(*args)
    ref_normed, ref_summed = add_rms_norm_reference(*args)
    assert_matches(summed, ref_summed, dtype)
    assert_matches(normed, ref_normed, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fused_view", [False, True])
def test_rope_write_kv_matches_reference(request, dtype, fused_view):
    """RoPE on q and k and the K/V write at the slots; `fused_view`: q, k, v are strided views
    of one fused q/k/v projection's output, as the Llama path gives them."""
    if checked_in_child(request):
        return
    from kernels import triton_norm_rope as nr

    t, h, kvh, d, bs, blocks = 6, 6, 2, 16, 4, 10
    gen = torch.Generator().manual_seed(4)
    if fused_view:
        qkv = torch.randn(t, (h + 2 * kvh) * d, generator=gen).to(dtype)
        q = qkv[:, : h * d].view(t, h, d)
        k = qkv[:, h * d : (h + kvh) * d].view(t, kvh, d)
        v = qkv[:, (h + kvh) * d :].view(t, kvh, d)
    else:
        q = torch.randn(t, h, d, generator=gen).to(dtype)
        k = torch.randn(t, kvh, d, generator=gen).to(dtype)
        v = torch.randn(t, kvh, d, generator=gen).to(dtype)
    positions = torch.tensor([0, 1, 2, 7, 8, 30]).float()
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    emb = torch.cat([positions[:, None] * inv_freq] * 2, dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    slots = torch.tensor([5, 6, 7, -1, 12, 33])  # token 3 is not written
    k_cache = torch.randn(blocks, bs, kvh, d, generator=gen).to(dtype)
    v_cache = torch.randn(blocks, bs, kvh, d, generator=gen).to(dtype)
    ref_k_cache, ref_v_cache = k_cache.clone(), v_cache.clone()
    q_rot, k_rot = nr.rope_write_kv(q, k, v, cos, sin, k_cache, v_cache, slots)
    ref_q, ref_k = rope_write_kv_reference(q, k, v, cos, sin, ref_k_cache, ref_v_cache, slots)
    assert_matches(q_rot, ref_q, dtype)
    assert_matches(k_rot, ref_k, dtype)
    assert_matches(k_cache, ref_k_cache, dtype)  # written slots, and nothing else touched
    assert torch.equal(v_cache, ref_v_cache)  # v is copied, not computed
