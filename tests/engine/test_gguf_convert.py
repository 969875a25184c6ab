"""The GGUF conversion without a transformers model (workers/engine/gguf_convert.py).

Gemma 3's conversion is held byte for byte to transformers' model path in
tests/engine/test_disk_cache.py; here: SmolLM2 (a Llama GGUF, whose q/k rows llama.cpp
permutes) the same way, each family's parameter names against the transformers model's own
`state_dict()`, and the tokenizer a converting process keeps against the one read back.
"""

from __future__ import annotations

import filecmp
from pathlib import Path
from typing import Any

import pytest
import torch

from workers.engine import gguf_convert, loader

pytestmark = pytest.mark.slow

TINY = {
    "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
}  # fmt: skip


@pytest.mark.parametrize("model_type", sorted(gguf_convert.CAUSAL_LM_CLASSES))
def test_each_familys_names_are_its_transformers_models(model_type: str) -> None:
    import transformers
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type, **TINY)
    cls = getattr(transformers, gguf_convert.CAUSAL_LM_CLASSES[model_type])
    with torch.device("meta"):
        model = cls(config)
    expected = sorted(model.state_dict())
    assert sorted(gguf_convert._hf_parameter_names(model_type, 2)) == expected


def test_a_llama_gguf_converts_to_transformers_bytes(tmp_path: Path) -> None:
    _, path = loader.resolve_source("smollm2-135m")
    loader._convert_gguf(path, tmp_path / "fast")
    loader._convert_gguf(path, tmp_path / "transformers", via_transformers=True)
    names = sorted(p.name for p in (tmp_path / "transformers").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "fast").iterdir())
    assert "model.safetensors" in names
    for name in names:
        if name != loader.TOLK_CONFIG:
            a, b = tmp_path / "transformers" / name, tmp_path / "fast" / name
            assert filecmp.cmp(a, b, shallow=False), name


def test_an_unknown_family_is_left_to_transformers(monkeypatch: pytest.MonkeyPatch) -> None:
    _, path = loader.resolve_source("smollm2-135m")
    monkeypatch.delitem(gguf_convert.CAUSAL_LM_CLASSES, "llama")
    assert gguf_convert.read_gguf_checkpoint(path) is None


def _same_tokenizer(kept: Any, read: Any) -> None:
    texts = [
        "Where is my parcel? I ordered it on 3 March.",
        "Ich möchte mein Abonnement kündigen, bitte.",
        "  two  spaces\nand a newline\n\n<b>bold</b> 😀 ½",
    ]
    assert kept.backend_tokenizer.to_str() == read.backend_tokenizer.to_str()
    assert kept.all_special_tokens == read.all_special_tokens
    assert (kept.bos_token_id, kept.eos_token_id, kept.pad_token_id) == (
        read.bos_token_id, read.eos_token_id, read.pad_token_id,
    )  # fmt: skip
    for text in texts:
        ids = read(text)["input_ids"]
        assert kept(text)["input_ids"] == ids
        assert kept.decode(ids) == read.decode(ids)
    chat = [{"role": "user", "content": texts[0]}]
    if read.chat_template is not None:
        assert kept.apply_chat_template(chat, tokenize=False) == read.apply_chat_template(
            chat, tokenize=False
        )


@pytest.mark.parametrize("preset", ["gemma3-270m", "smollm2-135m"])
def test_the_converting_process_keeps_the_tokenizer_it_saved(
    preset: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoTokenizer

    monkeypatch.setattr(loader, "_SAVED_TOKENIZERS", {})
    _, path = loader.resolve_source(preset)
    target = tmp_path / "converted"
    loader._convert_gguf(path, target)
    kept = loader._SAVED_TOKENIZERS[str(target)]
    read = AutoTokenizer.from_pretrained(target, fix_mistral_regex=False)
    _same_tokenizer(kept, read)
    # `_tokenizer` hands it out once, then reads the directory as any other
    loader._tokenizer.cache_clear()
    try:
        assert loader._tokenizer(str(target), None, ()) is kept
        assert str(target) not in loader._SAVED_TOKENIZERS
    finally:
        loader._tokenizer.cache_clear()


def test_a_first_load_serves_from_memory_while_the_cache_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`load_model` on an empty cache: the model from the converted weights in memory, the
    weights file written by a thread, the entry published when complete and then byte for
    byte a synchronous conversion's, even with the model prepared for serving meanwhile
    (int8 swaps); a second load in the process waits for the file and reads it."""
    import threading

    from workers.engine.prepare import Preparation, prepare_model

    written = threading.Event()
    slow = gguf_convert.save_weights

    def save_weights_later(directory: Path, state: dict[str, torch.Tensor]) -> None:
        assert written.wait(60)  # held until the load has returned and prepared the model
        slow(directory, state)

    monkeypatch.setattr(gguf_convert, "save_weights", save_weights_later)
    first = loader.load_model("smollm2-135m", cache_dir=tmp_path / "weights")
    (entry,) = loader._WRITERS  # the writer still holds the entry back
    assert not Path(entry).exists()
    prepare_model(first, Preparation(quantize="int8"))
    written.set()
    second = loader.load_model("smollm2-135m", cache_dir=tmp_path / "weights")
    assert Path(entry).is_dir() and not loader._WRITERS
    assert second.source_hash == first.source_hash == Path(entry).name
    monkeypatch.setattr(gguf_convert, "save_weights", slow)
    _, path = loader.resolve_source("smollm2-135m")
    loader._convert_gguf(path, tmp_path / "sync")
    assert filecmp.cmp(
        Path(entry) / "model.safetensors", tmp_path / "sync" / "model.safetensors", shallow=False
    )


def test_a_failed_background_write_leaves_no_entry_and_serving_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full_disk(directory: Path, state: dict[str, torch.Tensor]) -> None:
        (directory / "model.safetensors").write_bytes(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(gguf_convert, "save_weights", full_disk)
    loaded = loader.load_model("smollm2-135m", cache_dir=tmp_path / "weights")
    for writer in list(loader._WRITERS.values()):
        writer.join(60)
    assert not loader._WRITERS
    assert list((tmp_path / "weights").iterdir()) == []  # neither the entry nor its temp dir
    assert loaded.tokenizer("Where is my parcel?")["input_ids"]
    assert loaded.model.embed.weight.shape[0] == loaded.config.vocab_size
    assert torch.isfinite(loaded.model.embed.weight).all()


def test_the_safetensors_writer_writes_safetensors_own_bytes(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    g = torch.Generator().manual_seed(0)
    tensors = {
        "model.layers.10.mlp.up_proj.weight": torch.randn(7, 5, generator=g),
        "model.layers.2.mlp.up_proj.weight": torch.randn(3, 5, generator=g),
        "model.norm.weight": torch.randn(5, generator=g),
        "lm_head.weight": torch.randn(11, 5, generator=g).t().contiguous().t(),  # a view
        "scalar": torch.tensor(1.5),
        "empty": torch.zeros(0, 4),
    }
    for metadata in ({"format": "pt"}, {}):
        ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
        gguf_convert.write_safetensors(ours, tensors, metadata)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(theirs), metadata or None)
        assert ours.read_bytes() == theirs.read_bytes()
        back = load_file(str(ours))
        assert all(torch.equal(back[k], v) for k, v in tensors.items())
    with pytest.raises(ValueError, match="float32"):
        gguf_convert.write_safetensors(ours, {"w": torch.ones(2, dtype=torch.float16)}, {})
