"""llama.cpp as the engine benchmark's speed anchor: systems `llamacpp` and `llamacpp-prefix`.

Both run the same GGUF file as tolk through llama-cpp-python's low-level batch API (one sequence
id per prompt, greedy argmax on the logits with numpy); its weights stay quantized, so it is the
speed anchor, not a same-weights comparison. The token ids are the parent's shared prompts.

- `llamacpp`: every prompt token of every sequence is computed (prefill in chunks of
  `--llamacpp-n-batch` tokens), then one `llama_decode` per step with one token per sequence.
- `llamacpp-prefix`: what llama.cpp can do with the shared language prefix that `tolk-prefix`
  gets from its prefix cache. The prefix is decoded once, before the timed runs, into a
  sequence of its own (id B) in a unified KV cache (`kv_unified`); each run gives every
  sequence the prefix with `llama_memory_seq_cp` (cells shared, nothing recomputed) and
  prefills only each sequence's own tokens. Its TTFT and prefill figures exclude the prefix,
  like tolk-prefix's. In a unified cache each token's attention spans every cell of the cache
  under a mask, so whether sharing pays at a given batch size is what this row measures.

Decode is timed on its own: the loop in which every sequence decodes one token per call, from
the first call to the last (`decode_tok_s`, the same phase as tolk's decode-only steps).
"""

from __future__ import annotations

import argparse
import ctypes
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench._common import JSON
from bench.engine_rows import gguf_path, measure, row, run_metrics


def llamacpp_worker(args: argparse.Namespace, prompts: JSON) -> JSON:
    try:
        import llama_cpp
    except ImportError as exc:  # not built on this machine: a note, not a failure
        return {"skipped": f"llama_cpp not importable: {exc}"}

    path = Path(prompts["gguf"]) if prompts.get("gguf") else gguf_path(args.model)
    if path.suffix != ".gguf":
        return {"skipped": f"{path} is not a GGUF file"}
    share_prefix = args.worker == "llamacpp-prefix"

    @ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
    def quiet(level: int, text: bytes, user_data: Any) -> None:
        pass

    llama_cpp.llama_log_set(quiet, None)
    llama_cpp.llama_backend_init()
    t0 = time.perf_counter()
    mparams = llama_cpp.llama_model_default_params()
    mparams.n_gpu_layers = 0
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), mparams)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {path}")
    load_s = time.perf_counter() - t0
    vocab = llama_cpp.llama_model_get_vocab(model)
    n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
    desc = ctypes.create_string_buffer(256)
    llama_cpp.llama_model_desc(model, desc, len(desc))
    # "llama 256M Q4_1" -> gguf-Q4_1; "gemma3 ?B Q4_K - Medium" -> gguf-Q4_K-Medium
    ftype = desc.value.decode(errors="replace").split(" ", 2)[-1]
    quant = "gguf-" + ftype.replace(" - ", "-").replace(" ", "_")
    prefix = prompts["prefix_tokens"] if share_prefix else 0

    rows = []
    ctx_info: JSON = {}
    for batch in args.batches:
        ids = prompts["ids"][:batch]
        if prefix and any(x[:prefix] != ids[0][:prefix] for x in ids):
            raise RuntimeError("the prompts do not share their first prefix_tokens tokens")
        measured, ctx_info = _llamacpp_batch(llama_cpp, model, n_vocab, ids, args, prefix)
        measured["cached_tokens"] = prefix * batch
        rows.append(row(args.worker, args.model, quant, batch, ids) | measured)
    llama_cpp.llama_model_free(model)
    return {
        "dtype": quant,
        "rows": rows,
        "load_s": round(load_s, 2),
        "gguf": str(path),
        "gguf_desc": desc.value.decode(errors="replace"),
        "llama_cpp_version": getattr(llama_cpp, "__version__", None),
        "context": ctx_info,
    }


