"""Runtime swaps: probed projections replace float32 Linears; fused q/k/v and gate/up are
bit-identical; int8 stays close to float32. (The backends themselves:
tests/engine/test_linear_backends.py.)"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kernels.int8_linear import quantize_int8
from workers.engine import linear_backends
from workers.engine.linear_backends import ProbedLinear, probed_linears_available
from workers.engine.swaps import (
    WeightOnlyInt4Linear,
    WeightOnlyInt8Linear,
    convert_for_runtime,
    fuse_gate_up,
    fuse_qkv,
    pack_linears,
)


@pytest.mark.skipif(not probed_linears_available(), reason="torch built without MKL or oneDNN")
def test_pack_linears_swaps_only_float32_cpu_linears() -> None:
    model = nn.Sequential(
        nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False).to(torch.bfloat16)
    )
    assert pack_linears(model) == 1
    assert isinstance(model[0], ProbedLinear)
    assert isinstance(model[1], nn.Linear)
    assert "8x8" in linear_backends.choices()  # the shape was probed


@pytest.mark.skipif(not probed_linears_available(), reason="torch built without MKL or oneDNN")
def test_pack_linears_leaves_lm_head_sized_matrices_alone() -> None:
    model = nn.Sequential(nn.Linear(64, 64, bias=False), nn.Linear(64, 4096, bias=False))
    assert pack_linears(model, max_numel=64 * 64) == 1
    assert isinstance(model[0], ProbedLinear) and isinstance(model[1], nn.Linear)


@pytest.mark.parametrize("n,k", [(64, 32), (1536, 576)])
def test_int8_quantization_error_is_bounded(n: int, k: int) -> None:
    torch.manual_seed(0)
    w = torch.randn(n, k)
    q, scales = quantize_int8(w)
    assert q.dtype == torch.int8 and scales.shape == (n,)
    err = (q.float() * scales[:, None] - w).abs()
    assert torch.all(err <= scales[:, None] / 2 + 1e-6)  # at most half a quantization step


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_int8_linear_matches_dequantized_reference(dtype: torch.dtype) -> None:
    # float32 activations: tolk's C++ op; bfloat16: torch's _weight_int8pack_mm
    torch.manual_seed(0)
    lin = nn.Linear(576, 192, bias=False)
    q8 = WeightOnlyInt8Linear(lin)
    assert q8.weight.dtype == torch.int8 and q8.scales.dtype == torch.float32
    x = torch.randn(4, 576)
    ref = x @ (q8.weight.float() * q8.scales[:, None]).T
    y = q8(x.to(dtype))
    assert y.dtype == dtype
    tol = 2e-3 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(y.float(), ref, rtol=tol, atol=tol)


def test_convert_for_runtime_int8_keeps_the_model_dtype(tiny_config) -> None:
    model = _tiny_model(tiny_config("llama", vocab_size=256, num_hidden_layers=2))
    fuse_qkv(model)
    fuse_gate_up(model)
    convert_for_runtime(model, "int8")
    int8 = [m for m in model.modules() if isinstance(m, WeightOnlyInt8Linear)]
    assert len(int8) == 2 * 4 + 1  # per layer: fused qkv, o, fused gate/up, down; + the LM head
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert model.embed.weight.dtype == torch.float32  # norms and embeddings untouched
    convert_for_runtime(model, "int8")  # idempotent
    assert sum(isinstance(m, WeightOnlyInt8Linear) for m in model.modules()) == len(int8)


def test_convert_for_runtime_int4_keeps_the_head_int8_and_stays_close(tiny_config) -> None:
    # hidden 64 (int4 needs a multiple of 32), intermediate 48 (down_proj's input: not one)
    cfg = tiny_config("llama", vocab_size=256, num_hidden_layers=2, intermediate_size=48)
    model = _tiny_model(cfg)
    q_float = model.layers[0].attn.q_proj.weight.detach().clone()
    convert_for_runtime(model, "int4")
    int4 = [m for m in model.modules() if isinstance(m, WeightOnlyInt4Linear)]
    int8 = [m for m in model.modules() if isinstance(m, WeightOnlyInt8Linear)]
    assert len(int4) == 2 * 6  # per layer: q, k, v, o, gate, up (input width 64)
    assert len(int8) == 2 + 1  # per layer down_proj (input 48); the LM head
    assert isinstance(model.lm_head, WeightOnlyInt8Linear)
    q = model.layers[0].attn.q_proj
    assert isinstance(q, WeightOnlyInt4Linear)
    assert q.weight.dtype == torch.uint8 and q.scales.dtype == torch.float16
    x = torch.randn(3, 64)
    want = x @ q_float.T
    err = (q(x) - want).norm() / want.norm()
    assert 1e-4 < float(err) < 0.15  # lossy (4 bits), but the same map
    with pytest.raises(ValueError, match="int4"):
        convert_for_runtime(model, "int3")


def _tiny_model(hf_config: object) -> nn.Module:
    from transformers import AutoModelForCausalLM

    from workers.engine.config import ModelConfig
    from workers.engine.loader import model_from_hf_state_dict

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    return model_from_hf_state_dict(hf.state_dict(), ModelConfig.from_hf(hf_config))


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen2", "qwen3"])
@pytest.mark.parametrize("swap", ["plain", "packed", "int8", "int4"])
def test_fused_projections_are_bit_identical(
    arch: str, swap: str, greedy, tiny_config, monkeypatch: pytest.MonkeyPatch
) -> None:
    import copy

    layers = 4 if arch == "gemma3" else 2
    model = _tiny_model(tiny_config(arch, vocab_size=256))
    fused = copy.deepcopy(model)
    assert fuse_qkv(fused) == layers and fuse_qkv(fused) == 0  # once per layer, idempotent
    assert fuse_gate_up(fused) == layers and fuse_gate_up(fused) == 0
    attn, mlp = fused.layers[0].attn, fused.layers[0].mlp  # type: ignore[index]
    h, kvh, hd = attn.num_heads, attn.num_kv_heads, attn.head_dim
    assert attn.q_proj is None and attn.qkv_proj.weight.shape == ((h + 2 * kvh) * hd, 64)
    assert mlp.gate_proj is None and mlp.up_proj is None
    assert mlp.gate_up_proj.weight.shape == (2 * 96, 64)
    if swap == "packed":
        if "mkl-packed" not in linear_backends.available_backends():
            pytest.skip("no MKL")
        # MKL computes each output column alike whatever N is: fused and separate projections
        # stay bit-identical on one backend (the probe may pick others per shape; pinned here)
        pinned = lambda n, k: linear_backends.ShapeChoice((n, k), ("mkl-packed",) * 4, {})  # noqa: E731
        monkeypatch.setattr(linear_backends, "probe_shape", pinned)
        pack_linears(model)
        pack_linears(fused)
        assert isinstance(attn.qkv_proj, ProbedLinear)
    elif swap in ("int8", "int4"):  # quantized per output row: the fused codes are the same
        convert_for_runtime(model, swap)
        convert_for_runtime(fused, swap)
        kind = WeightOnlyInt8Linear if swap == "int8" else WeightOnlyInt4Linear
        assert isinstance(attn.qkv_proj, kind) and isinstance(mlp.gate_up_proj, kind)
    prompts = [[1, 5, 9, 13, 2, 7, 30, 31, 40], [3, 4, 250, 17]]
    tokens, logits = greedy(model, prompts, 6, block_size=4, prefill_chunks=2)
    fused_tokens, fused_logits = greedy(fused, prompts, 6, block_size=4, prefill_chunks=2)
    assert fused_tokens == tokens
    assert all(torch.equal(a, b) for a, b in zip(logits, fused_logits, strict=True))
