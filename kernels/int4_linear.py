"""Weight-only int4 linear, group-wise: `y = x @ W.T` with W stored as 4-bit codes per group.

Format (`quantize_int4`): W [N, K] in groups of `GROUP` = 32 columns; per group an asymmetric
grid, `W[n, k] ~ scales[n, g] * q[n, k] + mins[n, g]` with q in 0..15 and float16 scales and
offsets. 4 bits a weight plus 1 bit of scales: 5/8 of int8's bytes, a third of bfloat16's. K
must be a multiple of 32 (`supports(k)`). The codes are packed two to a byte in the order the
C++ loop reads them (`pack_codes`; the layout and why: `kernels/cpu/int4_linear.cpp`).

Two versions of the same signature `(x, w, scales, mins)`:
- `int4_linear_reference`: dequantize with torch ops, then `F.linear`; any device and dtype.
- `int4_linear`: on the CPU with float32 `x`, the C++ op `tolk::int4_linear` (AVX512-VNNI,
  else AVX2 + FMA + F16C; activations as int8 per group of 32, OpenMP over output rows; the
  portable float32 loop on other CPUs); anywhere else, or when the op is not loaded, the
  reference.

Why: batch-1 decode on a CPU reads every weight once a token. Gemma 3 270M reads 268 MB a token
in int8 (its 262k x 640 LM head alone 168 MB), llama.cpp's Q4_K_M GGUF ~195 MB; in this format
~170 MB. int4 is lossy where int8 is nearly not: whether a model may run it is decided by the
quality gate (chrF within 1.0 of float32, `bench/quality_gate.py`), not assumed. This module is
a leaf: it imports torch only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels import cpu_ops

GROUP = 32  # columns per scale and offset
LANES = 16  # groups per block of the packed layout (one int32 lane each)
REFINE_STEPS = 4  # least-squares rounds of the quantizer's grid per group


def supports(k: int) -> bool:
    """Whether a [N, k] weight can be stored in this format (k a multiple of 32)."""
    return k > 0 and k % GROUP == 0


def _blocks(groups: int) -> list[tuple[int, int]]:
    """(first group, groups in it) per block of a row: 16 each, the last one the rest."""
    return [(g, min(LANES, groups - g)) for g in range(0, groups, LANES)]


def pack_codes(q: Tensor) -> Tensor:
    """Codes uint8 [N, K] (0..15) -> packed uint8 [N, K / 2] in the kernel's order: per block of
    R groups, for u in 0..3, for group i, for c in 0..3 one byte holding column 8u + c of group i
    (low nibble) and column 8u + 4 + c (high nibble)."""
    n, k = q.shape
    parts = []
    for g0, r in _blocks(k // GROUP):
        blk = q[:, g0 * GROUP : (g0 + r) * GROUP].reshape(n, r, 4, 2, 4)  # [N, i, u, half, c]
        byte = blk[:, :, :, 0, :] | (blk[:, :, :, 1, :] << 4)  # [N, i, u, c]
        parts.append(byte.permute(0, 2, 1, 3).reshape(n, r * 16))  # [N, u, i, c]
    return torch.cat(parts, dim=1).contiguous()


def unpack_codes(packed: Tensor) -> Tensor:
    """The inverse of `pack_codes`: uint8 [N, K]."""
    n, half = packed.shape
    parts = []
    offset = 0
    for _, r in _blocks(2 * half // GROUP):
        byte = packed[:, offset : offset + r * 16].reshape(n, 4, r, 4)  # [N, u, i, c]
        offset += r * 16
        pair = torch.stack([byte & 15, byte >> 4], dim=3)  # [N, u, i, half, c]
        parts.append(pair.permute(0, 2, 1, 3, 4).reshape(n, r * GROUP))  # [N, i, u, half, c]
    return torch.cat(parts, dim=1)


def quantize_int4(weight: Tensor, refine: int = REFINE_STEPS) -> tuple[Tensor, Tensor, Tensor]:
    """[N, K] float -> (packed uint8 [N, K / 2], scales, mins), both float16 [N, K / 32].

    Per group, starting from offset = minimum and scale = range / 15, `refine` rounds of
    alternating least squares: the nearest codes for the grid, then the grid (scale, offset)
    that fits those codes best (a line through 32 points); each round lowers the squared error
    or keeps it, as llama.cpp's k-quant search does. The last grid is rounded to float16 before
    the final codes are chosen, so they are the nearest for the values the kernel uses."""
    w = weight.detach().float()
    n, k = w.shape
    if not supports(k):
        raise ValueError(f"int4 weights need K a multiple of {GROUP}, got {k}")
    groups = w.view(n, k // GROUP, GROUP)  # [N, G, 32]
    lo = groups.amin(dim=2, keepdim=True)
    scale = ((groups.amax(dim=2, keepdim=True) - lo) / 15.0).clamp(min=1e-7)
    offset = lo
    best = torch.full_like(lo, float("inf"))
    for _ in range(refine):
        q = torch.round((groups - offset) / scale).clamp(0, 15)
        err = ((q * scale + offset - groups) ** 2).sum(dim=2, keepdim=True)
        keep = err < best  # a fit that got worse (never in exact arithmetic) is not taken
        best = torch.where(keep, err, best)
        s_q, s_qq = q.sum(2, keepdim=True), (q * q).sum(2, keepdim=True)
        s_w, s_qw = groups.sum(2, keepdim=True), (q * groups).sum(2, keepdim=True)
        den = GROUP * s_qq - s_q * s_q
        fit_scale = (GROUP * s_qw - s_q * s_w) / den.clamp(min=1e-12)
        fit_offset = (s_w - fit_scale * s_q) / GROUP
        ok = keep & (den > 0) & (fit_scale > 1e-7)
        scale = torch.where(ok, fit_scale, scale)
        offset = torch.where(ok, fit_offset, offset)
    scales = scale.squeeze(2).half()
    mins = offset.squeeze(2).half()
    q = torch.round((groups - mins.float()[..., None]) / scales.float()[..., None])
    codes = q.clamp(0, 15).to(torch.uint8).view(n, k)
    return pack_codes(codes), scales.contiguous(), mins.contiguous()


def dequantize_int4(w: Tensor, scales: Tensor, mins: Tensor) -> Tensor:
    """float32 [N, K] from the packed format."""
    codes = unpack_codes(w)
    n, k = codes.shape
    deq = codes.view(n, k // GROUP, GROUP).float() * scales.float()[..., None]
    return (deq + mins.float()[..., None]).view(n, k)


def int4_linear_reference(x: Tensor, w: Tensor, scales: Tensor, mins: Tensor) -> Tensor:
    """x [..., K], packed w [N, K / 2] -> [..., N] in x's dtype."""
    return F.linear(x, dequantize_int4(w, scales, mins).to(x.dtype))


def runs_vector_loop() -> bool:
    """Whether `int4_linear` runs a vector loop here (C++ ops loaded on a CPU with AVX512-VNNI,
    or AVX2 + FMA + F16C); elsewhere it is the plain float32 loop or the reference, slower
    than int8."""
    return cpu_ops.LOADED and bool(torch.ops.tolk.int4_linear_vector_loop())


def int4_linear(x: Tensor, w: Tensor, scales: Tensor, mins: Tensor) -> Tensor:
    """The fast op where it applies (CPU, float32 x, `kernels.cpu_ops.load()` done:
    `WeightOnlyInt4Linear` does it), else the reference."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and cpu_ops.LOADED:
        return torch.ops.tolk.int4_linear(x, w, scales, mins)
    return int4_linear_reference(x, w, scales, mins)
