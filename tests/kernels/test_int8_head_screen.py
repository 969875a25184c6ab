"""kernels.int8_head_screen: an int8 head's argmax from its int4 copy and the rescored candidates.

Against `int8_head_argmax_reference` (the full head through `tolk::int8_linear`), the C++
candidate pass against the torch one, the margin against the error it covers, and a zero margin
to show that the margin and the rescoring are what make the tokens right.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels.int4_linear import int4_linear, runs_vector_loop
from kernels.int8_head_screen import (
    Int4Screen,
    candidate_union,
    int8_head_argmax_reference,
    int8_head_logprob_reference,
    row_factors,
    screened_int8_argmax,
    screened_int8_argmax_logprob,
)
from kernels.int8_linear import int8_linear, quantize_int8

pytestmark = pytest.mark.usefixtures("cpu_ops_built")


def _head(v: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An int8 head whose rows cluster (as token embeddings do) and hidden rows aimed at some
    rows, so each row's top logits stand out of the crowd by a little: (q, scales, x [9, K])."""
    gen = torch.Generator().manual_seed(seed)
    centres = torch.randn(16, k, generator=gen)
    weight = (centres[torch.randint(0, 16, (v,), generator=gen)] * 0.5
              + torch.randn(v, k, generator=gen)) * 0.05  # fmt: skip
    targets = torch.randint(0, v, (9,), generator=gen)
    x = weight[targets] * 30 + torch.randn(9, k, generator=gen)
    x[:, 3] *= 8  # an outlier channel, as final hidden states have
    q, scales = quantize_int8(weight)
    return q, scales, x


@pytest.mark.parametrize("v,k", [(6000, 64), (3001, 640), (40, 32)])
@pytest.mark.parametrize("softcap", [None, 30.0])  # Gemma 2's cap: logits ~2x it, no saturation
def test_screened_argmax_equals_the_full_int8_head(path: str, v: int, k: int, softcap) -> None:
    q, scales, x = _head(v, k)
    screen = Int4Screen.build(q, scales, chunk=1024)  # several build chunks
    for n in (1, 2, 4):  # the op's streamed rows: each output row computed alone
        want = int8_head_argmax_reference(x[:n], q, scales, softcap)
        got = screened_int8_argmax(x[:n], q, scales, screen, softcap)
        assert got.dtype == torch.long and got.shape == (n,)
        assert torch.equal(got, want), (n, got, want)
    # more rows: blocks of 4 weight rows; a whole-block vocabulary is computed alike
    if v % 4 == 0:
        want = int8_head_argmax_reference(x, q, scales, softcap)
        assert torch.equal(screened_int8_argmax(x, q, scales, screen, softcap), want)


@pytest.mark.parametrize("v,k", [(6000, 64), (3001, 640)])
@pytest.mark.parametrize("softcap", [None, 30.0])
def test_screened_log_probability_is_the_full_int8_heads(v: int, k: int, softcap) -> None:
    """The token as `screened_int8_argmax`'s, its log-softmax within 0.01 of the full head's:
    the normaliser's entries outside the candidates are int4 approximations."""
    q, scales, x = _head(v, k, seed=2)
    x[4:] *= 0.05  # flat rows too: many entries share the normaliser, the tail's error counts
    screen = Int4Screen.build(q, scales, chunk=1024)
    want_tokens, want = int8_head_logprob_reference(x, q, scales, softcap)
    tokens, got = screened_int8_argmax_logprob(x, q, scales, screen, softcap)
    assert torch.equal(tokens, screened_int8_argmax(x, q, scales, screen, softcap))
    assert torch.equal(tokens, want_tokens)
    assert got.shape == (9,) and got.dtype == torch.float32
    assert (got <= 0).all() and (want[4:] < -1.0).all()  # the flat rows are far from certain
    assert torch.allclose(got, want, atol=0.01), (got - want).abs().max()


