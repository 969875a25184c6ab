"""Engine throughput and latency: tolk's engine vs transformers `generate` vs llama.cpp, one run.

What is measured, per (system, model, batch, dtype): B distinct real translation prompts (the
engine's own en->de prompt, prefix + query, built from Tatoeba sentences) are submitted at once
and each generates exactly `--new-tokens` (64) tokens, greedy, EOS ignored. From the batch's
time to first token (TTFT: until *every* sequence has its first token), its total time, and the
time of its decode phase:

    prefill tok/s   = prompt tokens computed for the batch / TTFT  (cached prefix excluded)
    decode tok/s    = tokens made in the decode phase / its time
    aggregate tok/s = B * new_tokens / total        (generated tokens over the whole wall time)

The decode phase is the same for every system: the steps in which every sequence of the batch
decodes one token. tolk records each engine step (`Engine.step_trace`: kind, sequences, wall
time) and counts the decode-only steps with all B sequences; transformers' steps are timed by a
logits processor (from the first token's step to the last); llama.cpp's decode loop is timed on
its own (`bench/engine_llamacpp.py`). `decode_tok_s_window` keeps the figure used before,
B * (new_tokens - 1) / (total - TTFT): with chunked prefill, tolk's early sequences decode
inside the TTFT window, so that figure counted tokens made before its window started and
flattered tolk's rows without the shared prefix.

One warm-up run per batch size, then the median of `--repeats` runs (raw values are kept).

All systems see the same token ids: the parent builds the prompts once per model with the
engine's `PromptBuilder` and hands them to the workers; the tolk worker builds its own through
`Engine.translation_request` and checks they match. transformers runs the reference model on the
same dequantized weights (`load_reference_hf_model`), left-padded with an attention mask.
llama.cpp runs the same GGUF file through its low-level batch API (one sequence id per prompt,
greedy argmax on the logits with numpy); its weights stay quantized, so it is the speed anchor,
not a same-weights comparison.

Each system x model runs in its own subprocess (`--worker`) so its peak RSS is its own and no
thread pool or allocator state leaks between systems. Threads: `--threads` (2) for torch and for
llama.cpp (n_threads and n_threads_batch).

Prefix cache: system `tolk` runs with the prefix cache OFF, so it computes every prompt token
as the other systems do (`--prefix-cache` turns it on for it too). System `tolk-prefix` is the
engine as it serves: the language's prompt prefix warmed (`engine.warm`; before every timed
repeat the prefix cache is reset and the prefix warmed again, so no repeat finds the prompts of
the one before), each request prefilling only its own tokens, and the decode steps of the
sequences that share that prefix reading its K/V once per step (cascade attention,
`kernels/attention.py`). Its decode tokens/s still count attention over the whole context of
every sequence; its prefill and TTFT figures exclude the cached prefix, like
`llamacpp-prefix`'s; `cached_tokens` says how many prompt tokens came from the cache. The
prefix cache's TTFT effect is measured separately (in the `tolk` worker): TTFT of one request
whose language prefix is warm (`engine.warm([lang])`) vs cold (prefix cache disabled), median
of `--ttft-trials`.

llama.cpp: `llamacpp` computes every prompt token; `llamacpp-prefix` decodes the language
prefix once and shares it with every sequence (`llama_memory_seq_cp` in a unified KV cache), the
llama.cpp counterpart of `tolk-prefix`. Ratios compare each tolk row with the better llama.cpp
row of the same batch and with llama.cpp's best over all batch sizes.

The machine (CPU model, vendor, family) and the linear backends tolk's start-up probe picked
(`workers/engine/linear_backends.py`) are in the JSON: speed-ups choose themselves per machine.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench._common import (
    JSON,
    emit_worker_result,
    machine_info,
    parse_csv,
    parse_ints,
    peak_rss_mb,
    run_worker,
    safe_ratio,
    summarize,
    thread_env,
    write_json,
)
from bench.engine_rows import gguf_path, measure, prompt_stats, row, run_metrics

log = logging.getLogger("bench.engine")

SYSTEMS = ("tolk", "tolk-prefix", "hf", "llamacpp", "llamacpp-prefix")
TOLK_SYSTEMS = ("tolk", "tolk-prefix")  # the second: prefix cache on, language warm
LLAMACPP_SYSTEMS = ("llamacpp", "llamacpp-prefix")  # the second: the prefix decoded once
SOURCE_LANG, TARGET_LANG = "en", "de"
TTFT_SENTENCE_OFFSET = 500  # TTFT trials use sentences no throughput prompt uses


# -- prompts ------------------------------------------------------------------------------------
def sentences(n: int, offset: int = 0) -> list[str]:
    """`n` distinct English Tatoeba sentences (en->de pairs, past the few-shot region)."""
    from replay.datasets import tatoeba_pairs

    seen: set[str] = set()
    out: list[str] = []
    for en, _ in tatoeba_pairs(TARGET_LANG)[100:]:
        en = en.strip()
        if en and en not in seen:
            seen.add(en)
            out.append(en)
    if len(out) < offset + n:
        raise ValueError(f"only {len(out)} distinct sentences, need {offset + n}")
    return out[offset : offset + n]


def prompt_builder(model: str, tokenizer: Any | None = None) -> Any:
    """The engine's `PromptBuilder` for `model`, without loading its weights."""
    from workers.engine.config import ModelConfig
    from workers.engine.loader import TOLK_CONFIG, checkpoint_dir
    from workers.engine.prompts import PromptBuilder

    directory = checkpoint_dir(model)
    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(directory)
    meta = directory / TOLK_CONFIG
    if meta.exists():
        cfg = ModelConfig.from_dict(json.loads(meta.read_text())["model"])
    else:
        from transformers import AutoConfig

        cfg = ModelConfig.from_hf(AutoConfig.from_pretrained(directory))
    return PromptBuilder(tokenizer, cfg.arch, cfg.bos_token_id, set(cfg.eos_token_ids))


