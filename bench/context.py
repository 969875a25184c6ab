"""Conversation context benchmark (issue #15, part 3): quality with and without the earlier
turns in the prompt, and what the growing prefix saves at prefill.

Data: BConTrasT dev, `--dialogues` whole dialogues (seeded choice, `--seed`), each cut to its
first `--max-turns` turns, turns in the order spoken (customer de->en, agent en->de).

1. **Quality.** Two passes over the same turns with one engine (greedy, the default prompt
   form, no wrappers, the same `--max-new-tokens`): `plain` (every turn alone) and `context`
   (the context stage over the engine as `tolk worker --context` composes it,
   `workers.serving.pipeline.build_served_engine`, history budget `--budget`, history layout
   `--layout`: one direction's turns or the whole dialogue, `workers/stages/context/rules.py`); with
   `--faithful` both passes run under the faithfulness checks as `tolk worker` does (policy
   `flag`, so every answer is scored; the outcomes are counted per pass). A pass goes round by
   round: round r submits the r-th turn of every dialogue at once and runs them to completion
   (a batch, as concurrent conversations are), so turn r+1 sees turn r's answer. Per direction:
   chrF of each pass (sacrebleu statistics), context minus plain with a paired bootstrap 95 %
   interval and the verdict (`replay.stats`, as the replay report), and the wall time per pass.
2. **Kept warm.** `--ttft-dialogues` dialogues in context, one turn at a time (batch 1, no
   other load in the engine): per turn, the prompt's length, its tokens served from the prefix
   cache and the time to first token (`Timings.prefill_s`; queue time is ~0 at batch 1). Then
   *cold*: the prefix cache emptied and the language prefixes warmed again (what a worker that
   never saw the conversation, or evicted it, has), the same prompt ids once more. Warm vs cold
   TTFT (median and per-turn ratio) and the prefill tokens saved (warm hits minus cold hits)
   over the turns that had history.

JSON on stdout and in `--out` (every output with its reference, and each pass's per-turn runs);
CPU model and load average in `machine`. One process runs both passes; on a machine shared
with other work, the two passes can run side by side, one process each (`--passes`), and
`--combine` compares the two runs' passes as one run would (same `--dialogues`,
`--max-turns`, `--seed`):

    nice -n 5 python -m bench.context --dialogues 20 --max-turns 16 --out bench-results/context.json
    python -m bench.context --dialogues 14 --max-turns 8 --passes plain --ttft-dialogues 1 \\
        --ttft-max-turns 6 --out plain.json &
    python -m bench.context --dialogues 14 --max-turns 8 --passes context --ttft-dialogues 0 \\
        --out context.json
    python -m bench.context --combine plain.json context.json --out bench-results/context.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from bench._common import machine_info, parse_csv, write_json
from replay.datasets import Utterance, bcontrast
from replay.quality import chrf_statistics
from replay.stats import chrf_from_sums, paired_bootstrap, verdict
from workers.engine.engine import Engine, EngineConfig
from workers.engine.types import (
    GenerationRequest,
    GenerationResult,
    RequestHandle,
    SamplingParams,
    TranslationEngine,
    TranslationRequest,
)
from workers.serving.pipeline import ServedEngine, ServingOptions, build_served_engine
from workers.settings import Settings
from workers.stages.context.rules import DEFAULT_LAYOUT, LAYOUTS
from workers.stages.context.stage import ContextEngine

DIRECTIONS = ("de-en", "en-de")


@dataclass(frozen=True, slots=True)
class TurnRun:
    """One turn's result in one pass."""

    text: str
    cached: int  # prompt tokens from the prefix cache
    prompt: int  # prompt tokens
    ttft_s: float  # first scheduled -> first token