def test_cpp_and_torch_candidate_passes_agree() -> None:
    q, scales, x = _head(20000, 640, seed=1)
    screen = Int4Screen.build(q, scales)
    for n in (1, 3, 9):
        approx = int4_linear(x[:n], screen.w, screen.scales, screen.mins)
        cpp = torch.ops.tolk.int4_screen_union(x[:n], approx, screen.norm, screen.err)
        assert torch.equal(cpp, candidate_union(x[:n], approx, screen))
        assert torch.all(cpp[1:] > cpp[:-1])  # ascending, no repeats


def test_the_margin_covers_the_error_and_leaves_few_candidates() -> None:
    q, scales, x = _head(20000, 640, seed=2)
    screen = Int4Screen.build(q, scales)
    approx = int4_linear(x, screen.w, screen.scales, screen.mins)
    target = int8_linear(x, q, scales)
    dx, xn = row_factors(x)
    margin = dx[:, None] * screen.norm + xn[:, None] * screen.err  # 6 estimated deviations
    ratio = (approx - target).abs() / margin
    assert ratio.max() < 1.0  # every error inside the margin
    assert ratio.max() > 0.05  # and the margin not wildly loose
    union = candidate_union(x, approx, screen)
    assert set(target.argmax(dim=-1).tolist()) <= set(union.tolist())
    assert union.numel() < 2000  # of 20000, for 9 rows


def test_without_the_margin_the_int4_order_decides_and_is_wrong() -> None:
    """Near-ties below the int4 error: with no margin the candidates are the int4 argmaxes
    alone, and some rows get the wrong token; with it, every row gets the int8 head's."""
    gen = torch.Generator().manual_seed(3)
    k, v, rows = 256, 2000, 64
    x = torch.randn(rows, k, generator=gen)
    weight = torch.randn(v, k, generator=gen) * 0.02
    for r in range(rows):  # per row two rows of nearly equal logits, above all others
        u = x[r] / x[r].norm()
        weight[100 + 2 * r] = 2.0 * u + torch.randn(k, generator=gen) * 0.02
        weight[101 + 2 * r] = 2.0 * u + torch.randn(k, generator=gen) * 0.02
    q, scales = quantize_int8(weight)
    screen = Int4Screen.build(q, scales)
    want = int8_head_argmax_reference(x, q, scales, None)
    assert torch.equal(screened_int8_argmax(x, q, scales, screen, None), want)
    blind = dataclasses.replace(
        screen, err=torch.zeros_like(screen.err), norm=torch.zeros_like(screen.norm)
    )
    got = torch.stack([screened_int8_argmax(x[r : r + 1], q, scales, blind, None)[0]
                       for r in range(rows)])  # fmt: skip
    assert (got != want).sum() >= 3


def test_screen_build_shapes_and_constants() -> None:
    q, scales, _ = _head(1000, 96)
    s = Int4Screen.build(q, scales, chunk=256)
    assert s.w.dtype == torch.uint8 and s.w.shape == (1000, 48)
    assert s.scales.shape == s.mins.shape == (1000, 3)
    assert s.err.shape == s.norm.shape == (1000,)
    assert (s.err > 0).all() and (s.norm > s.err).all()  # int4 is close, not exact
    assert Int4Screen.applies(q) and not Int4Screen.applies(q[:, :40])  # K % 32


def test_the_vector_loop_probe_says_what_the_cpu_has() -> None:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        flags = set(next(line for line in f if line.startswith("flags")).split())
    vnni = {"avx512_vnni", "avx512bw", "avx512f"} <= flags
    avx2 = {"avx2", "fma", "f16c"} <= flags
    assert runs_vector_loop() == (vnni or avx2)


def test_cpp_candidate_pass_rejects_bad_input() -> None:
    q, scales, x = _head(100, 32)
    s = Int4Screen.build(q, scales)
    approx = int4_linear(x, s.w, s.scales, s.mins)
    op = torch.ops.tolk.int4_screen_union
    with pytest.raises(RuntimeError, match="float32"):
        op(x, approx.double(), s.norm, s.err)
    with pytest.raises(RuntimeError, match="rows"):
        op(x[:3], approx, s.norm, s.err)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        op(x[:, :20], approx, s.norm, s.err)
    with pytest.raises(RuntimeError, match="entries"):
        op(x, approx, s.norm[:50], s.err)
