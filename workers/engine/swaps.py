"""Speed by swaps, applied after loading (gpt-fast style): the model file stays plain.

The swaps change the model in place and cannot be undone, so they run once per loaded model,
through `workers/engine/prepare.py`'s `prepare_model` (which also records them and refuses a
second, different preparation); engines never call them directly.

- `pack_linears(model)`: on CPU in float32, every projection becomes a `ProbedLinear`
  (`workers/engine/linear_backends.py`): per weight shape and row count, the fastest of
  `F.linear`, MKL's packed GEMM and oneDNN's packed inner product on *this* machine, chosen by
  a probe at preparation (MKL's fast paths are Intel's; on an AMD EPYC oneDNN's JIT wins).
  Results equal `F.linear`'s up to float32 rounding. LM heads are left alone.
- `fuse_qkv(model)`: each attention gets one q/k/v projection (Llama also RoPE over q and k
  heads at once, ~7 fewer ops per layer; Gemma 3 keeps its per-head QK-norm after the split),
  and `fuse_gate_up(model)` one gate/up projection per MLP: one weight stream instead of three
  and of two. Each output row is computed as before (bit-identical for int8/int4 and MKL). At
  batch 1 a short weight is mostly start-up cost: on an AMD EPYC Zen 4, int8, weights cold,
  q+k+v 61-75 us -> 41-49 us and gate+up 115-136 -> 97-100 us per layer (docs/BENCHMARKS.md).
- `screen_lm_head(model)`: on CPU, a cheaper copy of the LM head with which the engine finds
  greedy tokens as the head itself would. A float32 head gets an int8 copy with the constants
  of a rigorous error bound (`kernels.greedy_head.Int8Screen`: a quarter of the bytes; Gemma 3's
  262k-row head, one row 23 -> 7 ms); an int8 head an int4 copy with a 6-sigma margin
  (`kernels.int8_head_screen.Int4Screen`: 105 of 168 MB, the candidates rescored by the int8
  rows). The model itself is unchanged; sampled rows still get the full logits.
- `convert_for_runtime(model, "int8")`: every `nn.Linear` (attention and MLP projections and
  the LM head) becomes `WeightOnlyInt8Linear`: int8 weights with one float scale per output
  channel (symmetric, absmax / 127); everything else keeps the model's dtype.
- `convert_for_runtime(model, "int4")`: the attention and MLP projections become
  `WeightOnlyInt4Linear`, group-wise 4-bit codes (`kernels/int4_linear.py`: 5 bits a weight
  with its scales, 5/8 of int8's bytes); the LM head stays int8, as llama.cpp's Q4_K_M keeps
  its output matrix at 6-8 bits (Gemma 3 270M with an int4 head too: chrF -5.2 / -6.0 on the
  gate's slice), and so does a projection whose input width is not a multiple of 32. Lossy:
  gated by chrF.

Batch-1 decode on a CPU is bound by reading the weights; int8 reads a quarter of float32's bytes
(SmolLM2: 135 MB, which also fits this machine's L3). On the CPU with float32 activations the
projections run `kernels.int8_linear` (our AVX-512 op); with bfloat16 activations torch's
`aten._weight_int8pack_mm`; on other devices the dequantizing reference. The quality cost is
measured in `bench/quality.py` (chrF on Tatoeba vs float32).
"""

from __future__ import annotations

import dataclasses
from typing import cast

import torch
from torch import Tensor, nn

from kernels import cpu_ops
from kernels.greedy_head import Int8Screen
from kernels.int4_linear import int4_linear, quantize_int4, runs_vector_loop, supports
from kernels.int8_head_screen import Int4Screen
from kernels.int8_linear import (
    fast_loop_expected,
    int8_linear,
    pick_streamed_rows,
    quantize_int8,
)
from workers.engine.hugepages import to_huge_pages
from workers.engine.linear_backends import ProbedLinear, probed_linears_available