def build_prompts(model: str, max_batch: int, ttft_trials: int) -> JSON:
    """What every worker of one model gets: the texts and the prompt token ids."""
    builder = prompt_builder(model)
    texts = sentences(max_batch)
    ttft_texts = sentences(ttft_trials, TTFT_SENTENCE_OFFSET)
    return {
        "model": model,
        "texts": texts,
        "ids": [builder.build(t, SOURCE_LANG, TARGET_LANG)[0] for t in texts],
        "prefix_tokens": len(builder.prefix_ids(TARGET_LANG)),
        "template": builder.template_name,
        "ttft_texts": ttft_texts,
        "gguf": str(gguf_path(model)),  # so the llama.cpp worker never imports torch
    }


# -- tolk ---------------------------------------------------------------------------------------
def tolk_worker(args: argparse.Namespace, prompts: JSON) -> JSON:
    import dataclasses

    import torch

    from workers.engine import linear_backends
    from workers.engine.engine import Engine, EngineConfig

    torch.set_num_threads(args.threads)
    new = args.new_tokens
    prefix_cache = args.prefix_cache or args.worker == "tolk-prefix"
    cfg = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        quantize=args.quantize,
        compile_decode=args.compile_decode,
        enable_prefix_caching=prefix_cache,
        max_num_seqs=max(args.batches),
        max_new_tokens=new,
        **({"kv_cache_tokens": args.kv_cache_tokens} if args.kv_cache_tokens else {}),
        **({"max_num_batched_tokens": args.max_batched_tokens} if args.max_batched_tokens else {}),
    )
    t0 = time.perf_counter()
    try:
        engine = Engine.from_config(cfg)
    except (ImportError, NotImplementedError, ValueError) as exc:
        if not args.quantize:
            raise
        return {"skipped": f"quantize={args.quantize!r} not available: {type(exc).__name__}: {exc}"}
    load_s = time.perf_counter() - t0
    kv_bytes = kv_cache_bytes(engine.model)
    param_dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in engine.model.parameters()})
    dtype = args.dtype or "float32"
    if args.quantize:  # e.g. int8 weights with bfloat16 activations: "int8-w/bfloat16"
        dtype = f"{args.quantize}-w/{'+'.join(param_dtypes)}"
    if prefix_cache:
        engine.warm([TARGET_LANG])

    def requests(texts: Sequence[str], max_new: int) -> list[Any]:
        return [
            engine.translation_request(
                t, SOURCE_LANG, TARGET_LANG, max_new_tokens=max_new, ignore_eos=True
            )
            for t in texts
        ]

    rows = []
    for batch in args.batches:
        texts = prompts["texts"][:batch]
        expected = prompts["ids"][:batch]
        built = [r.prompt_ids for r in requests(texts, new)]
        if built != expected:
            raise RuntimeError("the engine's prompt ids differ from the shared prompts")

        def once(texts: Sequence[str] = texts, batch: int = batch) -> JSON:
            if prefix_cache:  # untimed: only the language prefix cached, not the last repeat's
                engine.kv.prefix.reset()  # prompts (every repeat sends the same texts)
                engine.warm([TARGET_LANG])
            reqs = requests(texts, new)
            prompt_tokens = sum(len(r.prompt_ids) for r in reqs)
            engine.step_trace = []
            start = time.monotonic()
            for r in reqs:
                r.arrival = start  # TTFT from the moment the batch is submitted
            results = engine.generate(reqs)
            total = time.monotonic() - start
            trace, engine.step_trace = engine.step_trace, None
            bad = [r for r in results if not r.ok or r.tokens_out != new]
            if bad:
                raise RuntimeError(f"tolk: {len(bad)} requests failed: {bad[0]}")
            ttft = max(r.timings.queue_s + r.timings.prefill_s for r in results)
            full = [s for s in trace if s.kind == "decode" and s.num_seqs == batch]
            if not full:
                raise RuntimeError(f"tolk B={batch}: no step in which every sequence decoded")
            cached = sum(r.cached_tokens for r in results)
            out = run_metrics(
                batch,
                prompt_tokens - cached,
                ttft,
                total,
                new,
                decode_s=sum(s.seconds for s in full),
                decode_tokens=sum(s.num_seqs for s in full),
            )
            out["decode_steps"] = {"all_decoding": len(full), "total": len(trace)}
            out["cached_tokens"] = cached
            out["seq0_tokens"] = results[0].token_ids[:16]
            return out

        measured = measure(once, args.repeats)
        rows.append(row(args.worker, args.model, dtype, batch, expected) | measured)
        log.info("tolk %s B=%d done", args.model, batch)

    # TTFT of one request: language prefix warm (prefix cache on, warmed) vs cold (cache off).
    prefix_ttft: JSON = {}
    if args.ttft_trials > 1 and args.worker == "tolk":
        loaded = engine.loaded
        if prefix_cache:  # each engine has its own KV pools: one live engine at a time
            engine = Engine(loaded, dataclasses.replace(cfg, enable_prefix_caching=False))
        cold = single_request_ttft(engine, prompts["ttft_texts"])
        engine = Engine(loaded, dataclasses.replace(cfg, enable_prefix_caching=True))
        engine.warm([TARGET_LANG])
        warm = single_request_ttft(engine, prompts["ttft_texts"])
        prefix_ttft = {
            "cold_s": summarize(cold, 5),
            "warm_s": summarize(warm, 5),
            "ratio_warm_cold": safe_ratio(summarize(warm, 6)["median"],
                                          summarize(cold, 6)["median"]),
            "prompt_tokens": prompt_stats(
                [engine.prompts.build(t, SOURCE_LANG, TARGET_LANG)[0]
                 for t in prompts["ttft_texts"]]
            ),
            "prefix_tokens": prompts["prefix_tokens"],
        }  # fmt: skip
    return {
        "rows": rows,
        "prefix_ttft": prefix_ttft,
        "load_s": round(load_s, 2),
        "kv_cache_mb": round(kv_bytes / 2**20, 1),
        "param_dtypes": param_dtypes,
        "engine_config": dataclasses.asdict(cfg),
        "linear_backends": linear_backends.choices(),
    }


