"""A GGUF's weights as a transformers checkpoint, without building a transformers model.

transformers reads a GGUF (`AutoModelForCausalLM.from_pretrained(..., gguf_file=...)`) by
building the model, mapping each GGUF tensor name to one of the model's parameter names, then
dequantizing, fixing up and loading every tensor. On a first start that cost ~30 s of a 2-vCPU
AMD EPYC (family 25 model 1) for Gemma 3 270M: importing the model classes (their generation
code pulls scikit-learn: ~8 s), building the name map by walking every submodule of the model
and asking gguf's `TensorNameMap` once per submodule (~5 s), the model's own construction
and loading. The weights themselves need none of that: this module does the same steps for the
families tolk serves, from the config alone:

1. the config: `AutoConfig` on the GGUF (transformers' own metadata mapping, the same values);
2. the names: the parameter names of the family's causal LM (`_hf_parameter_names`, the
   same list the model's `state_dict()` gives) mapped through gguf's `TensorNameMap` for the
   file's architecture, as transformers' `get_gguf_hf_weights_map` does, once;
3. each tensor dequantized by gguf (`gguf.dequantize`, the function transformers calls) and
   fixed up as transformers' tensor processors do: Llama's q/k rows un-permuted (llama.cpp
   interleaves the rotary halves), Gemma's norm weights less 1 (llama.cpp stores 1 + w);
4. written as transformers' `save_pretrained` writes them: one float32 `model.safetensors`
   (metadata `format: pt`, the tied LM head left out), `config.json` with the class name and
   dtype, `generation_config.json` from the config.

tests/engine/test_gguf_convert.py holds the directory byte for byte equal to what transformers'
model path writes, on Gemma 3 270M and SmolLM2 (Llama); a family not in `CAUSAL_LM_CLASSES`
returns None and the loader takes transformers' path.

Imports gguf, numpy, safetensors and transformers' config classes inside the functions.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

__all__ = [
    "CAUSAL_LM_CLASSES",
    "read_gguf_checkpoint",
    "save_config",
    "save_weights",
    "write_safetensors",
]

# config.model_type -> transformers' causal LM class: the families tolk's model file runs
CAUSAL_LM_CLASSES = {
    "llama": "LlamaForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
_ATTENTION = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
_MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
_NORMS = ("input_layernorm", "post_attention_layernorm")
_QK_NORMS = ("self_attn.q_norm", "self_attn.k_norm")
_GEMMA_NORMS = ("pre_feedforward_layernorm", "post_feedforward_layernorm")
# gguf's architecture names where they differ from transformers' model_type
_GGUF_ARCH = {"gemma3_text": "gemma3"}


def _hf_parameter_names(model_type: str, num_layers: int) -> list[str]:
    """The `state_dict()` names of the family's causal LM (its tied head included)."""
    per_layer = [f"{m}.weight" for m in _ATTENTION + _MLP + _NORMS]
    if model_type == "qwen2":
        per_layer += [f"self_attn.{p}_proj.bias" for p in "qkv"]
    if model_type in ("qwen3", "gemma3_text"):
        per_layer += [f"{m}.weight" for m in _QK_NORMS]
    if model_type == "gemma3_text":
        per_layer += [f"{m}.weight" for m in _GEMMA_NORMS]
    names = ["model.embed_tokens.weight"]
    names += [f"model.layers.{i}.{p}" for i in range(num_layers) for p in per_layer]
    return names + ["model.norm.weight", "lm_head.weight"]


