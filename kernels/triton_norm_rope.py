"""The small fused ops of a decoder layer in Triton: RMSNorm with the residual add, and RoPE
fused with the KV-cache write. Each has its torch reference here, written op for op like
`workers/engine/model.py` (which a kernel may not import; tests/kernels check the references
against the model's modules).

- `add_rms_norm(x, residual, weight, eps, one_plus, pre_weight=None)`: the residual stream's
  add and the next norm in one pass over a row: `s = residual + x` (rounded to the model dtype,
  as the model's `x + h` is), returned with `rms_norm(s)`. Gemma's sandwich norms add one more
  norm before the add (`pre_weight`: the post-attention / post-MLP norm of `x`), so a Gemma
  layer's `post_attn_norm -> add -> ffn_norm` is one kernel instead of five to seven ops.
  Both RMSNorm flavours: Llama's `w * x_hat.to(dtype)` (cast, then scale in the model dtype)
  and Gemma's `(x_hat * (1 + w)).to(dtype)` (all in float32, `w` stored as `w - 1`). One program
  per row; the row (576 / 640 / 2048 wide) fits one tile.
- `rope_write_kv(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)`: RoPE (rotate-half
  convention, `x * cos + rotate_half(x) * sin` with the products rounded to the model dtype as
  torch computes them) on q and k, and the rotated k and v written into the block-major pool at
  their slots (`block_id * block_size + offset`; a negative slot writes nothing). Returns the
  rotated q and k; one program per token, all heads of it. q/k/v may be strided views (the
  fused q/k/v projection's output) as long as the head dimension is contiguous.

Numerics: float32 math inside; the roundings torch does between ops in bfloat16 are done at
the same points, so bfloat16 results equal the references' up to float32 summation order (the
norm's mean of squares). Same interpreter rule as `kernels/triton_attention.py`: the module
records in `INTERPRETED` whether triton decorated its kernels for `TRITON_INTERPRET=1`.
A leaf: torch and triton only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

INTERPRETED: bool = bool(triton.knobs.runtime.interpret)
NOT_RUNNABLE = "the Triton kernels run on CUDA (or on the CPU under TRITON_INTERPRET=1)"


@triton.jit
def _rms(x, w, mask, N: tl.constexpr, eps, ONE_PLUS: tl.constexpr, OUT: tl.constexpr):
    """x float32 [BLOCK] (masked lanes 0) -> the normed row rounded to OUT, as float32."""
    var = tl.sum(x * x, 0) / N
    xhat = x * tl.rsqrt(var + eps)
    if ONE_PLUS:  # noqa: SIM108 (triton)  Gemma: (x_hat * (1 + w)) in float32, then cast
        y = (xhat * (1.0 + w)).to(OUT)
    else:  # Llama: cast, then scale in the model dtype
        y = (xhat.to(OUT).to(tl.float32) * w).to(OUT)
    return tl.where(mask, y.to(tl.float32), 0.0)


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, pre_w_ptr, out_ptr, sum_ptr,
    eps,
    stride_x, stride_r, stride_o, stride_s,
    N: tl.constexpr, BLOCK: tl.constexpr, ONE_PLUS: tl.constexpr,
    HAS_RES: tl.constexpr, HAS_PRE: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    dt = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_PRE:  # Gemma's post-attention / post-MLP norm of x, before the add
        pre_w = tl.load(pre_w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        x = _rms(x, pre_w, mask, N, eps, ONE_PLUS, dt)
    if HAS_RES:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        x = (r + x).to(dt).to(tl.float32)  # the model's `x + h`, in the model dtype
        tl.store(sum_ptr + row * stride_s + cols, x.to(dt), mask=mask)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = _rms(x, w, mask, N, eps, ONE_PLUS, dt)
    tl.store(out_ptr + row * stride_o + cols, y.to(dt), mask=mask)


def add_rms_norm(
    x: Tensor,
    residual: Tensor | None,
    weight: Tensor,
    eps: float,
    one_plus: bool,
    pre_weight: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """(rms_norm(s), s) with s = residual + (pre-normed) x; x, residual [T, N].

    `residual=None`: no add, s is x (after the `pre_weight` norm, if any)."""
    if not INTERPRETED and not x.is_cuda:
        raise RuntimeError(NOT_RUNNABLE)
    t, n = x.shape
    out = torch.empty_like(x)
    s = torch.empty_like(x) if residual is not None else None
    if t == 0:
        return out, (s if s is not None else x)
    if x.stride(1) != 1 or (residual is not None and residual.stride(1) != 1):
        raise ValueError("rows must be contiguous")
    res = residual if residual is not None else x
    sums = s if s is not None else out
    _add_rms_norm_kernel[(t,)](
        x, res, weight, pre_weight if pre_weight is not None else weight, out, sums,
        eps,
        x.stride(0), res.stride(0), out.stride(0), sums.stride(0),
        N=n, BLOCK=triton.next_power_of_2(n), ONE_PLUS=one_plus,
        HAS_RES=residual is not None, HAS_PRE=pre_weight is not None,
    )  # fmt: skip
    if s is None:
        if pre_weight is None:
            return out, x
        # no add but a pre-norm: s is the pre-normed x (rarely wanted; computed by torch)
        return out, rms_norm_reference(x, pre_weight, eps, one_plus)
    return out, s


def rms_norm_reference(x: Tensor, weight: Tensor, eps: float, one_plus: bool) -> Tensor:
    """`workers.engine.model.RMSNorm.forward`, op for op."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if one_plus:
        return (h * (1.0 + weight.float())).type_as(x)
    return weight * h.to(x.dtype)