def _llamacpp_batch(
    llama_cpp: Any,
    model: Any,
    n_vocab: int,
    ids: list[list[int]],
    args: argparse.Namespace,
    prefix: int,
) -> tuple[JSON, JSON]:
    """Measure one batch size: a fresh context with one sequence id per prompt (plus one that
    holds the shared prefix when `prefix` > 0)."""
    import numpy as np

    new, chunk, batch = args.new_tokens, args.llamacpp_n_batch, len(ids)
    own = max(len(x) for x in ids) - prefix
    per_seq = -(-(own + new + 8) // 256) * 256  # KV cells per sequence beyond the prefix
    cparams = llama_cpp.llama_context_default_params()
    cparams.n_ctx = per_seq * batch + (-(-prefix // 256) * 256 if prefix else 0)
    cparams.n_batch = chunk
    cparams.n_ubatch = chunk
    cparams.n_seq_max = batch + (1 if prefix else 0)
    cparams.n_threads = args.threads
    cparams.n_threads_batch = args.threads
    cparams.no_perf = True
    if hasattr(cparams, "kv_unified"):
        cparams.kv_unified = bool(prefix) or args.llamacpp_kv_unified
    elif prefix:
        raise RuntimeError("this llama-cpp-python has no kv_unified: cannot share the prefix")
    ctx = llama_cpp.llama_init_from_model(model, cparams)
    if not ctx:
        raise RuntimeError(f"llama.cpp context for {batch} sequences failed")
    ctx_info = {
        "n_ctx": llama_cpp.llama_n_ctx(ctx),
        "n_batch": chunk,
        "kv_unified": getattr(cparams, "kv_unified", None),
        "flash_attn": _flash_attn_setting(cparams),
        "shared_prefix_tokens": prefix,
    }
    lbatch = llama_cpp.llama_batch_init(max(chunk, batch), 0, 1)
    memory = llama_cpp.llama_get_memory(ctx)
    holder = batch  # the sequence id that keeps the prefix between runs

    def decode(tokens: Sequence[tuple[int, int, int, bool]]) -> None:
        """tokens: (token, pos, seq_id, wants_logits)."""
        lbatch.n_tokens = len(tokens)
        for i, (tok, pos, seq, logits) in enumerate(tokens):
            lbatch.token[i] = tok
            lbatch.pos[i] = pos
            lbatch.n_seq_id[i] = 1
            lbatch.seq_id[i][0] = seq
            lbatch.logits[i] = logits
        rc = llama_cpp.llama_decode(ctx, lbatch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def argmax_row(i: int) -> int:
        ptr = llama_cpp.llama_get_logits_ith(ctx, i)
        return int(np.ctypeslib.as_array(ptr, shape=(n_vocab,)).argmax())

    llama_cpp.llama_memory_clear(memory, True)
    if prefix:  # untimed, like tolk-prefix's engine.warm()
        shared = [(tok, pos, holder, False) for pos, tok in enumerate(ids[0][:prefix])]
        for c in range(0, len(shared), chunk):
            decode(shared[c : c + chunk])

    def once() -> JSON:
        if prefix:
            for s in range(batch):
                llama_cpp.llama_memory_seq_rm(memory, s, -1, -1)
        else:
            llama_cpp.llama_memory_clear(memory, True)
        flat = [
            (tok, pos, seq, pos == len(x) - 1)
            for seq, x in enumerate(ids)
            for pos, tok in enumerate(x)
            if pos >= prefix
        ]
        last: list[int] = [0] * batch
        start = time.perf_counter()
        for s in range(batch if prefix else 0):
            llama_cpp.llama_memory_seq_cp(memory, holder, s, -1, -1)
        for c in range(0, len(flat), chunk):  # prefill, `chunk` tokens per llama_decode
            part = flat[c : c + chunk]
            decode(part)
            for i, (_, _, seq, wants) in enumerate(part):
                if wants:
                    last[seq] = argmax_row(i)
        ttft = time.perf_counter() - start
        seq0 = [last[0]]
        for step in range(new - 1):  # decode: one token per sequence per llama_decode
            decode([(last[s], len(ids[s]) + step, s, True) for s in range(batch)])
            logits = np.ctypeslib.as_array(
                llama_cpp.llama_get_logits(ctx), shape=(batch, n_vocab)
            )  # [B, V]: outputs in batch order
            last = logits.argmax(axis=1).tolist()
            if len(seq0) < 16:
                seq0.append(last[0])
        total = time.perf_counter() - start
        prompt_tokens = sum(len(x) - prefix for x in ids)
        res = run_metrics(batch, prompt_tokens, ttft, total, new, decode_s=total - ttft)
        res["seq0_tokens"] = seq0
        return res

    try:
        return measure(once, args.repeats), ctx_info
    finally:
        llama_cpp.llama_batch_free(lbatch)
        llama_cpp.llama_free(ctx)


def _flash_attn_setting(cparams: Any) -> Any:
    for name in ("flash_attn_type", "flash_attn"):
        if hasattr(cparams, name):
            return {name: getattr(cparams, name)}
    return None
