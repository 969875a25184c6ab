"""The greedy token of an int8 LM head from an int4 copy of it: about 5/8 of the bytes a step.

With int8 weights (`--quantize int8`, the auto configuration's usual pick) Gemma 3 270M's LM
head is its largest read: 262144 x 640 int8, 168 MB of a step's ~270 MB, 5.2 ms of a 10.9 ms
batch-1 decode step on an AMD EPYC Zen 4 at ~33 GB/s. Greedy decoding needs only the head's
argmax, so, as `kernels/greedy_head.py` does for a float32 head:

1. approximate logits from a group-wise int4 copy of the int8 weights (`kernels.int4_linear`,
   105 MB with its scales; 3.6 vs 6.9 ms for one row on that machine);
2. an error margin per row `r` and entry `n`, `margin = Z * (||x_r|| * err_n + dx_r * norm_n) /
   sqrt(K)`: `err_n = ||w4_n - w8_n||` the int4 copy's distance from the int8 row, `norm_n =
   ||w4_n||`, `dx_r` a bound on the norm of the int4 op's activation rounding (int8 per group of
   32: at most half a step each) plus 1 % for the int8 op's own (16-bit);
3. candidates: every entry whose upper value (approx + margin) reaches the best lower value
   (approx - margin) of its row, their union over the rows (`tolk::int4_screen_union`);
4. the candidates' logits computed by the int8 head's own op (`tolk::int8_linear` on the
   gathered rows, padded to whole blocks of 4 so each row takes the same loop as in the full
   head), the soft-cap applied as `Transformer.compute_logits` does, argmax (lowest id on ties).

`screened_int8_argmax_logprob` also gives the token's log-softmax, its normaliser summed over
the candidates' int8 logits and every other entry's int4 one: a sequence that keeps its tokens'
log-probabilities (the cascade's small-model signal) keeps the screen.

Unlike the float32 screen this margin is not a proof. Cauchy-Schwarz would bound the error
rigorously, but at 25x the error actually seen (sqrt(640)) it leaves ~90k of 262k candidates.
The margin is Z = 6 standard deviations of the error as if the rounding errors were independent
of `x` (a sum of 640 small bounded terms). Measured on real decode rows (850 of Gemma 3 270M,
1,488 of SmolLM2 135M; 2.2e8 and 7.3e7 entries): the error's root mean square is 0.79 of that
estimate, its largest 4.7 (4.8) of it. A wrong token needs the true argmax's error and a rival's
to differ by more than 12 estimates (~10 standard deviations of their difference); otherwise the
screened argmax is the int8 head's. Candidates per row: median 14 / 42, p99 1,412 / 562, largest
2,213 / 3,021 (Gemma 3 / SmolLM2).

A vocabulary that is not a multiple of 4 has its last rows computed by the op's plain loop in
the full head (from the fifth activation row on): there a near-tie may resolve differently. So
may a soft-cap that saturates (|logit| > ~9x the cap rounds tanh to 1 in float32, tying entries
whose logits differ: the full head then takes the lowest id, which may not be a candidate).

Needs the C++ ops with an int4 vector loop (`kernels.int4_linear.runs_vector_loop()`:
AVX512-VNNI or AVX2); elsewhere the caller keeps the full int8 head. A leaf: imports torch and
the kernels' own modules only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from kernels import cpu_ops
from kernels.greedy_head import candidates
from kernels.int4_linear import GROUP, dequantize_int4, int4_linear, quantize_int4, supports
from kernels.int8_linear import int8_linear

Z = 6.0  # the margin in (estimated) standard deviations of an approximate logit's error
_ACT_STEPS = 127.0  # the int4 op's activations: int8 per group of 32, step max|x_g| / 127
_ACT_ERR = 0.51  # max rounding error in steps, float rounding of x / step included
_INT8_OP = 1.01  # the int8 op's own 16-bit activation rounding, ~1/256 of the int4 op's


@dataclass(frozen=True)
class Int4Screen:
    """An int4 copy of an int8 head [V, K] and the per-entry constants of its margin."""

    w: Tensor  # [V, K / 2] uint8, packed int4 codes (kernels/int4_linear.py's layout)
    scales: Tensor  # [V, K / 32] float16
    mins: Tensor  # [V, K / 32] float16
    err: Tensor  # [V] float32: Z * ||w4_n - w8_n|| / sqrt(K)
    norm: Tensor  # [V] float32: Z * ||w4_n|| / sqrt(K)

    @staticmethod
    def applies(q: Tensor) -> bool:
        """Whether an int8 head [V, K] can be screened here: CPU, K a multiple of 32."""
        return q.device.type == "cpu" and q.dim() == 2 and supports(q.shape[1])

    @classmethod
    def build(cls, q: Tensor, scales: Tensor, refine: int = 1, chunk: int = 32768) -> Int4Screen:
        """From the int8 head (`q` [V, K] int8, `scales` [V]), in row chunks. One refinement
        round of the int4 grid: a screen's fit changes how many candidates it leaves, never
        the token (Gemma 3's head: ~3.5 s)."""
        v, k = q.shape
        parts: list[tuple[Tensor, ...]] = []
        for lo in range(0, v, chunk):
            w8 = q[lo : lo + chunk].float() * scales[lo : lo + chunk, None].float()  # [c, K]
            w4, s4, m4 = quantize_int4(w8, refine=refine)
            deq = dequantize_int4(w4, s4, m4)
            scale = Z / math.sqrt(k)
            err = (deq - w8).norm(dim=1) * scale
            parts.append((w4, s4, m4, err, deq.norm(dim=1) * scale))
        w4, s4, m4, err, norm = (torch.cat(p) for p in zip(*parts, strict=True))
        return cls(w4.contiguous(), s4.contiguous(), m4.contiguous(), err, norm)


def row_factors(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [N, K] float32 -> (dx [N], ||x|| [N]): the margin's per-row factors (`dx`: a bound on
    the norm of the activation rounding of both ops)."""
    n, k = x.shape
    step = x.view(n, k // GROUP, GROUP).abs().amax(dim=2) / _ACT_STEPS  # [N, G]
    dx = (step * _ACT_ERR).square().sum(dim=1).mul(GROUP).sqrt() * _INT8_OP
    return dx.contiguous(), x.norm(dim=1).contiguous()


def candidate_union(x: Tensor, approx: Tensor, screen: Int4Screen) -> Tensor:
    """x [N, K], approx [N, V] its int4 logits -> long [U]: ascending ids that may hold some
    row's largest int8 logit (torch ops; `tolk::int4_screen_union` applies the same rule)."""
    dx, xn = row_factors(x)
    return (
        candidates(approx, dx[:, None], xn[:, None], screen.norm, screen.err)
        .any(dim=0)
        .nonzero()[:, 0]
    )


def int8_head_argmax_reference(
    x: Tensor, q: Tensor, scales: Tensor, softcap: float | None
) -> Tensor:
    """x [N, K] float32 -> [N] long: the argmax of the full int8 head's (soft-capped) logits,
    as `Transformer.compute_logits` computes them."""
    return _softcapped(int8_linear(x, q, scales), softcap).argmax(dim=-1)


def _softcapped(logits: Tensor, softcap: float | None) -> Tensor:
    return logits if softcap is None else torch.tanh(logits / softcap) * softcap


def int8_head_logprob_reference(
    x: Tensor, q: Tensor, scales: Tensor, softcap: float | None
) -> tuple[Tensor, Tensor]:
    """x [N, K] float32 -> ([N] long, [N] float32): the full int8 head's argmax and its
    log-softmax (of the soft-capped logits, as `TokenSampler.sample` keeps it)."""
    logits = _softcapped(int8_linear(x, q, scales), softcap)
    tokens = logits.argmax(dim=-1)
    return tokens, torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None])[:, 0]


