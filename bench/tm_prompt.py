"""Retrieved examples in the prompt (issue #15): chrF of BConTrasT dev with the k nearest
translation-memory pairs as the prompt's examples against the fixed examples alone, and the
latency the retrieval adds.

    nice -n 5 python -m bench.tm_prompt --per-direction 200 --k 4 --out bench/out/tm_prompt.json

The TM is BConTrasT **train** (customer de->en, agent en->de), imported and indexed as `tolk tm
import` / `tolk tm build` do (`workers.tm.store`, `workers.tm.phrase_index.choose_params`: about
7k pairs per direction, so the exact flat index that `tm build` writes below 10,000 pairs) and
opened memory-mapped as a worker opens it. The test items are the first `--per-direction` turns
of each direction of BConTrasT **dev** (different conversations), in conversation order.

Variants, every one on the same items with the same engine (`--model`, greedy, cap 256 tokens,
no faithfulness wrapper: the prompt's effect alone):
- `fixed`: the model's default prompt form (instructions and its fixed examples);
- `retrieved`: the same prefix, then the k retrieved pairs (nearest last), then the query:
  what `tolk worker --tm-examples K` sends (`workers.stages.examples.stage`);
- `retrieved_only`: the zero-shot instructions, then the k retrieved pairs (examples chosen
  only by retrieval).

Per direction and variant: chrF (sacrebleu statistics, `replay.quality`), and the difference to
`fixed` with a paired bootstrap 95 % interval (`replay.stats.paired_bootstrap`) and its verdict;
mean prompt tokens and mean prompt tokens served from the prefix cache. Retrieval latency per
request (`ExampleRetriever.retrieve`, one request at a time, the code path of the worker):
embedding, search and their sum, P50 / P99, for the index `tm build` writes and, with
`--ivfpq`, for an IVF-PQ index of the same pairs (search only; the same query vectors). Prefill
time added by the longer prompt: `--prefill-sample` requests per direction run one at a time
with one output token (prefix cache warm), P50 per variant. JSON on stdout and in `--out`,
with every output.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench._common import machine_info, parse_csv, write_json

LANGUAGE_CAP = 256  # DEFAULT_MAX_NEW_TOKENS of workers/fairness/policy.py
DIRECTIONS = (("en", "de"), ("de", "en"))
VARIANTS = ("fixed", "retrieved", "retrieved_only")
WARMUP_QUERIES = 5


def tm_pairs(split: str) -> list[Any]:
    """BConTrasT `split` as TM pairs (origin `bcontrast/<split>:<conversation>:<turn>`)."""
    from replay.datasets import bcontrast
    from workers.tm.formats import TMPair

    return [
        TMPair(
            u.source_lang,
            u.target_lang,
            u.source,
            u.target,
            origin=f"bcontrast/{split}:{u.conversation_id}:{u.turn}",
        )
        for u in bcontrast(split)
        if u.source.strip() and u.target.strip()
    ]


def build_tm(tm_dir: Path, embedder: Any, ivfpq_dir: Path | None) -> dict[str, Any]:
    """Import BConTrasT train into `tm_dir` and build each direction's index as `tolk tm build`
    does; with `ivfpq_dir`, also an IVF-PQ index of the same pairs and vectors there."""
    from workers.tm.phrase_index import PhraseIndex, choose_params
    from workers.tm.store import TranslationMemoryDir

    tm = TranslationMemoryDir(tm_dir)
    counts = tm.add(tm_pairs("train"))
    report: dict[str, Any] = {"imported": counts.added, "duplicates": counts.duplicates}
    for src, tgt in DIRECTIONS:
        pairs = tm.load_pairs(src, tgt)
        started = time.perf_counter()
        vectors = embedder.embed([p.source for p in pairs])
        embed_s = time.perf_counter() - started
        params = choose_params(len(pairs), embedder.dimension)
        built = PhraseIndex.build(tm.index_dir(src, tgt), pairs, embedder, params, vectors)
        row: dict[str, Any] = {
            "pairs": len(pairs),
            "kind": params.kind,
            "embed_s": round(embed_s, 1),
            "build_s": built.manifest.build_seconds,
        }
        if ivfpq_dir is not None:
            ivf = choose_params(len(pairs), embedder.dimension, kind="ivfpq")
            PhraseIndex.build(TranslationMemoryDir(ivfpq_dir).index_dir(src, tgt), pairs,
                              embedder, ivf, vectors)  # fmt: skip
            row["ivfpq_params"] = [ivf.nlist, ivf.m, ivf.nbits, ivf.nprobe]
        report[f"{src}-{tgt}"] = row
        print(f"built {src}-{tgt}: {row}", file=sys.stderr, flush=True)
    return report


def percentiles_ms(seconds: list[float]) -> dict[str, float]:
    ms = np.asarray(seconds) * 1e3
    return {
        "p50_ms": round(float(np.percentile(ms, 50)), 3),
        "p99_ms": round(float(np.percentile(ms, 99)), 3),
        "mean_ms": round(float(ms.mean()), 3),
        "n": len(ms),
    }


def retrieve_all(retriever: Any, items: list[Any]) -> tuple[list[Any], dict[str, Any]]:
    """Each item's retrieval, one request at a time, and the latency figures."""
    for it in items[:WARMUP_QUERIES]:  # load the embedding model, page the index in
        retriever.retrieve(it.source_lang, it.target_lang, it.source)
    found = [retriever.retrieve(it.source_lang, it.target_lang, it.source) for it in items]
    latency: dict[str, Any] = {}
    for src, tgt in DIRECTIONS:
        rows = [f for f, it in zip(found, items, strict=True) if it.source_lang == src]
        latency[f"{src}-{tgt}"] = {
            "embed": percentiles_ms([f.embed_s for f in rows]),
            "search": percentiles_ms([f.search_s for f in rows]),
            "total": percentiles_ms([f.seconds for f in rows]),
            "top_similarity_median": round(
                float(np.median([f.top_similarity or 0.0 for f in rows])), 3
            ),
            "exact_match_share": round(
                float(np.mean([(f.top_similarity or 0.0) >= 0.999 for f in rows])), 3
            ),
        }
    return found, latency


