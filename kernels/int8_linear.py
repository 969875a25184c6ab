"""Weight-only int8 linear: `y = (x @ w.T) * scales`, int8 `w` [N, K], one scale per output row.

Two versions of the same signature:
- `int8_linear_reference(x, w, scales)`: torch ops (dequantize, matmul); any device and dtype.
- `int8_linear(x, w, scales)`: on the CPU with float32 `x`, the C++ op `tolk::int8_linear`
  (`kernels/cpu/int8_linear.cpp`: AVX512-VNNI, else AVX2, OpenMP over output rows);
  anywhere else, or when the op is not loaded (`kernels.cpu_ops.load()`, which can fail
  without a toolchain), the reference. Only a plain flag is read on the hot path, so compiled
  graphs trace it as a constant.

Why a kernel of our own: batch-1 decode on a CPU is bound by reading the weights. torch's
`aten._weight_int8pack_mm` wants bfloat16 activations and spends more time widening int8 to
float than reading memory. The C++ op keeps activations in float32 outside the dot product
(the model stays float32 outside the projections) and multiplies them as per-row 16-bit fixed
point with int16 dot-product instructions (vpdpwssd with AVX512-VNNI, vpmaddwd with AVX2; the
same integer sums): SmolLM2's 30 layers of projections at batch 1 in 4.9 ms a token against
7.1 ms for torch's kernel and 15.5 ms in float32 (2 cores, VNNI); its error is ~8x below
torch's bfloat16 activations. `exact_float32=True` selects the float32-FMA loop (error at
float32 rounding), used as the tests' yardstick, and the default on AVX-512 CPUs without VNNI.
On an AVX2-only AMD EPYC (family 25 model 1, 2 vCPU) the float32 loop was bound by its own
instructions (Gemma 3's LM head at one row 14.6 ms, 11 GB/s where the machine streams 23-26);
the 16-bit loop reads it in 8.4 ms (`python -m bench.int8_linear`: 1.7-1.8x at 1-8 rows).

Two loop orders for the 16-bit path. At a few activation rows (decode at small batch) the op is
bound by reading `w`, and the order in which it reads decides the speed: one weight row at a
time in memory order (`streamed`: each task one sequential stream) or four rows side by side
(`blocked`: each widened weight vector reused for four activation rows, the better order once
arithmetic bounds it). On an AMD EPYC Zen 4 (2 vCPU) the streamed order read Gemma 3's 168 MB
LM head at one row in 3.6 ms against 8.0 (and the projections 1.06-1.2x faster), while the
blocked order stayed ahead from 8 rows up. Memory systems differ (on an Intel Xeon the blocked
head already read at the bandwidth of a plain sum), so `pick_streamed_rows()` times both orders
once per process on a weight larger than the L3 and keeps the faster: the op streams up to 4,
1 or 0 activation rows (`streamed_rows()`). `WeightOnlyInt8Linear` calls it when it is built.

The op is built on first use by `kernels.cpu_ops` (a C++ compiler and `ninja` needed), with a
fake implementation for `torch.compile`. This module is a leaf: it imports torch only.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import torch
from torch import Tensor

from kernels import cpu_ops

log = logging.getLogger(__name__)

PROBE_ROWS = 131072  # weight rows of the probe's matrix: 84 MB at K = 640, beyond any L3 here
PROBE_K = 640
PROBE_REPEATS = 5  # timed calls per order and batch; the fastest counts
_probe_lock = threading.Lock()
_picked: StreamedRowsChoice | None = None


@dataclass(frozen=True)
class StreamedRowsChoice:
    """What `pick_streamed_rows` measured (ms per call of the probe matrix) and chose."""

    rows: int  # activation rows up to which the op streams: 4, 1 or 0
    streamed_ms: dict[int, float]  # activation rows -> ms, streamed order
    blocked_ms: dict[int, float]  # the same, blocked order

    def describe(self) -> str:
        times = ", ".join(
            f"{m}: {self.streamed_ms[m]:.2f} vs {self.blocked_ms[m]:.2f} ms"
            for m in sorted(self.streamed_ms)
        )
        return (
            f"int8 weights read in memory order up to {self.rows} activation rows "
            f"(activation rows: streamed vs blocked order, {times})"
        )


AVX512_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl"})  # cpu/int8_linear.cpp's TOLK_AVX512
AVX2_FLAGS = frozenset({"avx2", "fma"})  # its TOLK_AVX2


def fast_loop_expected() -> bool:
    """Whether the C++ op will run a vector loop of its own on this CPU (AVX-512, else AVX2 with
    FMA), read from the CPU's flags before the op is built. Without either it is the plain loop
    the compiler vectorizes, slower than float32's BLAS: on an AMD EPYC without AVX-512 (family
    25 model 1, 2 vCPU), before the AVX2 loop, Gemma 3's LM head at one activation row took 94 ms
    (float32: 69 ms; the AVX2 loop: 16 ms), and warming five languages' prompts 74 s."""
    flags = cpu_ops.cpu_flags()
    return flags >= AVX512_FLAGS or flags >= AVX2_FLAGS


def streamed_rows(rows: int | None = None) -> int:
    """The op's streamed-order limit in activation rows, after setting it to `rows` if given
    (0-4; 0: always the blocked order). -1 without the C++ op."""
    if not cpu_ops.LOADED:
        return -1
    return int(torch.ops.tolk.int8_linear_streamed_rows(-1 if rows is None else rows))


def _best_ms(x: Tensor, w: Tensor, scales: Tensor) -> float:
    torch.ops.tolk.int8_linear(x, w, scales, False)  # warm: pages touched, pool started
    best = float("inf")
    for _ in range(PROBE_REPEATS):
        t0 = time.perf_counter()
        torch.ops.tolk.int8_linear(x, w, scales, False)
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def pick_streamed_rows(force: bool = False) -> StreamedRowsChoice | None:
    """Time the streamed and blocked orders at 1 and 4 activation rows on an int8 matrix larger
    than the caches, set the faster (`streamed_rows`), log it and return what was measured.
    Once per process (`force`: again); None without the C++ op. ~0.3 s on two cores."""
    global _picked
    if not cpu_ops.load():
        return None
    with _probe_lock:
        if _picked is not None and not force:
            return _picked
        # the values do not change integer SIMD's speed: a filled matrix (every page touched)
        # costs 0.02 s where random codes cost 0.3 s of each start
        w = torch.ones(PROBE_ROWS, PROBE_K, dtype=torch.int8)
        scales = torch.ones(PROBE_ROWS)
        streamed: dict[int, float] = {}
        blocked: dict[int, float] = {}
        for m in (1, 4):
            x = torch.ones(m, PROBE_K)
            streamed_rows(4)
            streamed[m] = _best_ms(x, w, scales)
            streamed_rows(0)
            blocked[m] = _best_ms(x, w, scales)
        rows = 0  # streamed up to 4 rows if faster at 1 and 4, up to 1 if only at 1
        if streamed[1] < blocked[1]:
            rows = 4 if streamed[4] < blocked[4] else 1
        streamed_rows(rows)
        _picked = StreamedRowsChoice(rows, streamed, blocked)
        log.info("%s", _picked.describe())
        return _picked


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
