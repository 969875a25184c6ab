"""The decoder: one plain model file for Llama, Gemma 3, Qwen 2 / 2.5 and Qwen 3 text models.

Every architectural difference is a `ModelConfig` flag, not a subclass:

| | Llama | Gemma 3 | Qwen 2 / 2.5 | Qwen 3 |
|---|---|---|---|---|
| embedding | plain | times sqrt(D), cast to the model dtype first | plain | plain |
| RMSNorm | `w * x_hat.to(dtype)` | `(x_hat * (1 + w)).to(dtype)`, in float32 | Llama's | Llama's |
| norms per layer | attn_norm, ffn_norm | + post_attn_norm, post_ffn_norm | Llama's | Llama's |
| q/k/v | - | per-head RMSNorm of q, k before RoPE | + biases | per-head RMSNorm |
| attention scale | head_dim ** -0.5 | query_pre_attn_scalar ** -0.5 | Llama's | Llama's |
| layers | all full | 5 sliding : 1 full, own RoPE base | all full | all full |
| MLP | SwiGLU (silu) | GeGLU (gelu tanh) | SwiGLU | SwiGLU |

Qwen's q/k/v biases live on the attention module as one vector (`qkv_bias`, [(H + 2 KVH) * D]),
not on the projections: every projection stays a bias-free `nn.Linear`, so the swaps that fuse,
quantize or pack projections (`workers/engine/swaps.py`) apply to Qwen unchanged.

Numerics follow transformers 4.57 op by op (float32 RoPE tables cast to the model dtype, float32
RMSNorm, float32 softmax) so greedy decoding yields the same tokens as `generate()`.

The model runs a vLLM-v1-style flattened batch: `input_ids`/`positions` are `[T]`, the new tokens
of every sequence in the step back to back (prompt chunks and single decode tokens mixed). There
is no padding and no batch dimension. Each attention layer owns a paged KV cache
`[num_blocks, block_size, KVH, D]` of its group ("full" or "sliding"), allocated by
`allocate_kv_cache`; the block tables and slot mapping come from the caller as one
`AttentionMetadata` per group. New K/V are written into the cache first, then attention reads the
prefix and the new tokens from the cache alike (`kernels.attention`). A compiled decode step
(`workers/engine/compiled.py`) passes a `DecodeBatch` per group instead: tensors only, one new
token per sequence, the same function through ops that `torch.compile` can trace.

Weights use our own short names (see `loader.hf_to_tolk_name`). Speed-ups (compiled decode,
fused kernels, quantized linears) are applied from outside by swapping modules or ops; this file
stays the readable reference.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kernels.attention import (
    AttentionMetadata,
    DecodeBatch,
    decode_attention,
    paged_attention,
    write_kv,
    write_kv_decode,
)
from workers.engine.config import ModelConfig

# a step's attention metadata per KV group: the general one, or a compiled decode step's tensors
AttnMeta = AttentionMetadata | DecodeBatch


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, one_plus: bool) -> None:
        super().__init__()
        self.eps = eps
        self.one_plus = one_plus
        # Gemma stores w - 1 (zeros = identity), Llama stores w (ones = identity)
        self.weight = nn.Parameter(torch.zeros(dim) if one_plus else torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.one_plus:  # Gemma: (x_hat * (1 + w)) in float32, then cast
            return (h * (1.0 + self.weight.float())).type_as(x)
        return self.weight * h.to(x.dtype)  # Llama: cast, then scale


class RotaryEmbedding(nn.Module):
    """cos/sin for the given positions, computed the way transformers does (float32)."""

    inv_freq: Tensor

    def __init__(self, head_dim: int, base: float, scaling_factor: float | None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.base = base
        self.scaling_factor = scaling_factor
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)

    def _inv_freq(self, device: torch.device | None = None) -> Tensor:
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.int64, device=device).float()
        inv_freq = 1.0 / (self.base ** (exponents / self.head_dim))  # [D/2]
        if self.scaling_factor is not None:
            inv_freq = inv_freq / self.scaling_factor
        return inv_freq

    def reset_buffers(self, device: torch.device) -> None:
        self.inv_freq = self._inv_freq(device)

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    # x: [T, H, D]; cos, sin: [T, D]
    return x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]


class Attention(nn.Module):
    k_cache: Tensor | None
    v_cache: Tensor | None

    def __init__(self, config: ModelConfig, layer_type: str) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.attn_scale
        self.softcap = config.attn_logit_softcapping
        self.sliding_window = config.sliding_window if layer_type == "sliding" else None
        d, hd = config.hidden_size, config.head_dim
        self.q_proj = nn.Linear(d, config.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(d, config.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(d, config.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(config.num_heads * hd, d, bias=False)
        # set by swaps.fuse_qkv: q, k, v as one [ (H + 2 KVH) * D, d ] projection
        self.qkv_proj: nn.Module | None = None
        eps, one_plus = config.rms_norm_eps, config.norm_one_plus
        self.q_norm = RMSNorm(hd, eps, one_plus) if config.qk_norm else None  # per head
        self.k_norm = RMSNorm(hd, eps, one_plus) if config.qk_norm else None
        # Qwen 2: q, k and v biases back to back, [(H + 2 KVH) * D], added after the projection
        qkv_width = (config.num_heads + 2 * config.num_kv_heads) * hd
        self.qkv_bias = nn.Parameter(torch.zeros(qkv_width)) if config.qkv_bias else None
        self.register_buffer("k_cache", None, persistent=False)
        self.register_buffer("v_cache", None, persistent=False)

    def fused_qkv(self, x: Tensor) -> Tensor:
        """x [T, d] -> q, k, v side by side [T, (H + 2 KVH) * D] through the fused projection
        (`swaps.fuse_qkv`), biases added (Qwen 2)."""
        assert self.qkv_proj is not None, "swaps.fuse_qkv() first"
        qkv = self.qkv_proj(x)
        return qkv if self.qkv_bias is None else qkv + self.qkv_bias

    def project_qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x [T, d] -> q [T, H, D], k [T, KVH, D], v [T, KVH, D], before QK-norm and RoPE."""
        t, h, kvh, hd = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        if self.qkv_proj is not None:  # fused: strided views of one output, no copy
            qkv = self.fused_qkv(x)  # [T, (H + 2 KVH) * D]
            q = qkv[:, : h * hd].view(t, h, hd)
            k = qkv[:, h * hd : (h + kvh) * hd].view(t, kvh, hd)
            v = qkv[:, (h + kvh) * hd :].view(t, kvh, hd)
            return q, k, v
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)  # [T, H * D], [T, KVH * D] x 2
        if self.qkv_bias is not None:
            bq, bk, bv = self.qkv_bias.split([h * hd, kvh * hd, kvh * hd])
            q, k, v = q + bq, k + bk, v + bv
        return q.view(t, h, hd), k.view(t, kvh, hd), v.view(t, kvh, hd)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, meta: AttnMeta) -> Tensor:
        t, h, kvh, hd = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        if self.qkv_proj is not None and self.q_norm is None:
            # fused, no QK-norm (Llama, Qwen 2): RoPE on q and k heads together
            qkv = self.fused_qkv(x)  # [T, (H + 2 KVH) * D]
            qk = apply_rope(qkv[:, : (h + kvh) * hd].view(t, h + kvh, hd), cos, sin)
            q, k = qk[:, :h], qk[:, h:]  # [T, H, D], [T, KVH, D]
            v = qkv[:, (h + kvh) * hd :].view(t, kvh, hd)  # [T, KVH, D]
        else:
            q, k, v = self.project_qkv(x)
            if self.q_norm is not None and self.k_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        assert self.k_cache is not None and self.v_cache is not None, "allocate_kv_cache() first"
        if isinstance(meta, DecodeBatch):  # a compiled decode graph (workers/engine/compiled.py)
            write_kv_decode(k, v, self.k_cache, self.v_cache, meta)
            o = decode_attention(q, self.k_cache, self.v_cache, meta, self.scale, self.softcap)
        else:
            write_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
            o = paged_attention(
                q, self.k_cache, self.v_cache, meta, self.scale, self.sliding_window, self.softcap
            )  # [T, H, D]
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        # set by swaps.fuse_gate_up: gate and up as one [2 I, d] projection
        self.gate_up_proj: nn.Module | None = None
        self.intermediate_size = config.intermediate_size
        self.gelu = config.hidden_activation == "gelu_tanh"

    def forward(self, x: Tensor) -> Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)  # [T, I] x 2
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)  # [T, I] x 2
        act = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.down_proj(act * up)


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer_type: str) -> None:
        super().__init__()
        eps, one_plus, d = config.rms_norm_eps, config.norm_one_plus, config.hidden_size
        self.layer_type = layer_type  # KV group: "full" or "sliding"
        self.attn_norm = RMSNorm(d, eps, one_plus)
        self.attn = Attention(config, layer_type)
        self.ffn_norm = RMSNorm(d, eps, one_plus)
        self.mlp = MLP(config)
        self.post_attn_norm = RMSNorm(d, eps, one_plus) if config.post_norms else None
        self.post_ffn_norm = RMSNorm(d, eps, one_plus) if config.post_norms else None

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, meta: AttnMeta) -> Tensor:
        h = self.attn(self.attn_norm(x), cos, sin, meta)  # [T, D]
        if self.post_attn_norm is not None:
            h = self.post_attn_norm(h)
        x = x + h
        h = self.mlp(self.ffn_norm(x))
        if self.post_ffn_norm is not None:
            h = self.post_ffn_norm(h)
        return x + h