def ivfpq_search_latency(ivfpq_dir: Path, embedder: Any, items: list[Any], k: int) -> Any:
    """Search-only latency of the IVF-PQ indexes (memory-mapped) on the items' vectors."""
    from workers.tm.phrase_index import PhraseIndexes

    indexes = PhraseIndexes.open(ivfpq_dir, embedder)
    out = {}
    for src, tgt in DIRECTIONS:
        index = indexes.indexes[(src, tgt)]
        vectors = embedder.embed([it.source for it in items if it.source_lang == src])
        for v in vectors[:WARMUP_QUERIES]:
            index.search(v[None, :], 2 * k)
        times = []
        for v in vectors:
            started = time.perf_counter()
            index.search(v[None, :], 2 * k)
            times.append(time.perf_counter() - started)
        out[f"{src}-{tgt}"] = percentiles_ms(times)
    return out


def requests_for(engine: Any, items: list[Any], found: list[Any], variant: str, cap: int) -> Any:
    form = "zero_shot" if variant == "retrieved_only" else None
    return [
        engine.translation_request(
            it.source,
            it.source_lang,
            it.target_lang,
            max_new_tokens=cap,
            prompt_form=form,
            examples=f.examples if variant != "fixed" else (),
        )
        for it, f in zip(items, found, strict=True)
    ]


def prefill_latency(engine: Any, items: list[Any], found: list[Any], variants: list[str],
                    sample: int) -> dict[str, Any]:  # fmt: skip
    """P50 time to the first token, one request at a time, per direction and variant."""
    out: dict[str, Any] = {}
    for src, tgt in DIRECTIONS:
        idx = [i for i, it in enumerate(items) if it.source_lang == src][:sample]
        for variant in variants:
            reqs = requests_for(engine, [items[i] for i in idx], [found[i] for i in idx],
                                variant, 1)  # fmt: skip
            times = []
            for req in reqs:
                started = time.perf_counter()
                engine.generate([req])
                times.append(time.perf_counter() - started)
            out[f"{src}-{tgt}/{variant}"] = percentiles_ms(times)
    return out


def summarize(items: list[Any], results: dict[str, list[Any]]) -> dict[str, Any]:
    from replay.quality import chrf_statistics
    from replay.stats import chrf_from_sums, paired_bootstrap, verdict

    out: dict[str, Any] = {}
    for src, tgt in DIRECTIONS:
        idx = [i for i, it in enumerate(items) if it.source_lang == src]
        refs = [items[i].reference for i in idx]
        stats = {v: chrf_statistics([results[v][i].text for i in idx], refs) for v in results}
        for variant, s in stats.items():
            rs = [results[variant][i] for i in idx]
            row: dict[str, Any] = {
                "n": len(idx),
                "chrF": round(float(chrf_from_sums(s.sum(axis=0)[None, :])[0]), 2),
                "prompt_tokens_mean": round(float(np.mean([r.tokens_in for r in rs])), 1),
                "cached_tokens_mean": round(float(np.mean([r.cached_tokens for r in rs])), 1),
                "cap_stops": sum(r.finish_reason.value == "length" for r in rs),
            }
            if variant != "fixed" and "fixed" in stats:
                diff = paired_bootstrap(stats["fixed"], s, chrf_from_sums)
                row["chrF_delta"] = [round(diff.estimate, 2), round(diff.low, 2),
                                     round(diff.high, 2)]  # fmt: skip
                row["verdict"] = verdict(diff, higher_is_better=True)
            out[f"{src}-{tgt}/{variant}"] = row
    return out


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def dev_items(per_direction: int) -> list[Any]:
    """The first `per_direction` dev turns of each direction, in conversation order."""
    from bench.faithful import Item
    from replay.datasets import bcontrast

    taken = {d: 0 for d in DIRECTIONS}
    items = []
    for u in bcontrast("dev"):
        d = (u.source_lang, u.target_lang)
        if taken[d] < per_direction:
            taken[d] += 1
            items.append(Item("bcontrast", u.source, u.source_lang, u.target_lang, u.target))
    return items


