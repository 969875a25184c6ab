"""The greedy token of an LM head, exact, from int8 weights screened by an error bound.

Greedy decoding needs only `argmax(x @ W.T)`, not the logits. A float32 LM head reads all of
`W` per step: Gemma 3's 262k x 640 head is 671 MB, ~23 ms on two cores for one row, more than
the rest of a warm request's prefill; at 4-8 rows MKL's GEMM over that width gets slower still.

Screening (the same signature as the reference, `greedy_tokens(x, weight, screen, softcap)`):

1. approximate logits from int8 weights, `kernels.int8_linear` (a quarter of the bytes;
   activations as per-row 16-bit fixed point, on AVX512-VNNI and on AVX2 alike);
2. a rigorous bound on each approximate logit's error, per row `r` and vocab entry `n`:
       |approx - exact| <= a_r * act_n + ||x_r||_2 * wt_n
   where `a_r = max|x_r| / 32767` is the activation step of the 16-bit path (each activation is
   off by at most 0.51 a_r, hence `act_n = 0.51 * s_n * ||q_n||_1`), and `wt_n` is
   `||w_n - s_n q_n||_2` (Cauchy-Schwarz over the weight rounding) plus a float32-rounding term
   `gamma_K * (||w_n||_2 + ||w_n - s_n q_n||_2)`, both precomputed once with upward margins;
3. candidates: every `n` whose upper bound reaches the best lower bound of its row. The true
   argmax is always one of them (its exact logit >= the best lower bound);
4. the candidates' logits recomputed in float32 from the float32 weight (one small GEMM over
   their union), the soft-cap applied, argmax with the lowest index winning ties, as
   `torch.argmax` does.

The result is the float32 head's argmax. The one caveat: the candidates' logits are summed in
a different order than the full GEMM's, so two candidates within float32 rounding of each other
(~1e-6 relative) may resolve differently, a tie that any other GEMM schedule could flip too.
The candidate sets are small: on Gemma 3 and SmolLM2's real hidden states, a few to a few
dozen of 262144 / 49152 entries.

The C++ op (`kernels/cpu/greedy_head.cpp`) runs steps 2-4 in one pass per row; the torch
version of the same rule runs elsewhere. This module is a leaf: it imports torch and the
kernels' own modules only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels import cpu_ops
from kernels.int8_linear import int8_linear, quantize_int8

_ACT_STEPS = 32767.0  # the 16-bit path's activation fixed point: a_r = max|x_r| / 32767
_ACT_ERR = 0.51  # max |x - a_r * round(x / a_r)| in steps, float rounding of x / a_r included


@dataclass(frozen=True)
class Int8Screen:
    """Per-row int8 copy of an LM head's weight and the constants of its error bound."""

    q: Tensor  # [V, K] int8
    scales: Tensor  # [V] float32, symmetric per row: s_n = max|w_n| / 127
    act: Tensor  # [V] float32: 0.51 * s_n * ||q_n||_1, times a_r = max|x_r| / 32767
    wt: Tensor  # [V] float32: ||w_n - s_n q_n||_2 + gamma_K (||w_n||_2 + that), times ||x_r||_2

    @classmethod
    def build(cls, weight: Tensor, chunk: int = 16384) -> Int8Screen:
        """From a float [V, K] weight, in row chunks. float32 throughout: sums of K positive
        terms are within K * 2^-24 of exact, so the 1e-4 margins below keep each constant an
        upper bound; the 2^-22 term covers rounding in `w - s q` itself."""
        v, k = weight.shape
        q = torch.empty(v, k, dtype=torch.int8, device=weight.device)
        scales = torch.empty(v, dtype=torch.float32, device=weight.device)
        act = torch.empty_like(scales)
        wt = torch.empty_like(scales)
        # two float32 dot products of length K (the full GEMM's and ours): 2 gamma_K
        gamma = 2.0 * (k + 2) * 2.0**-24 / (1.0 - (k + 2) * 2.0**-24)
        up = 1.0 + 1e-4
        for lo in range(0, v, chunk):
            w = weight[lo : lo + chunk].detach().float()
            qi, s = quantize_int8(w)  # [c, K] int8, [c]
            qf = qi.float()
            w_norm = w.norm(dim=1) * up
            err = (w - qf * s[:, None]).norm(dim=1) * up + 2.0**-22 * w_norm  # ||w_n - s_n q_n||
            q[lo : lo + chunk] = qi
            scales[lo : lo + chunk] = s
            act[lo : lo + chunk] = _ACT_ERR * s * qf.abs().sum(dim=1) * up
            wt[lo : lo + chunk] = (err + gamma * (w_norm + err)) * up
        return cls(q.contiguous(), scales, act, wt)


