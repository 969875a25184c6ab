"""kernels.int8_linear: the C++ op against the float64 reference, on both of its inner loops."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_ops
from kernels.int8_linear import int8_linear, int8_linear_reference, quantize_int8

# (M, K, N): decode shapes of SmolLM2 (fused qkv, down) and Gemma 3, tails in K and N, M at
# and past the streamed loop's 4 rows (above 4: the 4x4-row tiles), and K past one 4096-column
# int32 chunk of the VNNI loop (on both loops)
SHAPES = [(1, 576, 960), (1, 1536, 576), (3, 575, 577), (5, 64, 6), (33, 576, 192),
          (2, 9000, 8), (6, 9000, 5), (1, 7, 3), (4, 640, 1030), (8, 2048, 64)]  # fmt: skip


@pytest.fixture(scope="module")
def cpu_op() -> None:
    if not cpu_ops.load():
        pytest.fail(f"tolk's C++ ops did not build: {cpu_ops.error()}")


def _case(m: int, k: int, n: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    w, s = quantize_int8(torch.randn(n, k, generator=gen))
    x = torch.randn(m, k, generator=gen)
    x[:, 0] *= 30  # an outlier channel, as real hidden states have
    exact = (x.double() @ w.double().T) * s.double()
    return x, w, s, exact


@pytest.mark.parametrize("m,k,n", SHAPES)
def test_exact_float32_loop_matches_reference(cpu_op, m: int, k: int, n: int) -> None:
    x, w, s, exact = _case(m, k, n)
    y = torch.ops.tolk.int8_linear(x, w, s, True)
    assert y.shape == (m, n) and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), exact, atol=1e-4 * k**0.5, rtol=1e-5)


@pytest.mark.parametrize("m,k,n", SHAPES)
def test_default_loop_beats_bfloat16_activations(cpu_op, m: int, k: int, n: int) -> None:
    # The default (VNNI, 16-bit fixed-point activations) must be closer to the exact result
    # than rounding the activations to bfloat16 (what torch's int8 CPU kernel does).
    x, w, s, exact = _case(m, k, n, seed=1)
    y = int8_linear(x, w, s)
    err = (y.double() - exact).abs().max().item()
    bf16 = (x.bfloat16().double() @ w.double().T) * s.double()
    assert err <= (bf16 - exact).abs().max().item() + 1e-6
    assert err <= 1e-3 * exact.abs().max().item()


def test_leading_dims_and_fallbacks(cpu_op) -> None:
    x, w, s, _ = _case(6, 64, 16)
    y = int8_linear(x.view(2, 3, 64), w, s)
    assert y.shape == (2, 3, 16)
    torch.testing.assert_close(y.view(6, 16), int8_linear(x, w, s))
    # bfloat16 activations take the torch reference, in bfloat16
    yb = int8_linear(x.bfloat16(), w, s)
    assert yb.dtype == torch.bfloat16
    torch.testing.assert_close(yb, int8_linear_reference(x.bfloat16(), w, s))


def test_op_rejects_bad_input(cpu_op) -> None:
    x, w, s, _ = _case(1, 32, 8)
    with pytest.raises(RuntimeError, match="features"):
        torch.ops.tolk.int8_linear(torch.ones(1, 31), w, s)
    with pytest.raises(RuntimeError, match="int8"):
        torch.ops.tolk.int8_linear(x, w.float(), s)