def _screened(
    x: Tensor, q: Tensor, scales: Tensor, screen: Int4Screen, softcap: float | None
) -> tuple[Tensor, Tensor, Tensor]:
    """(approx [N, V] the int4 logits, ids [U] the candidates, [N, U] their int8 logits,
    soft-capped)."""
    approx = int4_linear(x, screen.w, screen.scales, screen.mins)  # [N, V]
    if cpu_ops.LOADED:
        ids = torch.ops.tolk.int4_screen_union(x, approx, screen.norm, screen.err)
    else:
        ids = candidate_union(x, approx, screen)
    u = ids.numel()
    padded = torch.cat([ids, ids[-1:].expand((-u) % 4)])  # whole 4-row blocks, as in the head
    logits = int8_linear(x, q.index_select(0, padded), scales.index_select(0, padded))[:, :u]
    return approx, ids, _softcapped(logits, softcap)


def screened_int8_argmax(
    x: Tensor, q: Tensor, scales: Tensor, screen: Int4Screen, softcap: float | None
) -> Tensor:
    """x [N, K] float32, the int8 head (`q` [V, K], `scales` [V]) -> [N] long: its argmax
    through the int4 screen (module docstring); the C++ candidate pass once the ops are loaded,
    the torch one elsewhere."""
    _, ids, logits = _screened(x, q, scales, screen, softcap)
    return ids[logits.argmax(dim=-1)]


def screened_int8_argmax_logprob(
    x: Tensor, q: Tensor, scales: Tensor, screen: Int4Screen, softcap: float | None
) -> tuple[Tensor, Tensor]:
    """As `int8_head_logprob_reference`, through the screen: the argmax as
    `screened_int8_argmax`'s, its log-softmax with the normaliser summed over the candidates'
    int8 logits and every other entry's int4 one (the cascade's small-model signal, issue #44:
    a kept log-probability no longer turns the screen off). The others lie below the best by
    at least their margins; their errors move the normaliser by a fraction of each one's share
    of it (Gemma 3's answers: the mean within 0.01 of the full head's,
    tests/engine/test_engine.py)."""
    approx, ids, logits = _screened(x, q, scales, screen, softcap)
    best = logits.argmax(dim=-1)
    capped = _softcapped(approx, softcap)
    capped.index_copy_(1, ids, logits)  # [N, V]: int8 where computed, int4 elsewhere
    picked = logits.gather(1, best[:, None])[:, 0]
    return ids[best], picked - torch.logsumexp(capped, dim=-1)