def single_request_ttft(engine: Any, texts: Sequence[str]) -> list[float]:
    """TTFT of one request at a time, one per text; the first is a warm-up and is dropped."""
    times = []
    for text in texts:
        req = engine.translation_request(text, SOURCE_LANG, TARGET_LANG, max_new_tokens=1)
        req.arrival = time.monotonic()
        (res,) = engine.generate([req])
        if not res.ok:
            raise RuntimeError(f"tolk TTFT request failed: {res}")
        times.append(res.timings.queue_s + res.timings.prefill_s)
    return times[1:]


def kv_cache_bytes(model: Any) -> int:
    total = 0
    for module in model.modules():
        for name in ("k_cache", "v_cache"):
            t = getattr(module, name, None)
            if t is not None and hasattr(t, "numel"):
                total += t.numel() * t.element_size()
    return total


# -- transformers -------------------------------------------------------------------------------
def hf_worker(args: argparse.Namespace, prompts: JSON) -> JSON:
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    from workers.engine.loader import load_reference_hf_model

    torch.set_num_threads(args.threads)
    new = args.new_tokens
    t0 = time.perf_counter()
    model, tokenizer = load_reference_hf_model(args.model)
    dtype = getattr(torch, args.dtype or "float32")
    device = torch.device(args.device)
    model = model.to(device=device, dtype=dtype)
    load_s = time.perf_counter() - t0
    pad_id = tokenizer.pad_token_id

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    if pad_id is None:
        pad_id = tokenizer.eos_token_id

    class FirstTokenClock(LogitsProcessor):
        """Called once per step on the logits; the first call is right after prefill."""

        def __init__(self) -> None:
            self.first: float | None = None
            self.last: float | None = None  # the last step's logits: decode = first .. last

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            sync()  # the logits are computed, not just launched
            self.last = time.perf_counter()
            if self.first is None:
                self.first = self.last
            return scores

    rows = []
    for batch in args.batches:
        ids = prompts["ids"][:batch]
        width = max(len(x) for x in ids)
        input_ids = torch.full((batch, width), pad_id, dtype=torch.long)  # [B, L] left-padded
        mask = torch.zeros((batch, width), dtype=torch.long)
        for i, x in enumerate(ids):
            input_ids[i, width - len(x) :] = torch.tensor(x)
            mask[i, width - len(x) :] = 1
        input_ids, mask = input_ids.to(device), mask.to(device)
        prompt_tokens = sum(len(x) for x in ids)

        def once(
            input_ids: torch.Tensor = input_ids,
            mask: torch.Tensor = mask,
            batch: int = batch,
            prompt_tokens: int = prompt_tokens,
        ) -> JSON:
            clock = FirstTokenClock()
            start = time.perf_counter()
            out = model.generate(
                input_ids=input_ids,
                attention_mask=mask,
                do_sample=False,
                num_beams=1,
                min_new_tokens=new,
                max_new_tokens=new,
                pad_token_id=pad_id,
                logits_processor=LogitsProcessorList([clock]),
            )
            sync()
            total = time.perf_counter() - start
            generated = out.shape[1] - input_ids.shape[1]
            if generated != new or clock.first is None or clock.last is None:
                raise RuntimeError(f"transformers generated {generated} tokens, wanted {new}")
            res = run_metrics(
                batch,
                prompt_tokens,
                clock.first - start,
                total,
                new,
                decode_s=clock.last - clock.first,  # new - 1 steps of all B sequences
            )
            res["seq0_tokens"] = out[0, input_ids.shape[1] : input_ids.shape[1] + 16].tolist()
            res["padded_prompt_tokens"] = batch * input_ids.shape[1]
            return res

        with torch.inference_mode():
            measured = measure(once, args.repeats)
        rows.append(row("hf", args.model, args.dtype or "float32", batch, ids) | measured)
        log.info("hf %s B=%d done", args.model, batch)
    return {"rows": rows, "load_s": round(load_s, 2), "attn_implementation":
            getattr(model.config, "_attn_implementation", None)}  # fmt: skip


