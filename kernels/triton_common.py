"""What the Triton attention kernels share: the online softmax's jit helpers, the host checks.

`kernels/triton_attention.py` (paged decode, cascade) and `kernels/triton_prefill_attention.py`
(varlen prefill) both build on these; they live here so that neither kernel module imports the
other's private helpers (the decode module dispatches to the prefill one, never the reverse).

- `_dot`: `a @ b` with float32 accumulation, in the pool's low precision dtype on a GPU (tensor
  cores) or float32 without TF32 (float32 pools, and always under the interpreter, whose
  bfloat16 `tl.dot` multiplies raw bits); `_dot_dtypes` decides which from the pool.
- `_softcap`: `tanh(s / c) * c` as `2 sigmoid(2x) - 1` (no tanh in core triton).
- `_softmax_tile`: one key tile folded into the running max, sum and output.
- `_check`: the device and layout every kernel needs.

Triton reads `TRITON_INTERPRET` when it decorates these functions, i.e. when this module is
first imported; `INTERPRETED` records what it got. A leaf: torch and triton only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

INTERPRETED: bool = bool(triton.knobs.runtime.interpret)  # decided by triton at decoration
NOT_RUNNABLE = "the Triton kernels run on CUDA (or on the CPU under TRITON_INTERPRET=1)"


@triton.jit
def _softcap(s, SOFTCAP: tl.constexpr):
    if SOFTCAP > 0.0:  # tanh(s / c) * c, as 2 sigmoid(2x) - 1 (no tanh in core triton)
        s = SOFTCAP * (2.0 * tl.sigmoid(2.0 * s / SOFTCAP) - 1.0)
    return s


@triton.jit
def _dot(a, b, DOT_LOW: tl.constexpr, LOW: tl.constexpr):
    """a @ b with float32 accumulation: in the pool's low precision dtype (GPU tensor cores) or
    float32 without TF32 (float32 pools, and always under the interpreter)."""
    if DOT_LOW:
        return tl.dot(a.to(LOW), b.to(LOW))
    return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")


@triton.jit
def _softmax_tile(s, v, m_i, l_i, acc, DOT_LOW: tl.constexpr, LOW: tl.constexpr):
    """One key tile of the online softmax: scores `s` [M, N] (positions not seen at -inf) and
    values `v` [N, D] folded into the running max `m_i` [M], sum `l_i` [M] and output `acc`
    [M, D]; returns the three updated."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # no NaN from (-inf) - (-inf)
    p = tl.exp(s - m_use[:, None])
    alpha = tl.exp(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p, v, DOT_LOW, LOW)
    return m_new, l_i, acc


def _check(q: Tensor, k_cache: Tensor) -> None:
    if not INTERPRETED and not q.is_cuda:
        raise RuntimeError(NOT_RUNNABLE)
    d = q.shape[-1]
    if d < 16 or d & (d - 1):
        raise ValueError(f"head_dim must be a power of two >= 16, got {d}")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1:
        raise ValueError("q and the KV pools need a contiguous last dimension")


def _dot_dtypes(k_cache: Tensor) -> tuple[bool, tl.dtype]:
    """(use the pool's dtype in tl.dot, that dtype): low precision only on a real GPU."""
    low = k_cache.dtype in (torch.bfloat16, torch.float16) and not INTERPRETED
    return low, tl.bfloat16 if k_cache.dtype == torch.bfloat16 else tl.float16
