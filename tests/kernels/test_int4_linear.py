"""kernels.int4_linear: the packing, the quantizer's error, and the C++ op against references.

Two yardsticks: the plain float32 loop (`tolk::int4_linear_plain`) computes exactly the
dequantized product (float32 rounding); the default loop (AVX512-VNNI or AVX2) quantizes
activations to int8 per group of 32, so it must equal that quantization's product exactly when
the activations are representable, and stay well below the weights' own quantization error
otherwise.
"""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_ops
from kernels.int4_linear import (
    dequantize_int4,
    int4_linear,
    int4_linear_reference,
    pack_codes,
    quantize_int4,
    supports,
    unpack_codes,
)

# (M, K, N): Gemma 3 270M's shapes (K 640 = a block of 16 groups + a narrow one of 4),
# SmolLM2's (576 = 16 + 2), a single group, wide last blocks (384 = 12 groups, 896 = 16 + 12),
# M through the 4-, 2- and 1-row tiles, N past the 4-row blocks; one row against last blocks of
# 4 groups (K 640, 128: the AVX2 loop's paired narrow block), 3, 5, 12 and 2 groups
SHAPES = [(1, 640, 1024), (1, 2048, 640), (3, 576, 960), (5, 32, 7), (9, 1536, 13), (1, 640, 10),
          (1, 128, 9), (1, 96, 6), (1, 160, 5), (1, 896, 11), (1, 576, 7),
          (2, 512, 4), (4, 384, 8), (7, 896, 12)]  # fmt: skip


@pytest.fixture(scope="module")
def cpu_op() -> None:
    if not cpu_ops.load():
        pytest.fail(f"tolk's C++ ops did not build: {cpu_ops.error()}")


@pytest.mark.parametrize("k", [32, 64, 96, 512, 544, 640, 2048])
def test_packing_round_trips(k: int) -> None:
    gen = torch.Generator().manual_seed(k)
    codes = torch.randint(0, 16, (5, k), generator=gen, dtype=torch.uint8)
    packed = pack_codes(codes)
    assert packed.shape == (5, k // 2) and packed.dtype == torch.uint8
    assert torch.equal(unpack_codes(packed), codes)


def test_quantization_error_is_half_a_step_then_refined() -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(64, 640, generator=gen) * 0.05
    w[3, 100] = 2.0  # an outlier widens its own group's step only
    packed, scales, mins = quantize_int4(w, refine=0)  # the min / max grid
    assert scales.shape == mins.shape == (64, 20) and scales.dtype == torch.float16
    err = (dequantize_int4(packed, scales, mins) - w).view(64, 20, 32)
    # half a step, plus float16 rounding of the offset and of 15 steps
    bound = scales.float() * 0.5 + 16 * scales.float() * 2**-11 + mins.float().abs() * 2**-11
    assert bool((err.abs().amax(dim=2) <= bound + 1e-7).all())
    assert float(scales[3, 3]) > 5 * float(scales[3, 2])  # group 3 holds column 100
    # the least-squares rounds never raise a group's squared error (beyond float16 rounding)
    refined = (dequantize_int4(*quantize_int4(w)) - w).view(64, 20, 32)
    before, after = (err**2).sum(dim=2), (refined**2).sum(dim=2)
    assert bool((after <= before * 1.01 + 1e-9).all())
    assert float(after.sum()) < 0.95 * float(before.sum())  # measured: ~14 % lower
    assert not supports(48) and supports(64)
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_int4(torch.randn(4, 48))


def _case(m: int, k: int, n: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    packed, scales, mins = quantize_int4(torch.randn(n, k, generator=gen) * 0.05)
    x = torch.randn(m, k, generator=gen)
    x[:, 0] *= 30  # an outlier channel, as real hidden states have
    return x, packed, scales, mins


@pytest.mark.parametrize("m,k,n", SHAPES)
def test_plain_loop_is_the_dequantized_product(cpu_op, m: int, k: int, n: int) -> None:
    x, packed, scales, mins = _case(m, k, n)
    exact = x.double() @ dequantize_int4(packed, scales, mins).double().T
    y = torch.ops.tolk.int4_linear_plain(x, packed, scales, mins)
    assert y.shape == (m, n) and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), exact, atol=1e-4 * k**0.5, rtol=1e-5)


@pytest.mark.parametrize("m,k,n", SHAPES)
def test_default_loop_is_exact_on_representable_activations(cpu_op, m: int, k: int, n: int) -> None:
    # activations that int8-per-group holds exactly: integers with a 127 in every group, times
    # a factor per group; then the fast loop must give the dequantized product
    gen = torch.Generator().manual_seed(1)
    _, packed, scales, mins = _case(m, k, n)
    ints = torch.randint(-127, 128, (m, k // 32, 32), generator=gen).float()
    ints[:, :, 5] = 127
    x = (ints * (torch.rand(m, k // 32, 1, generator=gen) + 0.5)).view(m, k)
    exact = x.double() @ dequantize_int4(packed, scales, mins).double().T
    y = int4_linear(x, packed, scales, mins)
    torch.testing.assert_close(y.double(), exact, atol=1e-4 * k**0.5, rtol=1e-5)


@pytest.mark.parametrize("m,k,n", SHAPES)
def test_default_loop_error_is_small_beside_the_weights(cpu_op, m: int, k: int, n: int) -> None:
    x, packed, scales, mins = _case(m, k, n, seed=2)
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(n, k, generator=gen) * 0.05  # the same weights _case quantized
    true = x.double() @ w.double().T
    exact = x.double() @ dequantize_int4(packed, scales, mins).double().T
    y = int4_linear(x, packed, scales, mins).double()
    act_err = (y - exact).abs().max().item()
    weight_err = (exact - true).abs().max().item()
    assert act_err <= 0.3 * weight_err + 1e-5  # measured: ~0.1-0.2x
    assert act_err <= 3e-2 * exact.abs().max().item()


def test_leading_dims_and_fallbacks(cpu_op) -> None:
    x, packed, scales, mins = _case(6, 64, 16)
    y = int4_linear(x.view(2, 3, 64), packed, scales, mins)
    assert y.shape == (2, 3, 16)
    torch.testing.assert_close(y.view(6, 16), int4_linear(x, packed, scales, mins))
    # bfloat16 activations take the torch reference, in bfloat16
    yb = int4_linear(x.bfloat16(), packed, scales, mins)
    assert yb.dtype == torch.bfloat16
    torch.testing.assert_close(yb, int4_linear_reference(x.bfloat16(), packed, scales, mins))
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.tolk.int4_linear(torch.randn(1, 48), torch.zeros(4, 24, dtype=torch.uint8),
                                   scales[:4, :1], mins[:4, :1])  # fmt: skip


def test_compiled_graph_calls_the_op(cpu_op) -> None:
    x, packed, scales, mins = _case(2, 640, 64)
    fn = torch.compile(lambda a: int4_linear(a, packed, scales, mins) * 2.0, dynamic=False)
    torch.testing.assert_close(fn(x), int4_linear(x, packed, scales, mins) * 2.0)