def greedy_tokens_reference(
    x: Tensor, weight: Tensor, screen: Int8Screen | None, softcap: float | None
) -> Tensor:
    """x [N, K] float32, weight [V, K] -> [N] long: argmax of the (soft-capped) float32 logits."""
    logits = F.linear(x, weight)  # [N, V]
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return logits.argmax(dim=-1)


def candidates(approx: Tensor, a: Tensor, norm: Tensor, act: Tensor, wt: Tensor) -> Tensor:
    """approx [N, V], row factors a, norm [N, 1], entry constants act, wt [V] -> [N, V] bool:
    every entry whose upper value (approx + bound, bound = a * act + norm * wt) reaches its
    row's best lower value. The rule of both screens (the int4 one: kernels/int8_head_screen.py)
    in torch ops; the C++ ops apply the same."""
    bound = torch.addcmul(a * act, norm, wt)  # [N, V]
    # float32 rounding of approx +- bound: a margin of a few ulps of the largest logit
    slack = approx.abs().amax(dim=-1, keepdim=True) * 1e-6  # [N, 1]
    best_lower = (approx - bound).amax(dim=-1, keepdim=True)  # [N, 1]
    return approx + bound + slack >= best_lower


def screen_candidates(x: Tensor, approx: Tensor, screen: Int8Screen) -> Tensor:
    """x [N, K] float32, approx [N, V] its int8 logits -> [N, V] bool: the entries that may
    hold each row's maximum logit (torch ops; the C++ op applies the same rule)."""
    a = x.abs().amax(dim=-1, keepdim=True) * (1.0 + 1e-6) / _ACT_STEPS  # [N, 1]
    norm = x.norm(dim=-1, keepdim=True) * (1.0 + 1e-5)  # [N, 1]
    return candidates(approx, a, norm, screen.act, screen.wt)


def _screened_argmax_torch(
    x: Tensor, approx: Tensor, weight: Tensor, screen: Int8Screen, softcap: float | None
) -> Tensor:
    cand = screen_candidates(x, approx, screen)  # [N, V]
    union = cand.any(dim=0).nonzero().squeeze(1)  # [U] ascending vocab ids
    logits = F.linear(x, weight.index_select(0, union))  # [N, U] float32
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    logits = logits.masked_fill(~cand.index_select(1, union), float("-inf"))
    return union[logits.argmax(dim=-1)]


def greedy_tokens(
    x: Tensor, weight: Tensor, screen: Int8Screen | None, softcap: float | None
) -> Tensor:
    """x [N, K] float32, weight [V, K] float32 -> [N] long, the float32 head's argmax.

    Screened when given an `Int8Screen`: the C++ op `tolk::screened_argmax` on the CPU once
    `kernels.cpu_ops.load()` succeeded, torch ops elsewhere; without one, the reference."""
    if screen is None:
        return greedy_tokens_reference(x, weight, screen, softcap)
    approx = int8_linear(x, screen.q, screen.scales)  # [N, V]
    if x.device.type == "cpu" and x.dtype == torch.float32 and cpu_ops.LOADED:
        return torch.ops.tolk.screened_argmax(x, approx, weight, screen.act, screen.wt, softcap)
    return _screened_argmax_torch(x, approx, weight, screen, softcap)
