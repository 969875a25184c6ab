"""The decoder's shape and numerics, one frozen dataclass for Llama, Gemma 3, Qwen 2 and Qwen 3.

`model.py` has no per-architecture classes: every difference between the families is a field
here (norm form, activation, QK-norm, sandwich norms, embedding scale, sliding-window layers,
per-layer RoPE base, biases on the q/k/v projections). `ModelConfig.from_hf` reads a
transformers config object (LlamaConfig, Gemma3TextConfig or a multimodal Gemma3Config through
its text config, Qwen2Config, Qwen3Config); `to_dict`/`from_dict` round-trip it through the JSON
the loader caches beside the weights.

Qwen 2 / 2.5 is Llama's layout plus biases on q, k and v (`qkv_bias`), with its own RoPE base
(1e6) and norm epsilon (1e-6) read from the config like any other; Qwen 3 drops the biases and
adds Llama-style RMSNorm per head of q and k (`qk_norm` without `norm_one_plus`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

Arch = Literal["llama", "gemma3", "qwen2", "qwen3"]
LayerType = Literal["full", "sliding"]


@dataclass(frozen=True)
class ModelConfig:
    arch: Arch
    vocab_size: int
    hidden_size: int  # D
    intermediate_size: int  # MLP width
    num_layers: int
    num_heads: int  # H
    num_kv_heads: int  # KVH (GQA: H = KVH * groups)
    head_dim: int
    rms_norm_eps: float
    rope_theta: float  # RoPE base of the full-attention layers
    rope_local_theta: float  # RoPE base of the sliding-window layers (Gemma 3: 10k)
    rope_scaling_factor: float | None  # linear RoPE scaling of the full layers, None = off
    sliding_window: int | None  # tokens a sliding layer sees (itself included); None for Llama
    layer_types: tuple[LayerType, ...]  # per layer: "full" or "sliding" (also the KV group)
    tie_word_embeddings: bool  # lm_head shares the embedding matrix
    query_pre_attn_scalar: float  # attention scale is query_pre_attn_scalar ** -0.5
    hidden_activation: Literal["silu", "gelu_tanh"]  # SwiGLU (Llama) / GeGLU tanh (Gemma)
    embed_scale: float  # embeddings are multiplied by it: sqrt(D) for Gemma, 1.0 for Llama
    qk_norm: bool  # RMSNorm over each head of q and k before RoPE (Gemma 3, Qwen 3)
    norm_one_plus: bool  # Gemma's RMSNorm: x_hat * (1 + w) in float32
    post_norms: bool  # Gemma's sandwich: extra norms after attention and after the MLP
    qkv_bias: bool = False  # biases on the q, k and v projections (Qwen 2)
    final_logit_softcapping: float | None = None  # logits = c * tanh(logits / c)
    attn_logit_softcapping: float | None = None  # same on attention scores
    max_position_embeddings: int = 8192
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()  # any of these ends a generation
    pad_token_id: int | None = None

    @property
    def attn_scale(self) -> float:
        return float(self.query_pre_attn_scalar**-0.5)

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def kv_groups(self) -> tuple[LayerType, ...]:
        """The KV cache groups this model uses, in a fixed order ("full" first)."""
        groups: tuple[LayerType, ...] = ("full", "sliding")
        return tuple(g for g in groups if g in self.layer_types)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in names}
        kwargs["layer_types"] = tuple(kwargs["layer_types"])
        kwargs["eos_token_ids"] = tuple(kwargs.get("eos_token_ids", ()))
        return cls(**kwargs)

    @classmethod
    def from_hf(cls, hf_config: Any) -> ModelConfig:
        """Build from a transformers config (Llama, Gemma3Text, or Gemma3 multimodal)."""
        cfg = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        model_type = getattr(cfg, "model_type", "")
        num_heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
        eos = _as_tuple(getattr(cfg, "eos_token_id", None))
        if not eos:
            eos = _as_tuple(getattr(hf_config, "eos_token_id", None))
        common: dict[str, Any] = dict(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.rms_norm_eps),
            rope_theta=float(cfg.rope_theta),
            rope_scaling_factor=_linear_rope_factor(getattr(cfg, "rope_scaling", None)),
            max_position_embeddings=int(getattr(cfg, "max_position_embeddings", 8192)),
            bos_token_id=getattr(cfg, "bos_token_id", None),
            eos_token_ids=eos,
            pad_token_id=getattr(cfg, "pad_token_id", None),
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", True)),
        )
        if model_type.startswith("gemma3"):
            if getattr(cfg, "use_bidirectional_attention", False):
                raise NotImplementedError("bidirectional Gemma 3 (embedding models) unsupported")
            layer_types = tuple(
                "sliding" if t == "sliding_attention" else "full" for t in cfg.layer_types
            )
            return cls(
                arch="gemma3",
                rope_local_theta=float(cfg.rope_local_base_freq),
                sliding_window=cfg.sliding_window,
                layer_types=layer_types,  # type: ignore[arg-type]
                query_pre_attn_scalar=float(cfg.query_pre_attn_scalar),
                hidden_activation=_activation(cfg.hidden_activation),
                embed_scale=cfg.hidden_size**0.5,
                qk_norm=True,
                norm_one_plus=True,
                post_norms=True,
                final_logit_softcapping=getattr(cfg, "final_logit_softcapping", None),
                # transformers' Gemma 3 attention never applies attn_logit_softcapping (the
                # released configs set it to null); follow the reference, not the field
                attn_logit_softcapping=None,
                **common,
            )
        if model_type in ("llama", "qwen2", "qwen3"):
            # Qwen 2's q/k/v biases are fixed by its architecture, not a config field
            qkv_bias = model_type == "qwen2" or bool(getattr(cfg, "attention_bias", False))
            if getattr(cfg, "mlp_bias", False) or (model_type == "llama" and qkv_bias):
                raise NotImplementedError(f"{model_type} with these biases is not supported")
            if getattr(cfg, "use_sliding_window", False):
                raise NotImplementedError(f"{model_type} with sliding-window layers unsupported")
            return cls(
                arch=model_type,  # type: ignore[arg-type]
                rope_local_theta=float(cfg.rope_theta),
                sliding_window=None,
                layer_types=("full",) * cfg.num_hidden_layers,
                query_pre_attn_scalar=float(head_dim),
                hidden_activation=_activation(cfg.hidden_act),
                embed_scale=1.0,
                qk_norm=model_type == "qwen3",
                norm_one_plus=False,
                post_norms=False,
                qkv_bias=qkv_bias,
                **common,
            )
        raise NotImplementedError(
            f"unsupported model_type {model_type!r} (llama, gemma3, qwen2, qwen3 only)"
        )


def _as_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _activation(name: str) -> Literal["silu", "gelu_tanh"]:
    if name in ("silu", "swish"):
        return "silu"
    if name in ("gelu_pytorch_tanh", "gelu_tanh", "gelu_new", "gelu_fast"):
        return "gelu_tanh"
    raise NotImplementedError(f"unsupported activation {name!r}")


def _linear_rope_factor(rope_scaling: dict[str, Any] | None) -> float | None:
    if not rope_scaling:
        return None
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type == "linear":
        return float(rope_scaling["factor"])
    raise NotImplementedError(f"unsupported rope_scaling type {rope_type!r} (linear only)")