def run(args: argparse.Namespace) -> dict[str, Any]:
    import faiss
    import torch

    from workers.engine.engine import Engine, EngineConfig
    from workers.stages.examples.stage import ExampleRetriever
    from workers.tm.embed import MiniLMEmbedder
    from workers.tm.phrase_index import PhraseIndexes

    torch.set_num_threads(args.threads)
    faiss.omp_set_num_threads(1)
    embedder = MiniLMEmbedder()
    out: dict[str, Any] = {
        "benchmark": "tm_prompt",
        "machine": machine_info(args.threads),
        "commit": _commit(),
        "model": args.model,
        "k": args.k,
        "per_direction": args.per_direction,
    }
    with tempfile.TemporaryDirectory(prefix="tolk-bench-tm-prompt-") as tmp:
        tm_dir = args.tm_dir or Path(tmp) / "tm"
        ivfpq_dir = tm_dir.parent / f"{tm_dir.name}-ivfpq" if args.ivfpq else None
        if not (tm_dir / "index").is_dir():
            out["tm"] = build_tm(tm_dir, embedder, ivfpq_dir)
        indexes = PhraseIndexes.open(tm_dir, embedder)
        out.setdefault("tm", {})["indexes"] = {
            f"{s}-{t}": {"pairs": i.manifest.count, "kind": i.manifest.kind,
                         "build_s": i.manifest.build_seconds}
            for (s, t), i in indexes.indexes.items()
        }  # fmt: skip
        retriever = ExampleRetriever(indexes, args.k)
        items = dev_items(args.per_direction)
        found, out["retrieval_latency"] = retrieve_all(retriever, items)
        print(json.dumps(out["retrieval_latency"]), file=sys.stderr, flush=True)
        if ivfpq_dir is not None and ivfpq_dir.is_dir():
            out["ivfpq_search_latency"] = ivfpq_search_latency(ivfpq_dir, embedder, items, args.k)
    if args.retrieval_only:
        return out
    engine = Engine.from_config(EngineConfig(model=args.model))
    out["default_form"] = engine.prompts.default_form
    results: dict[str, list[Any]] = {}
    seconds: dict[str, float] = {}
    for variant in args.variants:
        started = time.perf_counter()
        results[variant] = engine.generate(
            requests_for(engine, items, found, variant, LANGUAGE_CAP)
        )
        seconds[variant] = round(time.perf_counter() - started, 1)
        print(f"{variant}: {seconds[variant]} s", file=sys.stderr, flush=True)
        if args.out:  # what is done so far, should a long run be cut short
            partial = {**out, "partial": True, "generation_seconds": seconds}
            write_json({**partial, "quality": summarize(items, results)}, args.out)
    out["generation_seconds"] = seconds
    out["quality"] = summarize(items, results)
    if args.prefill_sample:
        out["prefill_latency"] = prefill_latency(
            engine, items, found, args.variants, args.prefill_sample
        )
    out["outputs"] = [
        {
            "pair": it.pair,
            "source": it.source,
            "reference": it.reference,
            "examples": [list(e) for e in f.examples],
            **{v: results[v][i].text for v in results},
        }
        for i, (it, f) in enumerate(zip(items, found, strict=True))
    ]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--per-direction", type=int, default=200, help="dev turns per direction")
    ap.add_argument("--k", type=int, default=4, help="retrieved examples per prompt")
    ap.add_argument("--variants", type=parse_csv, default=list(VARIANTS[:2]))
    ap.add_argument("--tm-dir", type=Path, default=None, help="reuse a built TM (else a temp one)")
    ap.add_argument("--ivfpq", action="store_true", help="also time an IVF-PQ index's search")
    ap.add_argument("--prefill-sample", type=int, default=30, help="0: skip the prefill timing")
    ap.add_argument("--retrieval-only", action="store_true", help="only the retrieval latency")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    unknown = set(args.variants) - set(VARIANTS)
    if unknown or "fixed" not in args.variants:
        ap.error(f"--variants: from {', '.join(VARIANTS)}, with fixed (got {args.variants})")
    result = run(args)
    write_json(result, args.out)
    brief = {k: v for k, v in result.items() if k != "outputs"}
    print(json.dumps(brief, indent=1))


if __name__ == "__main__":
    main()
