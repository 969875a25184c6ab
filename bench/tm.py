"""Phrase-index benchmark: IVF-PQ against exact flat search on every language pair of data/.

    python -m bench.tm --out tm.json                          # every pair, ~all parallel data
    python -m bench.tm --embeddings-cache /tmp/tm-emb.npz     # keep the embeddings for reruns
    python -m bench.tm --sweep                                # also a parameter grid (tuning)

The corpus is all the parallel data of the repository's `data/` (`replay.datasets`,
`$TOLK_DATA_DIR`): BConTrasT train + dev (customer de->en, agent en->de), Tatoeba (en<->de,
fr, es, it), FLORES-200 devtest (every ordered pair of en, de, fr, es, it), xSID (en, de, it,
line-aligned: every ordered pair). Pairs are grouped by language pair as `tolk tm build`
groups a TM, distinct source segments kept. Per language pair, `--queries` held-out sources
(at most 10 %, seeded) are the queries; the rest is indexed twice: exact `IndexFlatIP` (the
anchor) and the `IndexIVFPQ` that `tolk tm build` would build at that size
(`workers.tm.phrase_index.choose_params`; a pair below `MIN_IVFPQ_PAIRS` gets a flat index
from `tolk tm build`, and is measured with IVF-PQ anyway, marked `auto_kind: flat`). One
more row, `all`, indexes every distinct source of every pair in one index: the largest
corpus, where the query-time gap shows best.

Per row: recall@1 (IVF-PQ's first hit is flat's first hit), recall@10 (the share of flat's
top 10 in IVF-PQ's top 10) and 1-recall@10 (flat's first hit among IVF-PQ's 10); queries/s of
each, one query per search call (as a request would) on one faiss thread, repeated for at
least 0.3 s after a warm-up; the bytes of each written index; build time (train + add; the
embedding of the sources is timed once for the whole corpus). For the largest pair and `all`,
resident memory: a fresh child process reads the index with `IO_FLAG_MMAP` and without, and
reports its RSS growth (psutil) after the load and after searching the queries.

The embeddings are all-MiniLM-L6-v2 (`workers.tm.embed.MiniLMEmbedder`, offline from its
wheel). JSON on stdout (and `--out`). Targets (issue #15): recall@10 >= 0.9 of flat at a lower
query time, index >= 4x smaller than flat, memory-mapped RSS well below the index size.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from bench._common import machine_info, write_json

LanguagePair = tuple[str, str]
QUERY_SECONDS = 0.3  # each timed search loop runs at least this long


def parallel_corpus(root: Path | None = None) -> dict[LanguagePair, list[str]]:
    """Distinct source segments per language pair, from every parallel set in data/."""
    from replay import datasets as ds

    sources: dict[LanguagePair, dict[str, None]] = {}

    def add(src: str, tgt: str, texts: Iterable[str]) -> None:
        bucket = sources.setdefault((src, tgt), {})
        for text in texts:
            if text.strip():
                bucket.setdefault(" ".join(text.split()), None)

    for split in ("train", "dev"):
        for u in ds.bcontrast(split, root):
            add(u.source_lang, u.target_lang, [u.source])
    for lang in ("de", "fr", "es", "it"):
        pairs = ds.tatoeba_pairs(lang, root)
        add("en", lang, [en for en, _ in pairs])
        add(lang, "en", [other for _, other in pairs])
    flores_langs = ["en", "de", "fr", "es", "it"]
    flores = {lang: ds.flores(lang, root) for lang in flores_langs}
    xsid = {lang: ds.xsid_texts(lang, root) for lang in ("en", "de", "it")}
    for table in (flores, xsid):
        for src in table:
            for tgt in table:
                if src != tgt:
                    add(src, tgt, table[src])
    return {langs: list(texts) for langs, texts in sorted(sources.items())}


def embed_all(texts: list[str], cache: Path | None) -> tuple[dict[str, np.ndarray], float, int]:
    """text -> vector for every text; (vectors, seconds spent embedding, texts embedded)."""
    from workers.tm.embed import MiniLMEmbedder

    embedder = MiniLMEmbedder()
    known: dict[str, np.ndarray] = {}
    if cache is not None and cache.is_file():
        data = np.load(cache, allow_pickle=False)
        if str(data["model"]) == embedder.model_name:
            known = dict(zip(data["texts"].tolist(), data["vectors"], strict=True))
    missing = [t for t in texts if t not in known]
    started = time.perf_counter()
    if missing:
        for text, vector in zip(missing, embedder.embed(missing), strict=True):
            known[text] = vector
    seconds = time.perf_counter() - started
    if cache is not None and missing:
        keys = list(known)
        np.savez(
            cache,
            model=embedder.model_name,
            texts=np.array(keys),
            vectors=np.stack([known[k] for k in keys]),
        )
    return known, seconds, len(missing)


def _queries_per_second(index: Any, queries: np.ndarray, k: int) -> float:
    for q in queries[: min(20, len(queries))]:  # warm-up: page in, allocate
        index.search(q[None, :], k)
    done, started = 0, time.perf_counter()
    while True:
        for q in queries:
            index.search(q[None, :], k)
        done += len(queries)
        elapsed = time.perf_counter() - started
        if elapsed >= QUERY_SECONDS:
            return done / elapsed


def _recalls(flat_ids: np.ndarray, approx_ids: np.ndarray, k: int) -> dict[str, float]:
    top1 = float(np.mean(flat_ids[:, 0] == approx_ids[:, 0]))
    overlap = np.mean(
        [len(set(f[:k]) & set(a[:k])) / k for f, a in zip(flat_ids, approx_ids, strict=True)]
    )
    first_in_k = np.mean([f[0] in set(a[:k]) for f, a in zip(flat_ids, approx_ids, strict=True)])
    return {
        "recall_at_1": round(top1, 4),
        f"recall_at_{k}": round(float(overlap), 4),
        f"one_recall_at_{k}": round(float(first_in_k), 4),
    }


def measure(
    name: str,
    vectors: np.ndarray,
    n_queries: int,
    k: int,
    seed: int,
    workdir: Path,
    params: Any = None,
) -> dict[str, Any]:
    """One row: flat vs IVF-PQ on `vectors` (queries held out of the index)."""
    import faiss

    from workers.tm.phrase_index import MIN_IVFPQ_PAIRS, choose_params, train_index

    rng = np.random.default_rng(seed)
    order = rng.permutation(len(vectors))
    q = min(n_queries, max(1, len(vectors) // 10))
    queries, base = vectors[order[:q]], vectors[order[q:]]
    auto = choose_params(len(base), base.shape[1])
    params = params or choose_params(len(base), base.shape[1], kind="ivfpq")
    row: dict[str, Any] = {
        "index": name,
        "vectors": len(base),
        "queries": q,
        "auto_kind": auto.kind,
        "nlist": params.nlist,
        "m": params.m,
        "nbits": params.nbits,
        "nprobe": params.nprobe,
    }
    started = time.perf_counter()
    flat = train_index(base, choose_params(len(base), base.shape[1], kind="flat"))
    row["flat_build_s"] = round(time.perf_counter() - started, 4)
    started = time.perf_counter()
    ivfpq = train_index(base, params)
    row["ivfpq_build_s"] = round(time.perf_counter() - started, 4)
    _, flat_ids = flat.search(queries, k)
    _, ivf_ids = ivfpq.search(queries, k)
    row.update(_recalls(flat_ids, ivf_ids, k))
    row["flat_qps"] = round(_queries_per_second(flat, queries, k), 1)
    row["ivfpq_qps"] = round(_queries_per_second(ivfpq, queries, k), 1)
    row["qps_ratio"] = round(row["ivfpq_qps"] / row["flat_qps"], 2)
    for kind, index in (("flat", flat), ("ivfpq", ivfpq)):
        path = workdir / f"{name}.{kind}.faiss"
        faiss.write_index(index, str(path))
        row[f"{kind}_bytes"] = path.stat().st_size
    row["size_ratio"] = round(row["flat_bytes"] / row["ivfpq_bytes"], 2)
    row["below_min_ivfpq_pairs"] = len(base) < MIN_IVFPQ_PAIRS
    np.save(workdir / f"{name}.queries.npy", queries)
    return row


_RSS_CHILD = """
import sys, faiss, numpy as np, psutil
path, mode, queries = sys.argv[1], sys.argv[2], np.load(sys.argv[3])
proc = psutil.Process()
before = proc.memory_info().rss
index = faiss.read_index(path, faiss.IO_FLAG_MMAP if mode == "mmap" else 0)
loaded = proc.memory_info().rss
for q in queries:
    index.search(q[None, :], 10)