def _gguf_to_hf_names(model_type: str, num_layers: int) -> dict[str, str]:
    """GGUF tensor name -> transformers parameter name (transformers' weights map)."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    wanted = _GGUF_ARCH.get(model_type, model_type)
    arch = next(key for key, value in MODEL_ARCH_NAMES.items() if value == wanted)
    name_map = get_tensor_name_map(arch, num_layers)
    out: dict[str, str] = {}
    for hf_name in _hf_parameter_names(model_type, num_layers):
        module, suffix = hf_name.rsplit(".", 1)
        gguf_name = name_map.get_name(module)
        if gguf_name is not None:
            out[f"{gguf_name}.{suffix}"] = hf_name
    return out


def _unpermute_rotary(weights: Any, n_head: int) -> Any:
    """llama.cpp's q/k row permutation undone (transformers' `_reverse_permute_weights`)."""
    dim = weights.shape[0] // n_head // 2
    w = weights.reshape(n_head, dim, 2, *weights.shape[1:])
    return w.swapaxes(2, 1).reshape(weights.shape)


def read_gguf_checkpoint(path: Path) -> tuple[Any, dict[str, torch.Tensor]] | None:
    """(transformers config, float32 state dict in transformers' names) of a GGUF of a family
    in `CAUSAL_LM_CLASSES`; None for another family (read it with transformers)."""
    import numpy as np
    from gguf import GGUFReader, dequantize
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    if config.model_type not in CAUSAL_LM_CLASSES:
        return None
    names = _gguf_to_hf_names(config.model_type, config.num_hidden_layers)
    reader = GGUFReader(path)
    arch = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")
    state: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        hf_name = names.get(tensor.name)
        if hf_name is None:
            continue  # not a parameter of the model (rope_freqs, ...), as transformers skips
        weights = dequantize(tensor.data, tensor.tensor_type)
        if arch == "llama" and (".attn_q." in tensor.name or ".attn_k." in tensor.name):
            heads = config.num_attention_heads
            if ".attn_k." in tensor.name:
                heads = config.num_key_value_heads or heads
            weights = _unpermute_rotary(weights, heads)
        elif arch in ("gemma2", "gemma3") and "norm.weight" in tensor.name:
            weights = weights - 1
        if np.may_share_memory(weights, tensor.data):  # the file's own bytes (F32): copied,
            weights = np.copy(weights)  # as transformers does; dequantized arrays are new
        state[hf_name] = torch.from_numpy(weights).to(torch.float32)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return config, state


def save_config(directory: Path, config: Any) -> None:
    """`config.json` and `generation_config.json` as the model's `save_pretrained` writes them."""
    from transformers import GenerationConfig

    config.architectures = [CAUSAL_LM_CLASSES[config.model_type]]
    config.dtype = torch.float32
    config.save_pretrained(directory)
    GenerationConfig.from_model_config(config).save_pretrained(directory)


def save_weights(directory: Path, state: dict[str, torch.Tensor]) -> None:
    """`model.safetensors` as the model's `save_pretrained` writes it (one file, `format: pt`),
    through `write_safetensors`."""
    write_safetensors(directory / "model.safetensors", state, {"format": "pt"})


def write_safetensors(
    path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]
) -> None:
    """The bytes `safetensors.torch.save_file` writes for float32 tensors, written from the
    tensors' own memory with the GIL released: safetensors copies every tensor to `bytes` and
    writes them holding the GIL, which stalled a first start's main thread ~5 s while the
    weights were written beside it (loader.py, `weights_in_background`).

    The format, as safetensors 0.6 lays it out: an 8-byte little-endian header length, the
    header (compact JSON: `__metadata__`, then each tensor's dtype, shape and byte range in
    file order, padded with spaces to a multiple of 8), the tensors' bytes sorted by name
    (all of one dtype). tests/engine/test_gguf_convert.py holds the bytes equal to
    safetensors' own."""
    import json
    import struct

    if any(t.dtype != torch.float32 for t in tensors.values()):
        raise ValueError("write_safetensors writes float32 tensors only")
    names = sorted(tensors)
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name in names:
        t = tensors[name]
        size = t.numel() * t.element_size()
        header[name] = {
            "dtype": "F32",
            "shape": list(t.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for name in names:
            data = tensors[name].detach().contiguous()
            if data.numel():
                f.write(data.numpy().data.cast("B"))  # the write releases the GIL
