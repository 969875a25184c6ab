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
- `after`: the default prompt form under `workers.stages.faithful.stage.FaithfulEngine` (length
guard,
  leak/ratio/loop checks, one retry with the retry form, else withheld: the default policy), as
  `tolk worker` runs; `after_flag` is the same run under the `flag` policy (each withheld
  answer's candidate sent, flagged), derived from it, not run again;
- `form:NAME`: one prompt form of `workers/engine/prompts.json` alone (cap 256, no checks):
  the prompt review of docs/PROMPTS.md;
- `after:DEFAULT:RETRY`: `after` with other default and retry forms (the review of the
  guarded service, e.g. an earlier round's forms on the same items).

Per (model, variant, pair): leak rate (`workers.stages.faithful.rules.leaked_example` over every
example of
every set), length-ratio outliers (characters of output / source > 3 or < 0.3, the issue's
definition, beside the references' own rate), n-gram loops, stops at a cap, answers longer than
their cap (must be 0), flagged and withheld answers (the detectors count translations sent: a
withheld answer sends none; chrF scores it as an empty translation), chrF (sacrebleu), and chrF
minus `before`'s with a
paired bootstrap 95 % interval (`replay.stats`). JSON on stdout and in `--out`, the outputs
with it. Greedy decoding: the same command gives the same figures on the same machine.

    nice -n 5 python -m bench.faithful --models gemma3-270m,smollm2-135m --limit 400 \\
        --variants before,after --out bench-results/faithful.json
    python -m bench.faithful --models gemma3-270m --limit 100 --variants \\
        form:support8,form:short_mix8,form:short_mix4,form:short_mix8_strict,form:zero_shot

`--flores-digits N` adds up to N FLORES-200 devtest sentences per pair (en->de/fr/es/it,
de->en, fr->en) that hold a digit (subset `flores`): the number check's sample (issue #28).
`--pairs en-fr` keeps only some pairs (a prompt change that touches one target language);
`--stored before=A.json,after=B.json` reports variants an earlier run measured on the same
items instead of running them again: on a shared machine the long `before` can run while the
`after` prompt is still being chosen, and one report holds both (each variant's file and
commit are recorded under `stored`).
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
from replay.datasets import bcontrast, flores, tatoeba_pairs
from replay.quality import chrf_statistics
from replay.stats import chrf_from_sums, paired_bootstrap
from workers import reply_metadata
from workers.engine.engine import Engine, EngineConfig
from workers.engine.prompts import prompt_examples
from workers.engine.types import FinishReason, GenerationResult, TranslationRequest
from workers.serving.pipeline import ServingOptions, build_served_engine
from workers.settings import Settings
from workers.stages.faithful.rules import leaked_example, length_ratio, ngram_loop
from workers.stages.faithful.stage import CANDIDATE_KEY, NOTE_KEY, FaithfulEngine

LANGUAGE_CAP = 256  # DEFAULT_MAX_NEW_TOKENS of workers/fairness/policy.py
BEFORE_FORM = "support8"
OTHER_PAIRS = (("en", "fr"), ("en", "es"), ("en", "it"), ("fr", "en"))
RAW_LOW, RAW_HIGH = 0.3, 3.0  # the outlier bounds on the character ratio


@dataclass(frozen=True, slots=True)
class Item:
    subset: str  # "bcontrast", "other" or "flores"
    source: str
    source_lang: str
    target_lang: str
    reference: str

    @property
    def pair(self) -> str:
        return f"{self.source_lang}-{self.target_lang}"


FLORES_PAIRS = (("en", "de"), ("en", "fr"), ("en", "es"), ("en", "it"), ("de", "en"), ("fr", "en"))


def benchmark_items(limit: int, flores_digits: int = 0) -> list[Item]:
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
    for src, tgt in FLORES_PAIRS if flores_digits else ():
        rows = [
            (a, b)
            for a, b in zip(flores(src), flores(tgt), strict=True)
            if any(map(str.isdigit, a))
        ]
        items += [Item("flores", a, src, tgt, b) for a, b in rows[:flores_digits]]
    return items


@dataclass
class Answer:
    text: str
    finish: str
    tokens: int  # tokens of the answering run
    cap: int  # max_new_tokens it ran under
    flagged: bool
    withheld: bool = False  # the policy sent no translation (text ""); `candidate` was it
    candidate: str = ""


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


def run_after(
    engine: Engine, items: list[Item], forms: tuple[str, str] | None = None
) -> tuple[list[Answer], dict[str, Any]]:
    """The guarded service; `forms`: (default, retry) prompt forms other than the template's
    (variant `after:DEFAULT:RETRY`, e.g. an earlier round's forms on the same items)."""
    if forms is not None:
        engine.prompts.default_form, engine.prompts.retry_form = forms
    # the service's faithfulness stage alone, as the builder composes it (no cache)
    served = build_served_engine(
        engine, ServingOptions.of(Settings(), max_new_tokens=LANGUAGE_CAP), base=engine
    )
    guarded: FaithfulEngine = served.stage("faithful")
    engine.start()
    try:
        handles = [
            served.submit_translation(
                TranslationRequest(
                    f"f{i}",
                    it.source,
                    it.source_lang,
                    it.target_lang,
                    max_new_tokens=LANGUAGE_CAP,
                )
            )  # fmt: skip
            for i, it in enumerate(items)
        ]
        results: list[GenerationResult] = [h.result(timeout=3600) for h in handles]
    finally:
        engine.stop(drain=True, timeout=60)
    answers = [
        Answer(
            r.text,
            r.notes.get(reply_metadata.FINISH_REASON, r.finish_reason.value),
            len(r.token_ids),
            guarded.length_cap(it.source, it.source_lang, it.target_lang),
            r.notes.get(NOTE_KEY) == "flagged",
            withheld=r.finish_reason is FinishReason.WITHHELD,
            candidate=r.notes.get(CANDIDATE_KEY, ""),
        )
        for it, r in zip(items, results, strict=True)
    ]
    policy = {
        "checks": {f"{lang}/{c}": n for (lang, c), n in sorted(guarded.checks.items())},
        "outcomes": {f"{lang}/{o}": n for (lang, o), n in sorted(guarded.outcomes.items())},
    }
    return answers, policy


def flag_policy(answers: list[Answer]) -> list[Answer]:
    """The same run under the `flag` policy: each withheld answer's candidate sent, flagged."""
    return [
        Answer(a.candidate, a.finish, a.tokens, a.cap, True) if a.withheld else a for a in answers
    ]


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
        sent = [(it, a) for it, a in zip(its, ans, strict=True) if not a.withheld]
        row: dict[str, Any] = {
            "n": n,
            "leak": sum(
                leaked_example(it.source, a.text, examples, it.target_lang) is not None
                for it, a in sent
            ),
            "ratio_out": sum(_raw_outlier(it.source, a.text) for it, a in sent),
            "ref_ratio_out": sum(_raw_outlier(it.source, it.reference) for it in its),
            "loop": sum(ngram_loop(it.source, a.text) for it, a in sent),
            "cap_stops": sum(a.finish.startswith("length") for a in ans),
            "past_cap": sum(a.tokens > a.cap for a in ans),
            "flagged": sum(a.flagged for a in ans),
            "withheld": sum(a.withheld for a in ans),
            "chrF": round(float(chrf_from_sums(stats.sum(axis=0)[None, :])[0]), 2),
        }
        if before is not None:
            base = chrf_statistics([before[i].text for i in idx], refs)
            diff = paired_bootstrap(base, stats, chrf_from_sums)
            row["chrF_delta"] = [round(diff.estimate, 2), round(diff.low, 2), round(diff.high, 2)]
        out[key] = row
    return out


def _outputs(items: list[Item], answers: list[Answer]) -> list[list[Any]]:
    """[pair, source, output, finish, flagged, tokens, cap, withheld, candidate] per item: the
    raw material of the figures (`--stored` reads them back)."""
    return [
        [it.pair, it.source, a.text, a.finish, a.flagged, a.tokens, a.cap, a.withheld, a.candidate]
        for it, a in zip(items, answers, strict=True)
    ]


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _stored_answer(row: list[Any]) -> Answer:
    """An `_outputs` row back as an Answer; files written before the flag and token columns
    (4 columns) read as unflagged, 0 tokens; before the withheld columns (7), as sent."""
    if len(row) >= 9:
        return Answer(row[2], row[3], int(row[5]), int(row[6]), bool(row[4]), bool(row[7]), row[8])
    if len(row) >= 7:
        return Answer(row[2], row[3], int(row[5]), int(row[6]), bool(row[4]))
    return Answer(row[2], row[3], 0, LANGUAGE_CAP, False)


def stored_runs(
    specs: list[str], model: str, items: list[Item]
) -> tuple[dict[str, list[Answer]], dict[str, Any]]:
    """`VARIANT=PATH` specs: that variant's answers for these items from an earlier run's
    `--out` JSON (any superset of the items, e.g. all pairs), and per variant where it came
    from (file, commit, seconds, forms, the `after` policy counts of the whole earlier run).
    A long `before` can run while the `after` prompt is still being chosen, and the two be
    reported together."""
    answers: dict[str, list[Answer]] = {}
    origin: dict[str, Any] = {}
    for spec in specs:
        variant, sep, path = spec.partition("=")
        if not sep:
            raise SystemExit(f"--stored {spec!r}: expected VARIANT=PATH")
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        run_ = data["models"][model]
        rows = {(r[0], r[1]): r for r in run_["outputs"][variant]}
        missing = [it.source for it in items if (it.pair, it.source) not in rows]
        if missing:
            raise SystemExit(f"{path}: {len(missing)} items missing, e.g. {missing[0]!r}")
        answers[variant] = [_stored_answer(rows[(it.pair, it.source)]) for it in items]
        origin[variant] = {
            "file": path,
            "commit": f"{data['commit']}{'+dirty' if data.get('dirty') else ''}",
            "seconds": run_["seconds"].get(variant),
            "forms": [run_["default_form"], run_["retry_form"]],
            "policy": run_["after_policy"] if variant == "after" else None,
        }
    return answers, origin


def run(
    models: list[str],
    variants: list[str],
    limit: int,
    threads: int,
    pairs: list[str] | None = None,
    stored: list[str] | None = None,
    flores_digits: int = 0,
) -> dict[str, Any]:
    torch.set_num_threads(threads)
    items = [it for it in benchmark_items(limit, flores_digits) if not pairs or it.pair in pairs]
    out: dict[str, Any] = {
        "machine": machine_info(threads),
        "commit": _commit(),
        "dirty": bool(subprocess.run(["git", "status", "--porcelain"], capture_output=True).stdout),
        "limit": limit,
        "pairs": pairs or "all",
        "items": len(items),
        "models": {},
    }
    for model in models:
        engine = Engine.from_config(EngineConfig(model=model))
        answers: dict[str, list[Answer]] = {}
        timing: dict[str, float] = {}
        policy: dict[str, Any] = {}
        origin: dict[str, Any] = {}
        if stored:
            answers, origin = stored_runs(stored, model, items)
        todo = [v for v in variants if v not in answers]
        forms = (engine.prompts.default_form, engine.prompts.retry_form)
        for variant in sorted(todo, key=lambda v: v.startswith("after")):
            # the plain runs drive the engine on this thread; `after` starts its loop last
            t0 = time.perf_counter()
            if variant == "after":
                answers[variant], own = run_after(engine, items, forms)
                policy.update(own)
            elif variant.startswith("after:"):
                default, _, retry = variant.removeprefix("after:").partition(":")
                answers[variant], other = run_after(engine, items, (default, retry or forms[1]))
                policy.setdefault("variants", {})[variant] = other
            else:
                form = BEFORE_FORM if variant == "before" else variant.removeprefix("form:")
                answers[variant] = run_plain(engine, items, form)
            timing[variant] = round(time.perf_counter() - t0, 1)
            print(f"{model} {variant}: {timing[variant]} s", file=sys.stderr, flush=True)
        if "after" in answers and any(a.withheld for a in answers["after"]):
            answers["after_flag"] = flag_policy(answers["after"])
        before = answers.get("before")
        out["models"][model] = {
            "template": engine.prompts.template_name,
            "default_form": forms[0],
            "retry_form": forms[1],
            "seconds": timing | {v: o["seconds"] for v, o in origin.items()},
            "after_policy": policy or (origin.get("after") or {}).get("policy") or {},
            "stored": origin,
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
    ap.add_argument(
        "--pairs",
        type=parse_csv,
        default=None,
        help="only these pairs (en-fr,...), e.g. those whose prompt changed; default: all",
    )
    ap.add_argument(
        "--stored",
        type=parse_csv,
        default=None,
        help="VARIANT=PATH,...: that variant's answers from an earlier run's JSON, not run again",
    )
    ap.add_argument("--flores-digits", type=int, default=0, help="FLORES sentences with a digit")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    result = run(
        args.models,
        args.variants,
        args.limit,
        args.threads,
        args.pairs,
        args.stored,
        args.flores_digits,
    )
    write_json(result, args.out)
    brief = {
        m: {v: s for v, s in r["variants"].items()} | {"seconds": r["seconds"]}
        for m, r in result["models"].items()
    }
    print(json.dumps({"machine": result["machine"], "commit": result["commit"], **brief}, indent=1))


if __name__ == "__main__":
    main()