searched = proc.memory_info().rss
print(loaded - before, searched - before)
"""


def resident_memory(workdir: Path, name: str) -> dict[str, Any]:
    """RSS growth of a fresh process reading the IVF-PQ index memory-mapped vs fully."""
    out: dict[str, Any] = {"index": name}
    path = workdir / f"{name}.ivfpq.faiss"
    out["ivfpq_bytes"] = path.stat().st_size
    for mode in ("mmap", "full"):
        result = subprocess.run(
            [
                sys.executable,
                "-c",
                _RSS_CHILD,
                str(path),
                mode,
                str(workdir / f"{name}.queries.npy"),
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        loaded, searched = (int(v) for v in result.stdout.split())
        out[f"{mode}_rss_after_load_bytes"] = loaded
        out[f"{mode}_rss_after_queries_bytes"] = searched
    return out


_MEMORY_CHILD = """
import json, sys, faiss, numpy as np
def status():
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) * 1024
    return out
path, mode, nprobe, queries, ids_out = sys.argv[1:6]
queries = np.load(queries)
faiss.omp_set_num_threads(1)
before = status()
index = faiss.read_index(path, faiss.IO_FLAG_MMAP if mode == "mmap" else 0)
index.nprobe = int(nprobe)
loaded = status()
ids = np.stack([index.search(q[None, :], 10)[1][0] for q in queries])
searched = status()
np.save(ids_out, ids)
grow = lambda after: {k: after[k] - before[k] for k in after}
print(json.dumps({"after_load": grow(loaded), "after_queries": grow(searched)}))
"""


def memory_study(flat_path: Path, queries_path: Path, workdir: Path) -> dict[str, Any]:
    """Resident memory of the IVF-PQ index `tolk tm build` writes for the vectors of a flat
    index written by this benchmark (`--keep-indexes`), memory-mapped vs fully read, at
    several nprobe: total RSS growth and its split into private (RssAnon) and file-backed
    (RssFile: page-cache pages of the mapped file, shared by every process that maps it and
    dropped under memory pressure), recall@10 against exact search, and how much of the
    inverted lists the queries' probes cover (the pages a memory map has to bring in)."""
    import faiss

    from workers.tm.phrase_index import choose_params, train_index

    flat = faiss.read_index(str(flat_path))
    vectors = flat.reconstruct_n(0, flat.ntotal)
    queries = np.load(queries_path).astype(np.float32)
    params = choose_params(len(vectors), vectors.shape[1], kind="ivfpq")
    started = time.perf_counter()
    index = train_index(vectors, params)
    build_s = time.perf_counter() - started
    path = workdir / "memory.ivfpq.faiss"
    faiss.write_index(index, str(path))
    exact = np.argsort(-(queries @ vectors.T), axis=1)[:, :10]
    lists: Any = faiss.extract_index_ivf(index).invlists
    sizes = np.array([lists.list_size(i) for i in range(index.nlist)])
    list_bytes = sizes * (index.code_size + 8)  # PQ code + 64-bit id per vector
    out: dict[str, Any] = {
        "vectors": int(flat.ntotal),
        "queries": len(queries),
        "params": [params.nlist, params.m, params.nbits, params.nprobe],
        "build_s": round(build_s, 1),
        "index_bytes": path.stat().st_size,
        "inverted_list_bytes": int(list_bytes.sum()),
        "rows": [],
    }
    for nprobe in sorted({8, 16, params.nprobe}):
        _, probed = index.quantizer.search(queries, nprobe)
        touched = np.unique(probed)
        row: dict[str, Any] = {
            "nprobe": nprobe,
            "lists_touched": f"{len(touched)}/{index.nlist}",
            "list_bytes_touched": int(list_bytes[touched].sum()),
        }
        for mode in ("mmap", "full"):
            ids_path = workdir / f"ids-{mode}-{nprobe}.npy"
            result = subprocess.run(
                [sys.executable, "-c", _MEMORY_CHILD, str(path), mode, str(nprobe),
                 str(queries_path), str(ids_path)],
                capture_output=True, text=True, check=True,
            )  # fmt: skip
            row[mode] = json.loads(result.stdout)
            ids = np.load(ids_path)
            row["recall_at_10"] = round(
                float(
                    np.mean([len(set(a) & set(e)) / 10 for a, e in zip(ids, exact, strict=True)])
                ),
                4,
            )
        out["rows"].append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    return out