class _RecordingEngine:
    """The engine, keeping each request's prompt ids (the cold re-run needs them): the core the
    builder wraps, in place of the engine itself."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.model_version = engine.model_version
        self.languages = engine.languages
        self.prompts: dict[str, list[int]] = {}

    def submit_translation(self, request: TranslationRequest) -> RequestHandle:
        built = self.engine.generation_request(request)
        self.prompts[built.request_id] = list(built.prompt_ids)
        return self.engine.submit(built)

    def count_tokens(self, text: str) -> int:
        return self.engine.count_tokens(text)

    def start(self) -> None:
        self.engine.start()

    def stop(self, drain: bool = True, timeout: float | None = None) -> None:
        self.engine.stop(drain=drain, timeout=timeout)


def _served(engine: Engine, core: Any, budget: int, layout: str, **options: Any) -> ServedEngine:
    """`core` in the stages `options` turn on, as `tolk worker` composes them."""
    settings = Settings(context_tokens=budget, context_layout=layout)
    return build_served_engine(core, ServingOptions.of(settings, **options), base=engine)


def dialogues(n: int, max_turns: int, seed: int) -> list[list[Utterance]]:
    by_id: dict[str, list[Utterance]] = defaultdict(list)
    for u in bcontrast("dev"):
        by_id[u.conversation_id].append(u)
    ids = sorted(by_id)
    random.Random(seed).shuffle(ids)
    return [sorted(by_id[c], key=lambda u: u.turn)[:max_turns] for c in ids[:n]]


def _run(result: GenerationResult) -> TurnRun:
    return TurnRun(result.text, result.cached_tokens, result.tokens_in, result.timings.prefill_s)


def run_pass(
    engine: Engine, convs: list[list[Utterance]], max_new: int, served: TranslationEngine
) -> list[list[TurnRun]]:
    """Round by round: the r-th turn of every dialogue together, run to completion."""
    out: list[list[TurnRun]] = [[] for _ in convs]
    for r in range(max(len(c) for c in convs)):
        handles: list[tuple[int, RequestHandle]] = []
        for i, conv in enumerate(convs):
            if r >= len(conv):
                continue
            u = conv[r]
            request = TranslationRequest(
                f"{u.conversation_id}-{u.turn}-{r}",
                u.source,
                u.source_lang,
                u.target_lang,
                max_new_tokens=max_new,
                conversation_id=u.conversation_id,  # the context stage's; the others ignore it
            )
            handles.append((i, served.submit_translation(request)))
        engine.run_until_done()
        for i, h in handles:
            out[i].append(_run(h.result(0)))
        print(f"  round {r}: {len(handles)} turns", file=sys.stderr, flush=True)
    return out


def quality(
    convs: list[list[Utterance]], plain: list[list[TurnRun]], ctx: list[list[TurnRun]]
) -> dict[str, Any]:
    rows: dict[str, dict[str, list[str]]] = {d: defaultdict(list) for d in DIRECTIONS}
    for conv, p_runs, c_runs in zip(convs, plain, ctx, strict=True):
        for u, p, c in zip(conv, p_runs, c_runs, strict=True):
            d = rows[f"{u.source_lang}-{u.target_lang}"]
            d["ref"].append(u.target)
            d["plain"].append(p.text)
            d["context"].append(c.text)
    out: dict[str, Any] = {}
    for direction, d in rows.items():
        a = chrf_statistics(d["plain"], d["ref"])
        b = chrf_statistics(d["context"], d["ref"])
        diff = paired_bootstrap(a, b, chrf_from_sums)
        out[direction] = {
            "n": len(d["ref"]),
            "chrf_plain": round(float(chrf_from_sums(a.sum(axis=0)[None, :])[0]), 2),
            "chrf_context": round(float(chrf_from_sums(b.sum(axis=0)[None, :])[0]), 2),
            "difference": {
                k: round(v, 2) if isinstance(v, float) else v for k, v in diff.as_dict().items()
            },
            "verdict": verdict(diff, higher_is_better=True),
            "changed": sum(x != y for x, y in zip(d["plain"], d["context"], strict=True)),
        }
    return out


def kept_warm(
    engine: Engine, convs: list[list[Utterance]], budget: int, max_new: int, layout: str
) -> dict[str, Any]:
    """Warm (the conversation's earlier prompt in the prefix cache) vs cold TTFT, batch 1.

    Each turn with history is measured twice, back to back, so both see the same machine load:
    warm on `engine` (the conversation so far in its cache), cold on a second engine over the
    same prepared model (its own KV pools) whose cache holds only the turn's language prefix."""
    cold_engine = Engine(engine.prepared, engine.config)
    recorder = _RecordingEngine(engine)
    served = _served(engine, recorder, budget, layout, faithful=False, context=True)
    ctx: ContextEngine = served.stage("context")
    turns: list[dict[str, Any]] = []
    for conv in convs:
        for r, u in enumerate(conv):
            rid = f"warm-{u.conversation_id}-{u.turn}"
            start_turns = len(ctx.memory.history(u.conversation_id, u.source_lang, u.target_lang))
            h = served.submit_translation(
                TranslationRequest(
                    rid, u.source, u.source_lang, u.target_lang,
                    max_new_tokens=max_new, conversation_id=u.conversation_id,
                )
            )  # fmt: skip
            engine.run_until_done()
            res = h.result(0)
            t: dict[str, Any] = {
                "rid": rid,
                "turn": r,
                "target_lang": u.target_lang,
                "history_turns": start_turns,
                "prompt": res.tokens_in,
                "warm_cached": res.cached_tokens,
                "warm_ttft_s": res.timings.prefill_s,
            }
            turns.append(t)
            if start_turns == 0:
                continue
            cold_engine.kv.prefix.reset()  # cold: only the turn's language prefix cached
            cold_engine.warm([u.target_lang])
            req = GenerationRequest(
                f"cold-{rid}", recorder.prompts[rid], SamplingParams(max_new_tokens=1)
            )
            cold_run = cold_engine.generate([req])[0]
            t["cold_cached"] = cold_run.cached_tokens
            t["cold_ttft_s"] = cold_run.timings.prefill_s
    with_history = [t for t in turns if t["history_turns"] > 0]
    warm = [t["warm_ttft_s"] for t in with_history]
    cold = [t["cold_ttft_s"] for t in with_history]
    saved = sum(t["warm_cached"] - t["cold_cached"] for t in with_history)
    prompt = sum(t["prompt"] for t in with_history)
    return {
        "turns_with_history": len(with_history),
        "prompt_tokens": prompt,
        "warm_prefilled_tokens": sum(t["prompt"] - t["warm_cached"] for t in with_history),
        "cold_prefilled_tokens": sum(t["prompt"] - t["cold_cached"] for t in with_history),
        "prefill_tokens_saved": saved,
        "ttft_warm_median_ms": round(1000 * statistics.median(warm), 1) if warm else None,
        "ttft_cold_median_ms": round(1000 * statistics.median(cold), 1) if cold else None,
        "ttft_ratio_median": (
            round(statistics.median(c / w for w, c in zip(warm, cold, strict=True) if w > 0), 2)
            if warm
            else None
        ),
        "turns": turns,
    }


def compare(
    convs: list[list[Utterance]], plain: list[list[TurnRun]], ctx: list[list[TurnRun]]
) -> dict[str, Any]:
    """Quality per direction, prompt and cached tokens per pass, and every output."""
    passes = {"plain": plain, "context": ctx}
    return {
        "quality": quality(convs, plain, ctx),
        "prefill": {
            name: {
                "prompt_tokens": sum(t.prompt for c in runs for t in c),
                "cached_tokens": sum(t.cached for c in runs for t in c),
            }
            for name, runs in passes.items()
        },
        "outputs": [
            {
                "conversation": u.conversation_id,
                "turn": u.turn,
                "pair": f"{u.source_lang}-{u.target_lang}",
                "source": u.source,
                "reference": u.target,
                "plain": p.text,
                "context": c.text,
            }
            for conv, pr, cr in zip(convs, plain, ctx, strict=True)
            for u, p, c in zip(conv, pr, cr, strict=True)
        ],
    }


def combine(paths: list[str], out_path: str | None) -> None:
    """`--combine A.json B.json`: the passes of two runs of the same turns (e.g. one process
    per pass on a shared machine) compared as one run would."""
    runs: dict[str, list[list[TurnRun]]] = {}
    first: dict[str, Any] = {}
    seconds: dict[str, float] = {}
    for path in paths:
        data = json.loads(Path(path).read_text())
        first = first or data
        for name, convs_runs in data["runs"].items():
            runs[name] = [[TurnRun(**t) for t in c] for c in convs_runs]
        seconds.update(data.get("seconds", {}))
        if "context_counts" in data:
            first = {**first, "context_counts": data["context_counts"]}
        if "faithful_outcomes" in data:
            merged = {**first.get("faithful_outcomes", {}), **data["faithful_outcomes"]}
            first = {**first, "faithful_outcomes": merged}
    a = first["args"]
    convs = dialogues(a["dialogues"], a["max_turns"], a["seed"])
    out = {
        **{k: v for k, v in first.items() if k not in ("runs", "seconds")},
        "combined_from": paths,
        "machines": [json.loads(Path(p).read_text())["machine"] for p in paths],
        "commits": [json.loads(Path(p).read_text())["commit"] for p in paths],
        "seconds": seconds,
        **compare(convs, runs["plain"], runs["context"]),
    }
    for path in paths:  # the batch-1 part, from whichever run measured it
        data = json.loads(Path(path).read_text())
        if "kept_warm" in data:
            out["kept_warm"] = data["kept_warm"]
            out["kept_warm_seconds"] = data.get("kept_warm_seconds")
    write_json(out, out_path)
    print(json.dumps({k: v for k, v in out.items() if k not in ("outputs",)}, indent=1))


def _by_label(counts: Mapping[tuple[str, str], int]) -> dict[str, int]:
    """(lang, label) -> count, summed over the languages."""
    out: dict[str, int] = defaultdict(int)
    for (_lang, label), n in counts.items():
        out[label] += n
    return dict(out)


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--dialogues", type=int, default=20)
    ap.add_argument("--max-turns", type=int, default=16)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--budget", type=int, default=256, help="history tokens (TOLK_CONTEXT_TOKENS)")
    ap.add_argument("--layout", choices=LAYOUTS, default=DEFAULT_LAYOUT, help="history layout")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument(
        "--faithful",
        action="store_true",
        help="both passes under the faithfulness checks (policy flag), as `tolk worker` runs",
    )
    ap.add_argument("--ttft-dialogues", type=int, default=3)
    ap.add_argument("--ttft-max-turns", type=int, default=12)
    ap.add_argument("--skip-quality", action="store_true")
    ap.add_argument("--passes", type=parse_csv, default=["plain", "context"])
    ap.add_argument("--combine", nargs=2, metavar="RUN_JSON", help="compare two runs' passes")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.combine:
        combine(args.combine, args.out)
        return
    torch.set_num_threads(args.threads)
    convs = dialogues(args.dialogues, args.max_turns, args.seed)
    engine = Engine.from_config(EngineConfig(model=args.model, warm_languages=("en", "de")))
    out: dict[str, Any] = {
        "machine": machine_info(args.threads),
        "commit": _commit(),
        "model": args.model,
        "args": vars(args),
        "dialogues": len(convs),
        "turns": sum(len(c) for c in convs),
    }
    if not args.skip_quality:
        seconds: dict[str, float] = {}
        passes: dict[str, list[list[TurnRun]]] = {}
        for name in args.passes:
            engine.kv.prefix.reset()
            engine.warm(["en", "de"])
            # the service's checks with --faithful, policy flag: every text is scored
            served = _served(
                engine, engine, args.budget, args.layout,
                faithful=args.faithful, faithful_policy="flag",
                max_new_tokens=args.max_new_tokens, context=name == "context",
            )  # fmt: skip
            t0 = time.perf_counter()
            passes[name] = run_pass(engine, convs, args.max_new_tokens, served)
            seconds[name] = round(time.perf_counter() - t0, 1)
            print(f"{name}: {seconds[name]} s", file=sys.stderr, flush=True)
            if "context" in served.stages:  # contextual, no_history, history_leak, recorded
                out["context_counts"] = dict(served.stage("context").counts)
            if args.faithful:  # per pass: outcomes (retried, flagged) over both languages
                outcomes = out.setdefault("faithful_outcomes", {})
                outcomes[name] = _by_label(served.stage("faithful").outcomes)
        out["seconds"] = seconds
        out["runs"] = {n: [[asdict(t) for t in c] for c in runs] for n, runs in passes.items()}
        if {"plain", "context"} <= set(passes):
            out.update(compare(convs, passes["plain"], passes["context"]))
        write_json(out, args.out)  # the quality figures, before the slower batch-1 part
    if args.ttft_dialogues > 0:
        t0 = time.perf_counter()
        out["kept_warm"] = kept_warm(
            engine,
            [c[: args.ttft_max_turns] for c in convs[: args.ttft_dialogues]],
            args.budget,
            args.max_new_tokens,
            args.layout,
        )
        out["kept_warm_seconds"] = round(time.perf_counter() - t0, 1)
        print(f"kept warm: {out['kept_warm_seconds']} s", file=sys.stderr, flush=True)
    out["machine_end"] = {"loadavg": machine_info(args.threads)["loadavg"]}
    write_json(out, args.out)
    brief = {k: v for k, v in out.items() if k not in ("outputs", "runs")}
    if "kept_warm" in out:
        brief["kept_warm"] = {k: v for k, v in out["kept_warm"].items() if k != "turns"}
    print(json.dumps(brief, indent=1))


if __name__ == "__main__":
    main()