def llamacpp_worker(args: argparse.Namespace, prompts: JSON) -> JSON:
    from bench.engine_llamacpp import llamacpp_worker as worker  # only its worker loads it

    return worker(args, prompts)


WORKERS: dict[str, Callable[[argparse.Namespace, JSON], JSON]] = {
    "tolk": tolk_worker,
    "tolk-prefix": tolk_worker,
    "hf": hf_worker,
    "llamacpp": llamacpp_worker,
    "llamacpp-prefix": llamacpp_worker,
}


def worker_main(args: argparse.Namespace) -> None:
    if args.prompts_file:
        prompts = json.loads(Path(args.prompts_file).read_text())
    else:
        prompts = build_prompts(args.model, max(args.batches), args.ttft_trials)
    result: JSON = {"system": args.worker, "model": args.model, "dtype": args.dtype}
    try:
        result |= WORKERS[args.worker](args, prompts)
    except Exception as exc:  # the parent records it and goes on with the other systems
        log.exception("worker %s/%s failed", args.worker, args.model)
        result["error"] = f"{type(exc).__name__}: {exc}"
    result["peak_rss_mb"] = peak_rss_mb()
    for r in result.get("rows", []):
        r["peak_rss_mb"] = result["peak_rss_mb"]  # per system x model process, all batches
    torch = sys.modules.get("torch")  # imported by the tolk / hf workers only
    result["torch_threads"] = torch.get_num_threads() if torch is not None else None
    if torch is not None and torch.cuda.is_available() and args.device.startswith("cuda"):
        result["gpu"] = torch.cuda.get_device_name()
        result["peak_gpu_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    emit_worker_result(result)


# -- parent -------------------------------------------------------------------------------------
def common_prefix(a: Sequence[int] | None, b: Sequence[int] | None) -> int | None:
    if a is None or b is None:
        return None
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def ratios(rows: list[JSON]) -> list[JSON]:
    """tolk / transformers and tolk / llama.cpp per (model, batch), on medians.

    `tolk/llamacpp` divides by the better of `llamacpp` and `llamacpp-prefix` at the same
    batch size; `tolk/llamacpp_best` by llama.cpp's best median over both systems and all batch
    sizes (llama.cpp's aggregate peaks at a moderate batch)."""
    by_key = {(r["system"], r["model"], r["batch"]): r for r in rows}
    out = []

    def med(r: JSON, k: str) -> float | None:
        return r[k]["median"] if r.get(k) else None

    def compare(tolk: JSON, ref: JSON) -> JSON:
        return {
            "other": ref["system"],
            "other_batch": ref["batch"],
            "other_dtype": ref["dtype"],
            **{
                k: safe_ratio(med(tolk, k), med(ref, k))
                for k in ("decode_tok_s", "aggregate_tok_s", "prefill_tok_s", "ttft_s")
            },
            "greedy_tokens_agree": common_prefix(tolk.get("seq0_tokens"), ref.get("seq0_tokens")),
        }

    for (system, model, batch), tolk in sorted(by_key.items(), key=lambda kv: kv[0][1:]):
        if system not in TOLK_SYSTEMS:
            continue
        entry: JSON = {"system": system, "model": model, "batch": batch, "dtype": tolk["dtype"]}
        hf = by_key.get(("hf", model, batch))
        if hf is not None:
            entry["tolk/hf"] = compare(tolk, hf)
        same_batch = [
            by_key[k] for k in ((s, model, batch) for s in LLAMACPP_SYSTEMS) if k in by_key
        ]
        if same_batch:
            best = max(same_batch, key=lambda r: r["decode_tok_s"]["median"])
            entry["tolk/llamacpp"] = compare(tolk, best)
        every = [r for (s, m, _), r in by_key.items() if s in LLAMACPP_SYSTEMS and m == model]
        if every:
            best_decode = max(every, key=lambda r: r["decode_tok_s"]["median"])
            best_agg = max(every, key=lambda r: r["aggregate_tok_s"]["median"])
            entry["tolk/llamacpp_best"] = {
                "decode_tok_s": safe_ratio(
                    med(tolk, "decode_tok_s"), med(best_decode, "decode_tok_s")
                ),
                "llamacpp_best_decode": f"{best_decode['system']} B={best_decode['batch']}",
                "aggregate_tok_s": safe_ratio(
                    med(tolk, "aggregate_tok_s"), med(best_agg, "aggregate_tok_s")
                ),
                "llamacpp_best_aggregate": f"{best_agg['system']} B={best_agg['batch']}",
            }
        out.append(entry)
    return out


def worker_args(args: argparse.Namespace, system: str, model: str, prompts_file: str) -> list[str]:
    cmd = [
        "--worker", system, "--model", model,
        "--batches", ",".join(map(str, args.batches)),
        "--repeats", str(args.repeats),
        "--threads", str(args.threads),
        "--new-tokens", str(args.new_tokens),
        "--ttft-trials", str(args.ttft_trials),
        "--llamacpp-n-batch", str(args.llamacpp_n_batch),
        "--prompts-file", prompts_file,
        "--device", args.device,
    ]  # fmt: skip
    if args.dtype:
        cmd += ["--dtype", args.dtype]
    if args.quantize:
        cmd += ["--quantize", args.quantize]
    if args.compile_decode:
        cmd.append("--compile-decode")
    if args.prefix_cache:
        cmd.append("--prefix-cache")
    if args.kv_cache_tokens:
        cmd += ["--kv-cache-tokens", str(args.kv_cache_tokens)]
    if args.max_batched_tokens:
        cmd += ["--max-batched-tokens", str(args.max_batched_tokens)]
    if args.llamacpp_kv_unified:
        cmd.append("--llamacpp-kv-unified")
    return cmd


def parent_main(args: argparse.Namespace) -> JSON:
    import os

    started = time.time()
    load_at_start = [round(x, 2) for x in os.getloadavg()]  # a busy machine makes noisy numbers
    summary: JSON = {
        "benchmark": "engine",
        "config": {
            "models": args.models,
            "batches": args.batches,
            "repeats": args.repeats,
            "systems": args.systems,
            "dtype": args.dtype,
            "device": args.device,
            "quantize": args.quantize,
            "compile_decode": args.compile_decode,
            "new_tokens": args.new_tokens,
            "threads": args.threads,
            "prefix_cache_in_throughput": args.prefix_cache,
            "ttft_trials": args.ttft_trials,
            "kv_cache_tokens": args.kv_cache_tokens,
            "max_batched_tokens": args.max_batched_tokens,
            "prompt": f"engine translation prompt {SOURCE_LANG}->{TARGET_LANG}, "
            "distinct Tatoeba sentences per sequence, EOS ignored, greedy",
        },
        "machine": {},
        "prompts": {},
        "results": [],
        "prefix_ttft": [],
        "workers": [],
        "ratios": [],
        "notes": [
            "ratios are tolk / other on medians: above 1 means tolk is faster for tok/s, "
            "below 1 means tolk is faster for ttft_s",
            "tolk/llamacpp_best divides by llama.cpp's best median over its batch sizes",
            "greedy_tokens_agree: common prefix of sequence 0's first 16 tokens; llama.cpp keeps "
            "the GGUF quantization (and quantizes activations), so it may diverge early",
            "peak_rss_mb is per system x model worker process (all batch sizes); tolk's includes "
            "its preallocated KV pool (kv_cache_mb in workers)",
        ],
    }
    rows: list[JSON] = []
    with tempfile.TemporaryDirectory(prefix="bench-engine-") as tmp:
        for model in args.models:
            prompts = build_prompts(model, max(args.batches), args.ttft_trials)
            prompts_file = str(Path(tmp) / f"{model.replace('/', '_')}.json")
            Path(prompts_file).write_text(json.dumps(prompts))
            summary["prompts"][model] = {
                "template": prompts["template"],
                "prefix_tokens": prompts["prefix_tokens"],
                "tokens": prompt_stats(prompts["ids"]),
            }
            for system in args.systems:
                log.info("running %s on %s", system, model)
                res = run_worker(
                    "bench.engine",
                    worker_args(args, system, model, prompts_file),
                    timeout=args.worker_timeout,
                    env=thread_env(args.threads),
                )
                rows.extend(res.pop("rows", []))
                if res.get("prefix_ttft"):
                    summary["prefix_ttft"].append(
                        {"model": model, "dtype": args.dtype or "float32"} | res.pop("prefix_ttft")
                    )
                res.pop("prefix_ttft", None)
                res.setdefault("system", system)
                res.setdefault("model", model)
                summary["workers"].append(res)
                if "skipped" in res:
                    summary["notes"].append(f"{system}/{model} skipped: {res['skipped']}")
                if "error" in res:
                    summary["notes"].append(f"{system}/{model} failed: {res['error']}")
    summary["results"] = rows
    summary["ratios"] = ratios(rows)
    import torch

    summary["machine"] = machine_info(args.threads) | {
        "torch": torch.__version__,
        "loadavg_start": load_at_start,
    }
    summary["wall_s"] = round(time.time() - started, 1)
    return summary


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.engine", description=__doc__.split("\n\n")[0] if __doc__ else None
    )
    p.add_argument("--models", type=parse_csv, default=["smollm2-135m", "gemma3-270m"])
    p.add_argument("--batches", type=parse_ints, default=[1, 8, 32])
    p.add_argument("--repeats", type=int, default=3, help="timed runs after one warm-up")
    p.add_argument("--systems", type=parse_csv, default=list(SYSTEMS))
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--device", default="cpu", help="cpu or cuda (tolk and transformers)")
    p.add_argument("--quantize", choices=["int8", "int4"], default=None, help="tolk only")
    p.add_argument(
        "--compile-decode",
        action="store_true",
        help="tolk: small decode-only steps through torch.compile (compiled at load)",
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--ttft-trials", type=int, default=8, help="warm/cold TTFT (first dropped)")
    p.add_argument("--prefix-cache", action="store_true", help="tolk throughput with the cache")
    p.add_argument(
        "--kv-cache-tokens", type=int, default=None, help="tolk KV pool size (default: engine's)"
    )
    p.add_argument(
        "--max-batched-tokens",
        type=int,
        default=None,
        help="tolk per-step token budget (default: engine's)",
    )
    p.add_argument("--llamacpp-n-batch", type=int, default=512, help="prefill tokens per decode")
    p.add_argument("--llamacpp-kv-unified", action="store_true")
    p.add_argument("--worker-timeout", type=float, default=3600.0)
    p.add_argument("--out", default="bench/out/engine.json")
    p.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--prompts-file", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    bad = [s for s in args.systems if s not in SYSTEMS]
    if bad:
        p.error(f"unknown systems {bad}; known: {', '.join(SYSTEMS)}")
    if args.repeats < 1 or args.new_tokens < 2:
        p.error("--repeats must be >= 1 and --new-tokens >= 2")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s"
    )
    args = parse_args(argv)
    if args.worker:
        if not args.model:
            raise SystemExit("--worker needs --model")
        worker_main(args)
        return
    summary = parent_main(args)
    write_json(summary, args.out)
    sys.stdout.write(json.dumps(summary, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
