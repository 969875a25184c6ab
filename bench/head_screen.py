"""The LM head's screen in the engine: decode steps with and without it, in one process.

Greedy rows need only the head's argmax. With int8 weights the head is a step's largest read
(Gemma 3 270M: 168 MB of ~270 MB), and `EngineConfig.screen_lm_head` reads an int4 copy instead
(105 MB) and rescores the few candidates with the int8 rows (kernels/int8_head_screen.py). This
benchmark builds two engines over one prepared model, the same in everything but the screen
(compiled decode by default, as `tolk worker` runs), and alternates them:

- per batch size, `--rounds` rounds of: each engine generates `--new-tokens` greedy tokens for
  the same prompts (the prefix cache off, so each round prefills the same way), timed per
  engine; the decode step time is (generation time - a 1-token generation's time) / (tokens - 1);
- the tokens of both engines compared (`same_tokens`: they are the int8 head's argmax either
  way, unless a near-tie or a 6-sigma miss, docs: kernels/int8_head_screen.py);
- one JSON object: per batch size the median step of each and their ratio (off / on).

    python -m bench.head_screen --model gemma3-270m --batches 1,4
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from bench._common import JSON, dump, machine_info, median, parse_ints, write_json

TEXTS = (
    "Can you help me change the delivery address of my order?",
    "My package arrived damaged, what should I do now?",
    "I was charged twice for the same subscription this month.",
    "How long does a refund usually take to reach my card?",
)


def _requests(engine: Any, batch: int, new_tokens: int, tag: str) -> list[Any]:
    """`batch` greedy en->de translations of exactly `new_tokens` tokens."""
    texts = [TEXTS[i % len(TEXTS)] for i in range(batch)]
    return [
        engine.translation_request(
            t, "en", "de", request_id=f"{tag}-{i}", max_new_tokens=new_tokens, ignore_eos=True
        )
        for i, t in enumerate(texts)
    ]


def _generate_s(engine: Any, requests: list[Any]) -> tuple[float, list[list[int]]]:
    t0 = time.perf_counter()
    results = engine.generate(requests)
    return time.perf_counter() - t0, [r.token_ids for r in results]


def run(args: argparse.Namespace) -> JSON:
    import torch

    from workers.engine.engine import Engine
    from workers.engine.engine_config import EngineConfig
    from workers.engine.loader import load_model

    torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    engines: dict[str, Any] = {}
    for name, screen in (("screen", True), ("full_head", False)):
        config = EngineConfig(
            model=args.model,
            quantize=args.quantize,
            compile_decode=not args.eager,
            compile_max_batch=max(args.batches),
            screen_lm_head=screen,
            enable_prefix_caching=False,
        )
        engines[name] = Engine.from_config(config, loaded=loaded)
    screened = engines["screen"].lm_screen is not None
    out: JSON = {
        "benchmark": "head_screen",
        "machine": machine_info(args.threads),
        "model": args.model,
        "quantize": args.quantize,
        "compiled": not args.eager,
        "screen": type(engines["screen"].lm_screen).__name__ if screened else None,
        "new_tokens": args.new_tokens,
        "rounds": args.rounds,
        "batches": {},
    }
    for batch in args.batches:
        step_ms: dict[str, list[float]] = {name: [] for name in engines}
        same = True
        for round_ in range(args.rounds + 1):  # round 0 warms up, not timed
            tokens: dict[str, list[list[int]]] = {}
            order = list(engines) if round_ % 2 == 0 else list(reversed(engines))
            for name in order:
                engine = engines[name]
                tag = f"{name}-{batch}-{round_}"
                one, _ = _generate_s(engine, _requests(engine, batch, 1, f"{tag}-1"))
                full, tokens[name] = _generate_s(
                    engine, _requests(engine, batch, args.new_tokens, tag)
                )
                if round_ > 0:
                    step_ms[name].append((full - one) / (args.new_tokens - 1) * 1e3)
            same = same and tokens["screen"] == tokens["full_head"]
        on, off = median(step_ms["screen"]), median(step_ms["full_head"])
        out["batches"][str(batch)] = {
            "step_ms_screen": round(on, 3),
            "step_ms_full_head": round(off, 3),
            "speedup": round(off / on, 3),
            "same_tokens": same,
            "rounds_ms": {k: [round(v, 3) for v in vs] for k, vs in step_ms.items()},
        }
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--quantize", choices=["int8", "int4"], default="int8")
    p.add_argument("--batches", type=parse_ints, default=[1, 4])
    p.add_argument("--new-tokens", type=int, default=41)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--eager", action="store_true", help="no compiled decode graphs")
    p.add_argument("--out", default="bench/out/head_screen.json")
    args = p.parse_args(argv)
    result = run(args)
    write_json(result, args.out)
    print(dump(result))


if __name__ == "__main__":
    main()
