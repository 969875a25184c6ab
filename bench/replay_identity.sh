#!/bin/bash
# Behaviour unchanged across a refactor (issue #46, Done-when 3): the same BConTrasT dev turns
# replayed to two mirrored arms, one worker running the code at OLD (a git revision), one the
# code at NEW (default HEAD), both float32 eager without the cache (deterministic greedy
# decoding); prints how many requests got the same translation and status from both.
#
#   bash bench/replay_identity.sh OLD [NEW] [TURNS]      # needs the local stack (tolk up)
#
# Prints one JSON line: {"requests", "identical", "different", "missing"} and the first
# differences. Each arm runs from its own clone under $TMPDIR.
set -u
OLD=${1:?usage: bench/replay_identity.sh OLD [NEW] [TURNS]}
NEW=${2:-HEAD}
TURNS=${3:-200}
REPO=$(git rev-parse --show-toplevel)
PY=${PY:-$REPO/.venv/bin/python}
WORK=$(mktemp -d)
trap 'pkill -TERM -f "worker --arm identity-" 2>/dev/null; sleep 2; rm -rf "$WORK"' EXIT
FLAGS="--quantize none --no-compile-decode --no-cache --metrics-port auto"
for arm in old new; do
  rev=$OLD; [ $arm = new ] && rev=$NEW
  git clone -q "$REPO" "$WORK/$arm" && git -C "$WORK/$arm" checkout -q "$rev"
  (cd "$WORK/$arm" && TOLK_HEALTH_PORT=auto PYTHONPATH="$WORK/$arm" \
    nohup "$PY" -m workers.cli worker --arm "identity-$arm" $FLAGS > "$WORK/$arm.log" 2>&1 &)
done
for _ in $(seq 1 150); do
  grep -q consuming "$WORK/old.log" && grep -q consuming "$WORK/new.log" && break
  sleep 2
done
(cd "$WORK/new" && PYTHONPATH="$WORK/new" "$PY" -m workers.cli replay run --limit "$TURNS" \
  --rate 1 --closed-loop --arms identity-old,identity-new --run-dir "$WORK/run" --wait-s 60 \
  > "$WORK/replay.log" 2>&1) || { tail -20 "$WORK/replay.log"; exit 1; }
"$PY" - "$WORK/run" <<'PY'
import json
import sys

run = sys.argv[1]
requests = [json.loads(line) for line in open(f"{run}/requests.jsonl")]
replies: dict[str, dict[str, dict]] = {}
for line in open(f"{run}/replies.jsonl"):
    reply = json.loads(line)
    replies.setdefault(reply["request_id"], {}).setdefault(reply.get("arm"), reply)
counts = {"requests": len(requests), "identical": 0, "different": 0, "missing": 0}
diffs = []
for request in requests:
    arms = replies.get(request["request_id"], {})
    old, new = arms.get("identity-old"), arms.get("identity-new")
    if old is None or new is None:
        counts["missing"] += 1
    elif (old["status"], old["text"]) == (new["status"], new["text"]):
        counts["identical"] += 1
    else:
        counts["different"] += 1
        diffs.append([request["request_id"], old["status"], old["text"], new["status"], new["text"]])
print(json.dumps(counts))
for diff in diffs[:10]:
    print(json.dumps(diff, ensure_ascii=False))
PY