class WeightOnlyInt8Linear(nn.Module):
    weight: Tensor
    scales: Tensor

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        assert linear.bias is None, "the model's projections have no bias"
        q, scales = quantize_int8(linear.weight)
        self.in_features: int = linear.in_features
        self.out_features: int = linear.out_features
        self.register_buffer("weight", q.to(linear.weight.device))
        self.register_buffer("scales", scales.to(linear.weight.device))  # float32 [N]
        if q.device.type == "cpu":
            cpu_ops.load()  # build the C++ ops now, not inside the first (compiled) step
            pick_streamed_rows()  # the op's loop order for this machine, once per process

    def forward(self, x: Tensor) -> Tensor:
        if x.device.type == "cpu" and x.dtype == torch.bfloat16:  # torch's own CPU kernel
            shape = x.shape
            y = torch.ops.aten._weight_int8pack_mm(
                x.reshape(-1, shape[-1]), self.weight, self.scales.to(x.dtype)
            )
            return y.reshape(*shape[:-1], self.out_features)
        return int8_linear(x, self.weight, self.scales)


class WeightOnlyInt4Linear(nn.Module):
    weight: Tensor  # packed codes, uint8 [N, K / 2]
    scales: Tensor  # float16 [N, K / 32]
    mins: Tensor  # float16 [N, K / 32]

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        assert linear.bias is None, "the model's projections have no bias"
        packed, scales, mins = quantize_int4(linear.weight)
        self.in_features: int = linear.in_features
        self.out_features: int = linear.out_features
        device = linear.weight.device
        self.register_buffer("weight", packed.to(device))
        self.register_buffer("scales", scales.to(device))
        self.register_buffer("mins", mins.to(device))
        if device.type == "cpu":
            cpu_ops.load()

    def forward(self, x: Tensor) -> Tensor:
        return int4_linear(x, self.weight, self.scales, self.mins)


def pack_linears(model: nn.Module, max_numel: int = 8_000_000) -> int:
    """Swap float32 CPU `nn.Linear`s for `ProbedLinear`; returns how many were swapped.

    Each distinct weight shape is probed once (`linear_backends.probe_shape`). Matrices above
    `max_numel` (LM heads: greedy rows use the int8 screen, not the float32 GEMM) are left
    alone."""
    if not probed_linears_available():
        return 0
    swapped = 0
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            w = getattr(child, "weight", None)
            if (
                isinstance(child, nn.Linear)
                and w is not None
                and w.dtype == torch.float32
                and w.device.type == "cpu"
                and w.numel() <= max_numel
            ):
                setattr(module, child_name, ProbedLinear(child))
                swapped += 1
    return swapped


def _stacked(parts: list[nn.Module]) -> nn.Linear | None:
    """One `nn.Linear` whose weight is the parts' weights stacked by output row, or None when
    a part is no plain `nn.Linear` any more (already quantized or packed: left alone)."""
    if not all(isinstance(p, nn.Linear) and p.bias is None for p in parts):
        return None
    weight = torch.cat([cast(nn.Linear, p).weight for p in parts]).detach()
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device,
                      dtype=weight.dtype)  # fmt: skip
    fused.weight = nn.Parameter(weight, requires_grad=False)
    return fused


def fuse_qkv(model: nn.Module) -> int:
    """Give each attention one fused q/k/v projection; returns how many.

    One GEMM of N = (H + 2 KVH) * D instead of three (without QK-norm, Llama, also RoPE over q
    and k heads at once: ~7 fewer ops per layer; Gemma 3 normalises q and k after the split).
    Each output row is computed as in its own projection (int8/int4 quantize per row, MKL
    computes each column the same way whatever N is), so the outputs are bit-identical
    (tests/engine/test_swaps.py). In place and idempotent; run it before
    `convert_for_runtime` and `pack_linears`, which then quantize or pack the fused Linear (on
    an already-swapped model it leaves them alone).
    """
    from workers.engine.model import Attention

    fused = 0
    for attn in model.modules():
        if not isinstance(attn, Attention) or attn.qkv_proj is not None:
            continue
        qkv = _stacked([attn.q_proj, attn.k_proj, attn.v_proj])
        if qkv is None:
            continue
        attn.qkv_proj = qkv
        for name in ("q_proj", "k_proj", "v_proj"):  # the fused copy replaces them
            setattr(attn, name, None)
        fused += 1
    return fused


