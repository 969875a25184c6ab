"""kernels.greedy_head: the screened int8 head gives the float32 head's argmax.

The C++ op and the torch version of the screen against `greedy_tokens_reference`, on random
heads, soft-capped heads, and constructed near-ties below the int8 error; the error bound itself
against float64 logits.
"""

from __future__ import annotations

import pytest
import torch

from kernels.greedy_head import (
    Int8Screen,
    greedy_tokens,
    greedy_tokens_reference,
    screen_candidates,
)
from kernels.int8_linear import int8_linear

pytestmark = pytest.mark.usefixtures("cpu_ops_built")


def _head(v: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(v, k, generator=gen) * 0.05
    x = torch.randn(33, k, generator=gen) * 2.0
    x[:, 0] *= 20  # an outlier channel, as final hidden states have
    return weight, x


@pytest.mark.parametrize("v,k", [(5000, 64), (3001, 577), (40, 8)])
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_screened_argmax_equals_the_float32_head(path: str, v: int, k: int, softcap) -> None:
    weight, x = _head(v, k)
    screen = Int8Screen.build(weight, chunk=1000)  # several build chunks
    for n in (1, 2, 5, 33):
        want = greedy_tokens_reference(x[:n], weight, None, softcap)
        got = greedy_tokens(x[:n], weight, screen, softcap)
        assert got.dtype == torch.long and got.shape == (n,)
        assert torch.equal(got, want), (n, got, want)


def test_near_ties_below_the_int8_error_resolve_exactly(path: str) -> None:
    """Per row, two candidate rows whose exact logits differ by 1e-3 while int8 rounding moves
    each by ~1e-2: int8 alone orders some wrongly, the exact recomputation orders all."""
    gen = torch.Generator().manual_seed(1)
    k, v, rows = 256, 2000, 16
    x = torch.randn(rows, k, generator=gen)
    weight = torch.randn(v, k, generator=gen) * 0.02
    winners = []
    for r in range(rows):
        u = x[r] / x[r].norm()
        noise = torch.randn(2, k, generator=gen) * 0.01
        noise -= (noise @ u)[:, None] * u  # no effect on this row's logits
        win, lose = (100 + 2 * r, 101 + 2 * r) if r % 2 else (101 + 2 * r, 100 + 2 * r)
        weight[lose] = 2.0 * u + noise[0]
        weight[win] = 2.0 * u + noise[1] + 1e-3 / x[r].norm() * u  # exact logit +1e-3
        winners.append(win)
    exact = (x.double() @ weight.double().T).argmax(dim=-1)
    assert exact.tolist() == winners
    screen = Int8Screen.build(weight)
    approx = int8_linear(x, screen.q, screen.scales)
    assert (approx.argmax(dim=-1) != exact).sum() >= 3  # int8 alone: a coin flip per row
    assert torch.equal(greedy_tokens_reference(x, weight, None, None), exact)
    assert torch.equal(greedy_tokens(x, weight, screen, None), exact)


def test_error_bound_holds_and_keeps_few_candidates() -> None:
    weight, x = _head(20000, 640, seed=2)
    screen = Int8Screen.build(weight)
    approx = int8_linear(x, screen.q, screen.scales)  # the VNNI path where the CPU has it
    exact = x.double() @ weight.double().T
    a = x.abs().amax(dim=-1, keepdim=True).double() / 32767
    bound = a * screen.act.double() + x.double().norm(dim=-1, keepdim=True) * screen.wt.double()
    assert ((approx.double() - exact).abs() <= bound).all()
    cand = screen_candidates(x, approx, screen)
    assert cand[torch.arange(33), exact.argmax(dim=-1)].all()
    assert cand.sum(dim=-1).float().mean() < 200  # of 20000


def test_without_a_screen_it_is_the_reference() -> None:
    weight, x = _head(300, 32)
    want = greedy_tokens_reference(x, weight, None, None)
    assert torch.equal(greedy_tokens(x, weight, None, None), want)


def test_screen_build_shapes() -> None:
    weight, _ = _head(1000, 48)
    s = Int8Screen.build(weight, chunk=256)
    assert s.q.dtype == torch.int8 and s.q.shape == (1000, 48)
    assert s.q.abs().max() <= 127
    assert s.scales.shape == s.act.shape == s.wt.shape == (1000,)
    deq = s.q.float() * s.scales[:, None]
    assert ((weight - deq).norm(dim=1) <= s.wt).all()  # the weight-rounding part of the bound


def test_cpp_op_rejects_bad_input() -> None:
    weight, x = _head(100, 16)
    s = Int8Screen.build(weight)
    approx = int8_linear(x, s.q, s.scales)
    op = torch.ops.tolk.screened_argmax
    with pytest.raises(RuntimeError, match="float32"):
        op(x.double(), approx, weight, s.act, s.wt)
    with pytest.raises(RuntimeError, match="approx must be"):
        op(x, approx[:, :50], weight, s.act, s.wt)
    with pytest.raises(RuntimeError, match="weight must be"):
        op(x, approx, weight[:, :8], s.act, s.wt)
