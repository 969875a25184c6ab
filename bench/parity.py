"""Token parity of tolk's engine against transformers greedy, on any device and dtype, as figures.

`tests/engine/test_engine_parity.py` asserts parity in float32 on the CPU. This script measures
the same thing where an assertion would be the wrong tool: on a GPU, and in bfloat16, where two
correct implementations may part at a near-tie (different reduction orders round differently),
so the useful output is how many prompts agree and how close to a tie each divergence was.

Per model: `--prompts` (32) translation requests from `data/` (several language pairs,
`replay.datasets.mixed_translation_set`), `--new-tokens` (48) greedy tokens, EOS ignored.
- reference: transformers `generate` at batch 1 on the same dequantized weights, device, dtype
  (`eos_token_id=None`: it runs on past EOS as the engine does with `ignore_eos`, neither side
  suppresses it);
- tolk batch 1, prefix cache on (the language prefix warm) and off;
- tolk continuous batching: 4 new requests every 3 engine steps, joining a running batch.
Each tolk run reports `equal` (prompts whose tokens all match the reference) and, for the rest,
(prompt, first differing position, reference top1 - top2 logit gap there).

    python -m bench.parity --device cuda --dtype bfloat16 --out bench/out/parity_cuda_bf16.json
"""

from __future__ import annotations

import argparse
import logging
import time
from typing import Any

from bench._common import JSON, dump, machine_info, parse_csv, write_json

log = logging.getLogger("bench.parity")


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)


def compare(name: str, ours: list[list[int]], ref: list[list[int]], gap: Any) -> JSON:
    """Agreement of one tolk run with the reference; `gap(i, pos)` -> reference logit gap."""
    diverged = []
    for i, (o, r) in enumerate(zip(ours, ref, strict=True)):
        pos = first_difference(o, r)
        if pos is not None:
            diverged.append({"prompt": i, "position": pos, "ref_gap": round(gap(i, pos), 4)})
    out = {"run": name, "equal": len(ours) - len(diverged), "of": len(ours), "diverged": diverged}
    log.info("%s: %d/%d equal %s", name, out["equal"], len(ours), diverged)
    return out


def model_parity(args: argparse.Namespace, preset: str) -> JSON:
    import torch
    from transformers import AutoModelForCausalLM

    from replay.datasets import mixed_translation_set
    from workers.engine.engine import Engine, EngineConfig
    from workers.engine.loader import checkpoint_dir, load_model

    dtype = getattr(torch, args.dtype)
    device = torch.device(args.device)
    t0 = time.perf_counter()
    loaded = load_model(preset, dtype=dtype, device=device)
    hf: Any = AutoModelForCausalLM.from_pretrained(checkpoint_dir(preset), dtype=dtype)
    hf = hf.to(device).eval()
    load_s = time.perf_counter() - t0
    texts = mixed_translation_set(args.prompts)

    def engine(prefix_cache: bool) -> Engine:
        return Engine(loaded, EngineConfig(kv_cache_tokens=8192, device=args.device,
                                           enable_prefix_caching=prefix_cache))  # fmt: skip

    def requests(eng: Engine, tag: str) -> list[Any]:
        return [
            eng.translation_request(t, s, g, request_id=f"{tag}-{i}",
                                    max_new_tokens=args.new_tokens, ignore_eos=True)
            for i, (t, s, g) in enumerate(texts)
        ]  # fmt: skip

    probe = engine(False)
    prompts = [r.prompt_ids for r in requests(probe, "probe")]
    del probe

    with torch.inference_mode():
        t1 = time.perf_counter()
        ref = []
        for ids in prompts:
            x = torch.tensor([ids], device=device)
            y = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                            max_new_tokens=args.new_tokens, eos_token_id=None,
                            pad_token_id=0)  # fmt: skip
            ref.append(y[0, len(ids) :].tolist())
        ref_s = time.perf_counter() - t1

        def gap(i: int, pos: int) -> float:
            x = torch.tensor([prompts[i] + ref[i][:pos]], device=device)
            top = hf(x).logits[0, -1].float().topk(2).values
            return float(top[0] - top[1])

        runs = []
        for cached in (True, False):
            eng = engine(cached)
            reqs = requests(eng, "c" if cached else "u")
            if cached:
                eng.warm(sorted({r.group for r in reqs}))
            t2 = time.perf_counter()
            ours = [eng.generate([r])[0].token_ids for r in reqs]
            runs.append(compare(f"batch1_prefix_cache_{'on' if cached else 'off'}", ours, ref, gap)
                        | {"seconds": round(time.perf_counter() - t2, 2)})  # fmt: skip
            del eng

        eng = engine(True)
        reqs = requests(eng, "b")
        eng.warm(sorted({r.group for r in reqs}))
        t3 = time.perf_counter()
        handles, pending, step = [], list(reqs), 0
        while pending or eng.has_unfinished():
            if pending and step % 3 == 0:
                handles += [eng.submit(r) for r in pending[:4]]
                pending = pending[4:]
            eng.step()
            step += 1
        batched = [h.result(0).token_ids for h in handles]
        runs.append(compare("continuous_batching", batched, ref, gap)
                    | {"seconds": round(time.perf_counter() - t3, 2),
                       "max_batch": max(eng.stats.batch_sizes)})  # fmt: skip
    return {"model": preset, "device": args.device, "dtype": args.dtype, "load_s": round(load_s, 1),
            "reference_s": round(ref_s, 2), "prompts": len(prompts),
            "new_tokens": args.new_tokens, "runs": runs}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--models", type=parse_csv, default=["smollm2-135m"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    import torch

    torch.set_num_threads(args.threads)
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 means float32 on the GPU too
    machine = machine_info(args.threads)
    if torch.cuda.is_available():
        machine["gpu"] = torch.cuda.get_device_name()
    result = {"machine": machine, "models": [model_parity(args, m) for m in args.models]}
    write_json(result, args.out)
    print(dump(result))


if __name__ == "__main__":
    main()