def fuse_gate_up(model: nn.Module) -> int:
    """Give each MLP one fused gate/up projection ([2 I, d], gate rows first); returns how
    many. Bit-identical like `fuse_qkv`, in place and idempotent, run before the same swaps."""
    from workers.engine.model import MLP

    fused = 0
    for mlp in model.modules():
        if not isinstance(mlp, MLP) or mlp.gate_up_proj is not None:
            continue
        gate_up = _stacked([mlp.gate_proj, mlp.up_proj])
        if gate_up is None:
            continue
        mlp.gate_up_proj = gate_up
        for name in ("gate_proj", "up_proj"):  # the fused copy replaces them
            setattr(mlp, name, None)
        fused += 1
    return fused


def convert_for_runtime(model: nn.Module, mode: str | None) -> nn.Module:
    """Apply a runtime swap in place; `mode` is None (no-op), "int8" or "int4"."""
    if mode is None:
        return model
    if mode not in ("int8", "int4"):
        raise ValueError(f"unknown quantization {mode!r} (supported: int8, int4)")
    swapped: list[WeightOnlyInt8Linear | WeightOnlyInt4Linear] = []
    head = getattr(model, "lm_head", None)
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                if mode == "int4" and child is not head and supports(child.in_features):
                    swapped.append(WeightOnlyInt4Linear(child))
                else:
                    swapped.append(WeightOnlyInt8Linear(child))
                setattr(module, child_name, swapped[-1])
    for m, w in zip(swapped, to_huge_pages([m.weight for m in swapped]), strict=True):
        m.weight = w  # the int8 weights in one buffer on huge pages (CPU; else unchanged)
    return model


HeadScreen = Int8Screen | Int4Screen  # a float32 head's (exact) or an int8 head's
# The int4 screen pays where the int8 head streams from memory: Gemma 3's 168 MB head, batch-1
# step 1.04-1.06x, batch 4 1.13-1.17x; SmolLM2's 28 MB one mostly stays in a 32 MiB L3 and the
# screen's candidate passes cost more than its bytes save (1.03x at batch 1, 0.97x at 4; AMD EPYC
# Zen 4, bench/head_screen.py). Heads below this many int8 weights keep the full head.
INT4_SCREEN_MIN_WEIGHTS = 64 * 2**20


def screen_lm_head(model: nn.Module) -> HeadScreen | None:
    """The LM head's screen for greedy rows, or None where none applies (a bfloat16 or GPU
    head, no C++ ops, an int8 head without an int4 vector loop, a float32 head on a CPU where
    the int8 op has no fast loop):
    - a float32 head: an int8 copy with a rigorous error bound (`Int8Screen`, 168 MB for
      Gemma 3's head, ~1.5 s);
    - an int8 head (`convert_for_runtime`) of at least `INT4_SCREEN_MIN_WEIGHTS`: an int4 copy
      with a 6-sigma margin (`Int4Screen`, 105 MB, ~4 s), rescored by the int8 rows
      (kernels/int8_head_screen.py).
    Its arrays go on huge pages. Built once per head weight and kept on the model, so engines
    over one loaded model share it."""
    head = getattr(model, "lm_head", None)
    weight = getattr(head, "weight", None)
    if weight is None or weight.device.type != "cpu" or not cpu_ops.load():
        return None
    key = (weight.data_ptr(), tuple(weight.shape))  # the same storage once packed (detached)
    cached = getattr(model, "_tolk_lm_screen", None)
    if cached is not None and cached[0] == key:
        return cast(HeadScreen, cached[1])
    screen: HeadScreen
    if isinstance(head, WeightOnlyInt8Linear):
        big = weight.numel() >= INT4_SCREEN_MIN_WEIGHTS
        if not (big and runs_vector_loop() and Int4Screen.applies(weight)):
            return None
        built = Int4Screen.build(weight, head.scales)
        w, scales, mins = to_huge_pages([built.w, built.scales, built.mins])
        screen = dataclasses.replace(built, w=w, scales=scales, mins=mins)
    elif weight.dtype == torch.float32:
        if not fast_loop_expected():  # the int8 op's plain loop: slower than the float32 head
            return None  # (kernels/int8_linear.py: 94 ms against 69 at one row on an AMD EPYC)
        screen = Int8Screen.build(weight)
        pick_streamed_rows()  # the screen's int8 logits run the op too
        (q,) = to_huge_pages([screen.q])
        screen = dataclasses.replace(screen, q=q)
    else:
        return None
    model.__dict__["_tolk_lm_screen"] = (key, screen)  # a plain attribute, not a buffer
    return screen