def sweep(name: str, vectors: np.ndarray, args: argparse.Namespace, workdir: Path) -> list[Any]:
    """IVF-PQ variants around the chosen parameters (for tuning; all reported)."""
    from dataclasses import replace

    from workers.tm.phrase_index import choose_params

    base = choose_params(len(vectors), vectors.shape[1], kind="ivfpq")
    rows = []
    for m in (48, 96, 192):
        for nprobe in (4, 8, 16, 32):
            if nprobe > base.nlist:
                continue
            params = replace(base, m=m, nprobe=nprobe)
            rows.append(
                measure(
                    f"{name}-m{m}-p{nprobe}",
                    vectors,
                    args.queries,
                    args.k,
                    args.seed,
                    workdir,
                    params,
                )
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", default="", help="only these language pairs (en-de,...)")
    parser.add_argument("--queries", type=int, default=200, help="held-out queries per pair")
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--embeddings-cache",
        type=Path,
        default=None,
        help="npz of embeddings to reuse across runs (written if missing)",
    )
    parser.add_argument("--sweep", action="store_true", help="also a parameter grid")
    parser.add_argument(
        "--keep-indexes", type=Path, default=None, help="write the indexes here (kept)"
    )
    parser.add_argument(
        "--memory-study",
        type=Path,
        default=None,
        metavar="DIR",
        help="only the resident-memory study of DIR/all.flat.faiss (from --keep-indexes)",
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import faiss

    faiss.omp_set_num_threads(1)
    if args.memory_study is not None:
        with tempfile.TemporaryDirectory(prefix="tolk-bench-tm-") as tmp:
            study = memory_study(
                args.memory_study / "all.flat.faiss", args.memory_study / "all.queries.npy",
                Path(tmp),
            )  # fmt: skip
        memory = {"benchmark": "tm_memory", "machine": machine_info(threads=1), **study}
        print(json.dumps(memory, indent=2))
        write_json(memory, args.out)
        return
    corpus = parallel_corpus()
    if args.pairs:
        wanted = {tuple(p.split("-", 1)) for p in args.pairs.split(",")}
        corpus = {langs: texts for langs, texts in corpus.items() if langs in wanted}
    distinct = sorted({t for texts in corpus.values() for t in texts})
    vectors_of, embed_s, embedded = embed_all(distinct, args.embeddings_cache)
    result: dict[str, Any] = {
        "benchmark": "tm_phrase_index",
        "machine": machine_info(threads=1),
        "faiss": faiss.__version__,
        "embedding_model": "sentence-transformers/all-MiniLM-L6-v2",
        "corpus": {f"{s}-{t}": len(texts) for (s, t), texts in corpus.items()},
        "distinct_sources": len(distinct),
        "embedding": {
            "texts": embedded,
            "seconds": round(embed_s, 2),
            "texts_per_s": round(embedded / embed_s, 1) if embedded else None,
        },
        "rows": [],
    }
    with tempfile.TemporaryDirectory(prefix="tolk-bench-tm-") as tmp:
        workdir = args.keep_indexes or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        for (src, tgt), texts in corpus.items():
            vectors = np.stack([vectors_of[t] for t in texts]).astype(np.float32)
            row = measure(f"{src}-{tgt}", vectors, args.queries, args.k, args.seed, workdir)
            print(json.dumps(row), file=sys.stderr)
            result["rows"].append(row)
        everything = np.stack([vectors_of[t] for t in distinct]).astype(np.float32)
        row = measure("all", everything, args.queries * 5, args.k, args.seed, workdir)
        print(json.dumps(row), file=sys.stderr)
        result["rows"].append(row)
        largest = max(result["rows"][:-1], key=lambda r: r["vectors"])["index"]
        result["resident_memory"] = [
            resident_memory(workdir, largest),
            resident_memory(workdir, "all"),
        ]
        if args.sweep:
            result["sweep"] = sweep("all", everything, args, workdir)
    rows = result["rows"]
    result["summary"] = {
        "pairs": len(rows) - 1,
        "min_recall_at_10": min(r[f"recall_at_{args.k}"] for r in rows),
        "min_size_ratio": min(r["size_ratio"] for r in rows),
        "pairs_ivfpq_faster": sum(r["qps_ratio"] > 1 for r in rows[:-1]),
    }
    print(json.dumps(result, indent=2))
    write_json(result, args.out)


if __name__ == "__main__":
    main()
