"""Which mask token do small models copy verbatim? Restore rate per mask form and model.

Takes real support turns with protected spans (BConTrasT dev: customers write German, agents
English; numbers, times, prices), translates each one through the engine once unmasked (the
baseline) and once masked with every form of `workers.text.spans.MASK_STYLES`, all in
one
batch per model, and counts per form:

- restored: the share of masked translations whose tokens map back one to one (`restore`
  strict: every token exactly once, none unknown, none mangled);
- preserved: the share of source spans found exactly in the final text (restored where that
  worked, else the unmasked translation: what `ProtectedSpansEngine` replies);

the baseline row is the unmasked translation's span preservation. Greedy decoding, so a rerun
gives the same table. The result is in docs/REPLAY.md, "Protected spans".

    python -m bench.mask_forms --models gemma3-270m,smollm2-135m --n 50 [--out out.json]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from bench._common import dump, machine_info, parse_csv, write_json
from replay.datasets import bcontrast
from workers.text.spans import (
    MASK_STYLES,
    MaskConflict,
    Masked,
    RestoreError,
    find_spans,
    mask,
    preservation,
    restore,
)


def spanned_sentences(n: int, split: str = "dev") -> list[tuple[str, str, str]]:
    """The first `n` BConTrasT turns with at least one protected span, as (text, source
    language, target language), alternating the two directions (de->en, en->de)."""
    by_dir: dict[str, list[tuple[str, str, str]]] = {"de": [], "en": []}
    for u in bcontrast(split):
        if find_spans(u.source):
            by_dir[u.source_lang].append((u.source, u.source_lang, u.target_lang))
    out: list[tuple[str, str, str]] = []
    for a, b in zip(by_dir["de"], by_dir["en"], strict=False):
        out.extend((a, b))
    return out[:n]


def measure(engine: Any, items: list[tuple[str, str, str]]) -> dict[str, Any]:
    """One batch: every sentence unmasked and under every mask form; the table's row per form."""
    jobs: list[tuple[str, int, Masked | None]] = []  # (form or "baseline", item, masked)
    texts: list[tuple[str, str, str]] = []
    for i, (text, src, tgt) in enumerate(items):
        jobs.append(("baseline", i, None))
        texts.append((text, src, tgt))
        for name, style in MASK_STYLES.items():
            try:
                masked = mask(text, style=style)
            except MaskConflict:
                continue  # counted as not restored below
            jobs.append((name, i, masked))
            texts.append((masked.text, src, tgt))
    reqs = [engine.translation_request(t, s, g, max_new_tokens=96) for t, s, g in texts]
    outputs = [r.text for r in engine.generate(reqs)]
    baseline = {
        i: out for (form, i, _), out in zip(jobs, outputs, strict=True) if form == "baseline"
    }
    total_spans = sum(preservation(t, t)[1] for t, _, _ in items)
    rows: dict[str, Any] = {}
    kept = sum(preservation(items[i][0], out)[0] for i, out in baseline.items())
    rows["baseline"] = {"restored": None, "preserved": round(kept / total_spans, 3)}
    failures: dict[str, list[str]] = {}
    for name in MASK_STYLES:
        restored = 0
        kept = 0
        for form, i, maybe_masked in (j for j in jobs if j[0] == name):
            out = outputs[jobs.index((form, i, maybe_masked))]
            assert maybe_masked is not None
            masked = maybe_masked
            try:
                final = restore(masked, out)
                restored += 1
            except RestoreError as exc:
                final = baseline[i]
                failures.setdefault(name, []).append(f"{masked.text!r} -> {out!r}: {exc}")
            kept += preservation(items[i][0], final)[0]
        rows[name] = {
            "token": MASK_STYLES[name].token(1),
            "restored": round(restored / len(items), 3),
            "preserved": round(kept / total_spans, 3),
        }
    return {
        "rows": rows,
        "spans": total_spans,
        "failure_samples": {k: v[:3] for k, v in failures.items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="gemma3-270m,smollm2-135m")
    ap.add_argument("--n", type=int, default=50)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from workers.engine.engine import Engine, EngineConfig

    torch.set_num_threads(args.threads)
    items = spanned_sentences(args.n)
    result: dict[str, Any] = {"machine": machine_info(args.threads), "n": len(items), "models": {}}
    for model in parse_csv(args.models):
        engine = Engine.from_config(EngineConfig(model=model, max_new_tokens=96))
        t0 = time.perf_counter()
        result["models"][model] = measure(engine, items)
        result["models"][model]["seconds"] = round(time.perf_counter() - t0, 1)
        print(dump({model: result["models"][model]["rows"]}), flush=True)
    write_json(result, args.out)
    print(dump(result))


if __name__ == "__main__":
    main()
