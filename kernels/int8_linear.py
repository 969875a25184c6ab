"""Weight-only int8 linear: `y = (x @ w.T) * scales`, int8 `w` [N, K], one scale per output row.

Two versions of the same signature:
- `int8_linear_reference(x, w, scales)`: torch ops (dequantize, matmul); any device and dtype.
- `int8_linear(x, w, scales)`: on the CPU with float32 `x`, the C++ op `tolk::int8_linear`
  (`kernels/cpu/int8_linear.cpp`: AVX-512, OpenMP over output rows); anywhere else, or when
  the op is not loaded (`kernels.cpu_ops.load()`, which can fail without a toolchain), the
  reference. Only a plain flag is read on the hot path, so compiled graphs trace it as a
  constant.

Why a kernel of our own: batch-1 decode on a CPU is bound by reading the weights. torch's
`aten._weight_int8pack_mm` wants bfloat16 activations and spends more time widening int8 to
float than reading memory. The C++ op keeps activations in float32 outside the dot product
(the model stays float32 outside the projections) and, on CPUs with AVX512-VNNI, multiplies
them as per-row 16-bit fixed point with int16 dot-product instructions: SmolLM2's 30 layers of
projections at batch 1 in 4.9 ms a token against 7.1 ms for torch's kernel and 15.5 ms in
float32 (2 cores); its error is ~8x below torch's bfloat16 activations. `exact_float32=True`
selects the float32-FMA loop (error at float32 rounding), used as the tests' yardstick.

The op is built on first use by `kernels.cpu_ops` (a C++ compiler and `ninja` needed), with a
fake implementation for `torch.compile`. This module is a leaf: it imports torch only.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kernels import cpu_ops


def quantize_int8(weight: Tensor) -> tuple[Tensor, Tensor]:
    """[N, K] float -> (int8 [N, K], scales [N] float32), symmetric per output channel."""
    w = weight.detach().float()
    scales = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0  # [N]
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return q.contiguous(), scales


def int8_linear_reference(x: Tensor, w: Tensor, scales: Tensor) -> Tensor:
    """x [..., K] float, w [N, K] int8, scales [N] -> [..., N] in x's dtype."""
    return torch.nn.functional.linear(x, w.to(x.dtype)) * scales.to(x.dtype)


def int8_linear(x: Tensor, w: Tensor, scales: Tensor, exact_float32: bool = False) -> Tensor:
    """The fast op where it applies (CPU, float32 x, float32 scales, `kernels.cpu_ops.load()`
    done: `WeightOnlyInt8Linear` does it), else the reference."""
    if (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and scales.dtype == torch.float32
        and cpu_ops.LOADED
    ):
        return torch.ops.tolk.int8_linear(x, w, scales, exact_float32)
    return int8_linear_reference(x, w, scales)
