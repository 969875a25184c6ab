"""The dropped-spans check on real turns (issue #28): real support turns with their names
anonymised as `#NAME#`, translated unguarded, and what `dropped_spans` flags.

No sentence in data/ carries a placeholder, so the check's precision cannot be judged on the
sets as they are. Support logs that reach tolk are often anonymised the way the WMT 2020 chat
task's were ("Hi #NAME#, thanks for contacting #PRS_ORG#."): this script makes such turns from
BConTrasT (dev, then train; `data/bcontrast_wmt20_chat`) by replacing each proper name that the
human translation copied (`names.name_candidates` of the source that the reference holds
verbatim and that are not common words) with `#NAME#`, translates them with the engine's
default prompt form and no checks (Gemma 3 270M int8 by default), and writes one JSON line per
turn with the spans `dropped_spans` flags. The flagged ones are judged by hand into
`data/judged/spans.jsonl`.

    python -m bench.spans_sample --limit 300 --out bench/out/spans_sample.jsonl
    python -m bench.spans_sample --offset 300 --limit 350 --out bench/out/spans_sample2.jsonl
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterator

import torch

from replay.datasets import Utterance, bcontrast
from workers.engine.engine import Engine, EngineConfig
from workers.engine.loader import load_model
from workers.stages.faithful.names import common_words, name_candidates
from workers.stages.faithful.spans import dropped_spans

PLACEHOLDER = "#NAME#"
_RUN = re.compile(r"#NAME#(?:\s+#NAME#)+")  # a name of several words is one placeholder


def anonymised(u: Utterance) -> tuple[str, str] | None:
    """(source, reference) with the copied names replaced, or None when the turn has none."""
    common = common_words(u.source_lang) or frozenset()
    names = [
        n
        for n in dict.fromkeys(name_candidates(u.source))
        if n.casefold() not in common and re.search(rf"\b{re.escape(n)}\b", u.target)
    ]
    if not names:
        return None
    source, reference = u.source, u.target
    for n in names:
        source = re.sub(rf"\b{re.escape(n)}\b", PLACEHOLDER, source)
        reference = re.sub(rf"\b{re.escape(n)}\b", PLACEHOLDER, reference)
    return _RUN.sub(PLACEHOLDER, source), _RUN.sub(PLACEHOLDER, reference)


def turns(limit: int) -> Iterator[tuple[Utterance, str, str]]:
    n = 0
    for split in ("dev", "train"):
        for u in bcontrast(split):
            made = anonymised(u)
            if made is not None:
                yield u, *made
                n += 1
                if n >= limit:
                    return


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--limit", type=int, default=300)
    ap.add_argument("--offset", type=int, default=0, help="skip the first turns (a second run)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(2)
    items = list(turns(args.offset + args.limit))[args.offset :]
    engine = Engine(
        load_model(args.model),
        EngineConfig(kv_cache_tokens=32768, quantize="int8", compile_decode=False),
    )
    requests = [
        engine.translation_request(
            src, u.source_lang, u.target_lang, request_id=f"s{i}", max_new_tokens=256
        )
        for i, (u, src, _) in enumerate(items)
    ]
    results = []
    for k in range(0, len(requests), 32):
        results += engine.generate(requests[k : k + 32])
        print(f"{len(results)}/{len(requests)}", file=sys.stderr, flush=True)
    flagged = 0
    with open(args.out, "w", encoding="utf-8") as f:
        for (u, src, ref), r in zip(items, results, strict=True):
            found = dropped_spans(src, r.text)
            flagged += bool(found)
            row = {
                "pair": f"{u.source_lang}-{u.target_lang}",
                "source": src,
                "output": r.text,
                "reference": ref,
                "flagged": list(found),
            }
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    print(json.dumps({"turns": len(items), "flagged": flagged, "model": args.model}))


if __name__ == "__main__":
    main()
