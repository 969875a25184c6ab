"""The Triton kernels as module swaps, for models on a CUDA device (`EngineConfig.triton_kernels`).

The model file stays the plain reference (`workers/engine/model.py`); this swap changes the
class of its modules in place to subclasses whose `forward` computes the same function through
the kernels of `kernels/triton_attention.py` and `kernels/triton_norm_rope.py`:

- `Attention`: RoPE on q and k plus `write_kv` become `rope_write_kv` (one kernel); the paged
  attention becomes `triton_paged_attention` (paged decode with cascade, or varlen prefill), or
  `paged_decode_attention` for a CUDA graph's `PagedDecodeBatch`;
- `Block`: `x + h` then `ffn_norm` (Gemma: `post_attn_norm` first) become one `add_rms_norm`;
- `RMSNorm` (attn_norm, the final norm, Gemma's q/k and post-MLP norms): `add_rms_norm`
  without a residual (one kernel instead of 5-6 ops).

Parameters, buffers and state-dict names are untouched (only `__class__` changes), so the swap
is cheap, idempotent and undone by `remove_triton_kernels`. A compiled decode step's
`DecodeBatch` still goes through the reference path. The kernel modules (and triton) are
imported here, so the engine imports this module only when asked for the swap on CUDA (or in
the CPU tests, whose process runs Triton's interpreter: `kernels.triton_common.INTERPRETED`).
"""

from __future__ import annotations

from typing import cast

from torch import Tensor, nn

from kernels import triton_attention, triton_common, triton_norm_rope
from kernels.attention import AttentionMetadata
from kernels.triton_attention import PagedDecodeBatch
from workers.engine.model import Attention, AttnMeta, Block, RMSNorm

_SWAPS: dict[type[nn.Module], type[nn.Module]] = {}  # reference class -> swapped class


class TritonRMSNorm(RMSNorm):
    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, x.shape[-1])  # [N, D]: a [T, H, D] per-head norm too
        normed, _ = triton_norm_rope.add_rms_norm(rows, None, self.weight, self.eps, self.one_plus)
        return normed.view_as(x)


class TritonAttention(Attention):
    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, meta: AttnMeta) -> Tensor:
        batch = cast(object, meta)
        if not isinstance(batch, AttentionMetadata | PagedDecodeBatch):
            return super().forward(x, cos, sin, meta)  # a compiled step's DecodeBatch
        t, h, hd = x.shape[0], self.num_heads, self.head_dim
        q, k, v = self.project_qkv(x)  # [T, H, D], [T, KVH, D] x 2 (Qwen 2: biases added)
        if self.q_norm is not None and self.k_norm is not None:  # Gemma 3's, Qwen 3's QK-norm
            q, k = self.q_norm(q), self.k_norm(k)
        k_cache, v_cache = self.k_cache, self.v_cache
        assert k_cache is not None and v_cache is not None, "allocate_kv_cache() first"
        q, k = triton_norm_rope.rope_write_kv(
            q, k, v, cos, sin, k_cache, v_cache, batch.slot_mapping
        )
        if isinstance(batch, PagedDecodeBatch):  # a CUDA graph's decode step
            o = triton_attention.paged_decode_attention(
                q, k_cache, v_cache, batch.block_tables, batch.seq_lens, self.scale,
                self.sliding_window, self.softcap, batch.num_splits,
            )  # fmt: skip
        else:
            o = triton_attention.triton_paged_attention(
                q, k_cache, v_cache, batch, self.scale, self.sliding_window, self.softcap
            )
        return self.o_proj(o.reshape(t, h * hd))


class TritonBlock(Block):
    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, meta: AttnMeta) -> Tensor:
        h = self.attn(self.attn_norm(x), cos, sin, meta)  # [T, D]
        post = self.post_attn_norm.weight if self.post_attn_norm is not None else None
        norm = self.ffn_norm
        # x + post_attn_norm(h), and ffn_norm of it, in one kernel
        normed, x = triton_norm_rope.add_rms_norm(h, x, norm.weight, norm.eps, norm.one_plus, post)
        h = self.mlp(normed)
        if self.post_ffn_norm is not None:
            h = self.post_ffn_norm(h)
        return x + h


_SWAPS.update({RMSNorm: TritonRMSNorm, Attention: TritonAttention, Block: TritonBlock})


def kernels_runnable(model: nn.Module) -> bool:
    """Whether the Triton kernels can run on this model's device: CUDA, or anywhere under
    Triton's interpreter (the CPU tests)."""
    weight = next(model.parameters())
    return weight.device.type == "cuda" or triton_common.INTERPRETED


def apply_triton_kernels(model: nn.Module) -> int:
    """Swap every RMSNorm, Attention and Block of `model` for its Triton version (in place,
    idempotent); returns how many modules are swapped now. Raises off CUDA (outside the
    interpreter)."""
    if not kernels_runnable(model):
        raise RuntimeError("the Triton kernels run on CUDA only (or under TRITON_INTERPRET=1)")
    swapped = 0
    for module in model.modules():
        target = _SWAPS.get(type(module))
        if target is not None:
            module.__class__ = target
        swapped += type(module) in _SWAPS.values()
    return swapped


def remove_triton_kernels(model: nn.Module) -> int:
    """Undo `apply_triton_kernels`; returns how many modules went back to the reference."""
    back = {swapped: ref for ref, swapped in _SWAPS.items()}
    undone = 0
    for module in model.modules():
        ref = back.get(type(module))
        if ref is not None:
            module.__class__ = ref
            undone += 1
    return undone


def uses_triton_kernels(model: nn.Module) -> bool:
    return any(isinstance(m, TritonAttention) for m in model.modules())