def add_rms_norm_reference(
    x: Tensor,
    residual: Tensor | None,
    weight: Tensor,
    eps: float,
    one_plus: bool,
    pre_weight: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The torch ops `add_rms_norm` fuses, as the model's `Block.forward` runs them."""
    if pre_weight is not None:
        x = rms_norm_reference(x, pre_weight, eps, one_plus)
    s = residual + x if residual is not None else x
    return rms_norm_reference(s, weight, eps, one_plus), s


@triton.jit
def _rope_heads(
    src_ptr, dst_ptr, cos1, sin1, cos2, sin2, t, stride_t, stride_h, stride_dt, stride_dh,
    NH: tl.constexpr, BLOCK_H: tl.constexpr, HALF: tl.constexpr,
):  # fmt: skip
    """Rotate the NH heads of token t; returns the rotated halves (float32, model-rounded)."""
    heads = tl.arange(0, BLOCK_H)
    d = tl.arange(0, HALF)
    h_mask = heads < NH
    src = src_ptr + t * stride_t + heads[:, None] * stride_h + d[None, :]
    x1 = tl.load(src, mask=h_mask[:, None], other=0.0)
    x2 = tl.load(src + HALF, mask=h_mask[:, None], other=0.0)
    dt = x1.dtype
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    # torch: x * cos + rotate_half(x) * sin, each product rounded to the model dtype
    o1 = (x1 * cos1[None, :]).to(dt).to(tl.float32) + (-x2 * sin1[None, :]).to(dt).to(tl.float32)
    o2 = (x2 * cos2[None, :]).to(dt).to(tl.float32) + (x1 * sin2[None, :]).to(dt).to(tl.float32)
    dst = dst_ptr + t * stride_dt + heads[:, None] * stride_dh + d[None, :]
    tl.store(dst, o1.to(dt), mask=h_mask[:, None])
    tl.store(dst + HALF, o2.to(dt), mask=h_mask[:, None])
    return o1, o2


@triton.jit
def _rope_write_kv_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, kc_ptr, vc_ptr, slot_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cos,
    stride_qot, stride_qoh, stride_kot, stride_koh,
    stride_cb, stride_cs, stride_ch,
    H: tl.constexpr, KVH: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_KVH: tl.constexpr,
    HALF: tl.constexpr, BS: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, HALF)
    cos1 = tl.load(cos_ptr + t * stride_cos + d).to(tl.float32)
    cos2 = tl.load(cos_ptr + t * stride_cos + HALF + d).to(tl.float32)
    sin1 = tl.load(sin_ptr + t * stride_cos + d).to(tl.float32)
    sin2 = tl.load(sin_ptr + t * stride_cos + HALF + d).to(tl.float32)
    _rope_heads(q_ptr, qo_ptr, cos1, sin1, cos2, sin2, t, stride_qt, stride_qh,
                stride_qot, stride_qoh, H, BLOCK_H, HALF)  # fmt: skip
    k1, k2 = _rope_heads(k_ptr, ko_ptr, cos1, sin1, cos2, sin2, t, stride_kt, stride_kh,
                         stride_kot, stride_koh, KVH, BLOCK_KVH, HALF)  # fmt: skip
    slot = tl.load(slot_ptr + t)
    if slot >= 0:
        heads = tl.arange(0, BLOCK_KVH)
        h_mask = heads < KVH
        cache = (slot // BS) * stride_cb + (slot % BS) * stride_cs + heads[:, None] * stride_ch
        cache = cache + d[None, :]
        cdt_k = kc_ptr.dtype.element_ty
        tl.store(kc_ptr + cache, k1.to(cdt_k), mask=h_mask[:, None])
        tl.store(kc_ptr + cache + HALF, k2.to(cdt_k), mask=h_mask[:, None])
        src = v_ptr + t * stride_vt + heads[:, None] * stride_vh + d[None, :]
        v1 = tl.load(src, mask=h_mask[:, None], other=0.0)
        v2 = tl.load(src + HALF, mask=h_mask[:, None], other=0.0)
        tl.store(vc_ptr + cache, v1.to(vc_ptr.dtype.element_ty), mask=h_mask[:, None])
        tl.store(vc_ptr + cache + HALF, v2.to(vc_ptr.dtype.element_ty), mask=h_mask[:, None])


def rope_write_kv(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cos: Tensor,
    sin: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
) -> tuple[Tensor, Tensor]:
    """RoPE on q [T, H, D] and k [T, KVH, D] (cos, sin [T, D] in the model dtype), and the
    rotated k and v [T, KVH, D] written at `slot_mapping` [T] (int64; < 0: not written) into the
    pools [num_blocks, block_size, KVH, D]. Returns (q_rot, k_rot), contiguous."""
    if not INTERPRETED and not q.is_cuda:
        raise RuntimeError(NOT_RUNNABLE)
    t, h, d = q.shape
    kvh = k.shape[1]
    if d % 2 or (d // 2) & (d // 2 - 1):
        raise ValueError(f"head_dim must be twice a power of two, got {d}")
    for x in (q, k, v, cos, sin, k_cache, v_cache):
        if x.stride(-1) != 1:
            raise ValueError("the head dimension must be contiguous")
    q_out = torch.empty((t, h, d), dtype=q.dtype, device=q.device)
    k_out = torch.empty((t, kvh, d), dtype=k.dtype, device=k.device)
    if t == 0:
        return q_out, k_out
    _rope_write_kv_kernel[(t,)](
        q, k, v, cos, sin, q_out, k_out, k_cache, v_cache, slot_mapping,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos.stride(0),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        H=h, KVH=kvh, BLOCK_H=triton.next_power_of_2(h), BLOCK_KVH=triton.next_power_of_2(kvh),
        HALF=d // 2, BS=k_cache.shape[1],
    )  # fmt: skip
    return q_out, k_out


def rope_write_kv_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cos: Tensor,
    sin: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
) -> tuple[Tensor, Tensor]:
    """The model's `apply_rope` on q and k, then `kernels.attention.write_kv` (rows with a
    negative slot are not written)."""

    def rope(x: Tensor) -> Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos[:, None, :] + rotated * sin[:, None, :]

    q_rot, k_rot = rope(q), rope(k)
    keep = slot_mapping >= 0
    kvh, d = k_cache.shape[2], k_cache.shape[3]
    slots = slot_mapping[keep]
    k_cache.view(-1, kvh, d).index_copy_(0, slots, k_rot[keep].to(k_cache.dtype))
    v_cache.view(-1, kvh, d).index_copy_(0, slots, v[keep].to(v_cache.dtype))
    return q_rot, k_rot