class Transformer(nn.Module):
    embed_scale: Tensor

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config, t) for t in config.layer_types)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_one_plus)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        # Gemma's local layers use their own base and never the global scaling
        self.rope = nn.ModuleDict(
            {
                "full": RotaryEmbedding(
                    config.head_dim, config.rope_theta, config.rope_scaling_factor
                ),
                "sliding": RotaryEmbedding(config.head_dim, config.rope_local_theta, None),
            }
        )
        self.register_buffer("embed_scale", torch.tensor(config.embed_scale), persistent=False)

    def reset_buffers(self, device: torch.device | str) -> None:
        """Recompute the non-persistent buffers (after building on the meta device)."""
        device = torch.device(device)
        for rope in self.rope.values():
            cast(RotaryEmbedding, rope).reset_buffers(device)
        self.embed_scale = torch.tensor(self.config.embed_scale, device=device)

    def allocate_kv_cache(
        self,
        num_blocks: dict[str, int],
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        zeros: Callable[..., Tensor] = torch.zeros,
    ) -> None:
        """Give each layer a paged cache [num_blocks[group], block_size, KVH, D]; block 0 = null.
        `zeros(shape, dtype=, device=)` allocates each pool (the engine: on huge pages)."""
        cfg = self.config
        for layer in self.layers:
            block = cast(Block, layer)
            shape = (num_blocks[block.layer_type], block_size, cfg.num_kv_heads, cfg.head_dim)
            block.attn.k_cache = zeros(shape, dtype=dtype, device=device)
            block.attn.v_cache = zeros(shape, dtype=dtype, device=device)

    def copy_kv_blocks(self, copies: list[tuple[str, int, int, int]]) -> None:
        """(group, src, dst, n): copy slots [0, n) of block src into block dst in every layer of
        the group (a prefix hit that ends inside a block, see workers/engine/kv_cache.py)."""
        for layer in self.layers:
            block = cast(Block, layer)
            k_cache, v_cache = block.attn.k_cache, block.attn.v_cache
            assert k_cache is not None and v_cache is not None, "allocate_kv_cache() first"
            for group, src, dst, n in copies:
                if group == block.layer_type:
                    k_cache[dst, :n] = k_cache[src, :n]  # [n, KVH, D]
                    v_cache[dst, :n] = v_cache[src, :n]

    def free_kv_cache(self) -> None:
        for layer in self.layers:
            block = cast(Block, layer)
            block.attn.k_cache = None
            block.attn.v_cache = None

    def forward(self, input_ids: Tensor, positions: Tensor, attn: dict[str, AttnMeta]) -> Tensor:
        """input_ids, positions [T] -> hidden states [T, D] after the final norm."""
        x = self.embed(input_ids)  # [T, D]
        if self.config.embed_scale != 1.0:
            x = x * self.embed_scale.to(x.dtype)
        rope: dict[str, tuple[Tensor, Tensor]] = {
            group: cast(RotaryEmbedding, self.rope[group])(positions, x.dtype)
            for group in self.config.kv_groups
        }
        for layer in self.layers:
            block = cast(Block, layer)
            cos, sin = rope[block.layer_type]  # [T, D] each
            x = block(x, cos, sin, attn[block.layer_type])
        return self.norm(x)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """hidden [N, D] -> logits [N, vocab] float32 (soft-capped if configured)."""
        logits = self.lm_head(hidden)  # [N, V] in the model dtype, like transformers
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()
