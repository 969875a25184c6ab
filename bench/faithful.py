"""Faithfulness benchmark (issue #18): leaks, length-ratio outliers, loops, caps and chrF, per
language pair and model, for prompt forms and for the service before / after the guards.

Test set (nothing of it is used to fit the length caps, `bench/length_caps.py`):
- `bcontrast`: the first `--limit` BConTrasT dev turns in conversation order (customer de->en,
  agent en->de);
- `other`: `--limit` Tatoeba sentences, lines 0.. of en->fr, en->es, en->it and fr->en in
  equal parts.

Variants (one model load per model, every variant on the same items):
- `before`: the service as it was before issue #18, at this commit: prompt form `support8`,
  the language's `max_new_tokens` (256) as the only cap, no checks;
- `after`: the default prompt form under `workers.faithful_engine.FaithfulEngine` (length guard,
  leak/ratio/loop checks, one retry with the retry form, else flagged), as `tolk worker` runs;
- `form:NAME`: one prompt form of `workers/engine/prompts.json` alone (cap 256, no checks):
  the prompt review of docs/PROMPTS.md.

Per (model, variant, pair): leak rate (`workers.faithful.leaked_example` over every example of
every set), length-ratio outliers (characters of output / source > 3 or < 0.3, the issue's
definition, beside the references' own rate), n-gram loops, stops at a cap, answers longer than
their cap (must be 0), flagged answers, chrF (sacrebleu), and chrF minus `before`'s with a
paired bootstrap 95 % interval (`replay.stats`). JSON on stdout and in `--out`, the outputs
with it. Greedy decoding: the same command gives the same figures on the same machine.

    nice -n 5 python -m bench.faithful --models gemma3-270m,smollm2-135m --limit 400 \\
        --variants before,after --out bench-results/faithful.json
    python -m bench.faithful --models gemma3-270m --limit 100 --variants \\
        form:support8,form:short_mix8,form:short_mix4,form:short_mix8_strict,form:zero_shot
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch

from bench._common import machine_info, parse_csv, write_json
from replay.datasets import bcontrast, tatoeba_pairs
from replay.quality import chrf_statistics
from replay.stats import chrf_from_sums, paired_bootstrap
from workers.engine.engine import Engine, EngineConfig
from workers.engine.prompts import prompt_examples
from workers.engine.types import GenerationResult
from workers.faithful import leaked_example, length_ratio, ngram_loop
from workers.faithful_engine import NOTE_KEY, FaithfulEngine

LANGUAGE_CAP = 256  # DEFAULT_MAX_NEW_TOKENS of workers/fairness/policy.py
BEFORE_FORM = "support8"
OTHER_PAIRS = (("en", "fr"), ("en", "es"), ("en", "it"), ("fr", "en"))
RAW_LOW, RAW_HIGH = 0.3, 3.0  # the outlier bounds on the character ratio


@dataclass(frozen=True, slots=True)
class Item:
    subset: str  # "bcontrast" or "other"
    source: str
    source_lang: str
    target_lang: str
    reference: str

    @property
    def pair(self) -> str:
        return f"{self.source_lang}-{self.target_lang}"


def benchmark_items(limit: int) -> list[Item]:
    items = [
        Item("bcontrast", u.source, u.source_lang, u.target_lang, u.target)
        for u in bcontrast("dev")
    ][:limit]
    per_pair = max(1, limit // len(OTHER_PAIRS))
    for src, tgt in OTHER_PAIRS:
        other = tgt if src == "en" else src
        for en, text in tatoeba_pairs(other)[:per_pair]:
            source, ref = (en, text) if src == "en" else (text, en)
            items.append(Item("other", source, src, tgt, ref))
    return items


@dataclass
class Answer:
    text: str
    finish: str
    tokens: int  # tokens of the answering run
    cap: int  # max_new_tokens it ran under
    flagged: bool


def run_plain(engine: Engine, items: list[Item], form: str) -> list[Answer]:
    reqs = [
        engine.translation_request(
            it.source, it.source_lang, it.target_lang, max_new_tokens=LANGUAGE_CAP, prompt_form=form
        )
        for it in items
    ]
    results = engine.generate(reqs)
    return [
        Answer(r.text, r.finish_reason.value, len(r.token_ids), LANGUAGE_CAP, False)
        for r in results
    ]


def run_after(engine: Engine, items: list[Item]) -> tuple[list[Answer], dict[str, Any]]:
    guarded = FaithfulEngine(engine, default_max_new_tokens=LANGUAGE_CAP)
    engine.start()
    try:
        handles = [
            guarded.submit_translation(
                request_id=f"f{i}",
                text=it.source,
                source_lang=it.source_lang,
                target_lang=it.target_lang,
                max_new_tokens=LANGUAGE_CAP,
            )
            for i, it in enumerate(items)
        ]
        results: list[GenerationResult] = [h.result(timeout=3600) for h in handles]
    finally:
        engine.stop(drain=True, timeout=60)
    answers = [
        Answer(
            r.text,
            r.notes.get("tolk.finish_reason", r.finish_reason.value),
            len(r.token_ids),
            guarded.length_cap(it.source, it.source_lang, it.target_lang),
            r.notes.get(NOTE_KEY) == "flagged",
        )
        for it, r in zip(items, results, strict=True)
    ]
    policy = {
        "checks": {f"{lang}/{c}": n for (lang, c), n in sorted(guarded.checks.items())},
        "outcomes": {f"{lang}/{o}": n for (lang, o), n in sorted(guarded.outcomes.items())},
    }
    return answers, policy


def _raw_outlier(source: str, text: str) -> bool:
    r = length_ratio(source, text)
    return r > RAW_HIGH or r < RAW_LOW


def summarize(
    items: list[Item], answers: list[Answer], before: list[Answer] | None
) -> dict[str, Any]:
    examples = prompt_examples()
    groups: dict[str, list[int]] = defaultdict(list)
    for i, it in enumerate(items):
        groups[f"{it.subset}:{it.pair}"].append(i)
    out: dict[str, Any] = {}
    for key, idx in sorted(groups.items()):
        its = [items[i] for i in idx]
        ans = [answers[i] for i in idx]
        hyps, refs = [a.text for a in ans], [it.reference for it in its]
        stats = chrf_statistics(hyps, refs)
        n = len(idx)
        row: dict[str, Any] = {
            "n": n,
            "leak": sum(
                leaked_example(it.source, a.text, examples, it.target_lang) is not None
                for it, a in zip(its, ans, strict=True)
            ),
            "ratio_out": sum(
                _raw_outlier(it.source, a.text) for it, a in zip(its, ans, strict=True)
            ),
            "ref_ratio_out": sum(_raw_outlier(it.source, it.reference) for it in its),
            "loop": sum(ngram_loop(it.source, a.text) for it, a in zip(its, ans, strict=True)),
            "cap_stops": sum(a.finish.startswith("length") for a in ans),
            "past_cap": sum(a.tokens > a.cap for a in ans),
            "flagged": sum(a.flagged for a in ans),
            "chrF": round(float(chrf_from_sums(stats.sum(axis=0)[None, :])[0]), 2),
        }
        if before is not None:
            base = chrf_statistics([before[i].text for i in idx], refs)
            diff = paired_bootstrap(base, stats, chrf_from_sums)
            row["chrF_delta"] = [round(diff.estimate, 2), round(diff.low, 2), round(diff.high, 2)]
        out[key] = row
    return out


def _outputs(items: list[Item], answers: list[Answer]) -> list[list[str]]:
    """[pair, source, output, finish] per item: the raw material of the figures."""
    return [[it.pair, it.source, a.text, a.finish] for it, a in zip(items, answers, strict=True)]


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run(models: list[str], variants: list[str], limit: int, threads: int) -> dict[str, Any]:
    torch.set_num_threads(threads)
    items = benchmark_items(limit)
    out: dict[str, Any] = {
        "machine": machine_info(threads),
        "commit": _commit(),
        "dirty": bool(subprocess.run(["git", "status", "--porcelain"], capture_output=True).stdout),
        "limit": limit,
        "items": len(items),
        "models": {},
    }
    for model in models:
        engine = Engine.from_config(EngineConfig(model=model))
        answers: dict[str, list[Answer]] = {}
        timing: dict[str, float] = {}
        policy: dict[str, Any] = {}
        for variant in [v for v in variants if v != "after"] + (
            ["after"] if "after" in variants else []
        ):  # the plain runs drive the engine on this thread; `after` starts its loop last
            t0 = time.perf_counter()
            if variant == "after":
                answers[variant], policy = run_after(engine, items)
            else:
                form = BEFORE_FORM if variant == "before" else variant.removeprefix("form:")
                answers[variant] = run_plain(engine, items, form)
            timing[variant] = round(time.perf_counter() - t0, 1)
            print(f"{model} {variant}: {timing[variant]} s", file=sys.stderr, flush=True)
        before = answers.get("before")
        out["models"][model] = {
            "template": engine.prompts.template_name,
            "default_form": engine.prompts.default_form,
            "retry_form": engine.prompts.retry_form,
            "seconds": timing,
            "after_policy": policy,
            "variants": {
                v: summarize(items, a, before if v != "before" else None)
                for v, a in answers.items()
            },
            "outputs": {v: _outputs(items, a) for v, a in answers.items()},
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", type=parse_csv, default=["gemma3-270m"])
    ap.add_argument("--variants", type=parse_csv, default=["before", "after"])
    ap.add_argument("--limit", type=int, default=400, help="BConTrasT turns; as many others")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    result = run(args.models, args.variants, args.limit, args.threads)
    write_json(result, args.out)
    brief = {
        m: {v: s for v, s in r["variants"].items()} | {"seconds": r["seconds"]}
        for m, r in result["models"].items()
    }
    print(json.dumps({"machine": result["machine"], "commit": result["commit"], **brief}, indent=1))


if __name__ == "__main__":
    main()
