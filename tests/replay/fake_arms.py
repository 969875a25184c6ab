"""A stand-in for an arm's worker in the replay tests: a consumer of the request topics in its
own group that answers every request with a `TranslationResult` whose model_version is
`fake@<arm>`, the way `tolk worker --arm` marks its replies (the real worker is part S's and
is not needed to test the replay job).

It records what it saw (request id, conversation, metadata, arrival time) so a test can check
mirror mode, conversation order and that no request reached an arm twice; `answer_twice`
makes it reply twice to some requests, to test duplicate counting.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import Consumer, Producer

from schemas.codec import decode_request, encode_result


@dataclass
class Seen:
    request_id: str
    conversation_id: str | None
    target_lang: str
    metadata: dict[str, str]
    partition: int
    offset: int
    at: float = field(default_factory=time.monotonic)


class FakeArm:
    """Answers the requests of `topics` as arm `arm` until `stop()`."""

    def __init__(
        self,
        bootstrap: str,
        topics: Sequence[str],
        arm: str,
        group: str,
        answer_twice: Callable[[str], bool] = lambda rid: False,
    ) -> None:
        self.arm = arm
        self.answer_twice = answer_twice
        self.seen: list[Seen] = []
        self._consumer = Consumer(
            {
                "bootstrap.servers": bootstrap,
                "group.id": group,
                "auto.offset.reset": "earliest",
                "enable.auto.commit": True,
            }
        )
        self._consumer.subscribe(list(topics))
        self._producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 1})
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"fake-arm-{arm}", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            msg = self._consumer.poll(0.05)
            self._producer.poll(0)
            if msg is None or msg.error() is not None:
                continue
            request = decode_request(msg.value() or b"")
            self.seen.append(
                Seen(
                    request["request_id"],
                    request.get("conversation_id"),
                    request["target_lang"],
                    dict(request.get("metadata") or {}),
                    msg.partition(),
                    msg.offset(),
                )
            )
            value = encode_result(self._result(request))
            copies = 2 if self.answer_twice(request["request_id"]) else 1
            for _ in range(copies):
                self._producer.produce(request["reply_topic"], value=value, key=msg.key())
        self._producer.flush(10)
        self._consumer.close()

    def _result(self, request: dict[str, Any]) -> dict[str, Any]:
        return {
            "request_id": request["request_id"],
            "status": "OK",
            "text": f"[{self.arm}] {request['text']}",
            "error": None,
            "model_version": f"fake@{self.arm}",
            "source_lang": request["source_lang"],
            "target_lang": request["target_lang"],
            "timings": {"queue_ms": 0.0, "prefill_ms": 0.0, "decode_ms": 0.0, "total_ms": 0.0},
            "tokens_in": 1,
            "tokens_out": 1,
            "cached_prefix_tokens": 0,
            "worker_id": f"fake-{self.arm}",
            "completed_at": int(time.time() * 1000),
            "conversation_id": request.get("conversation_id"),
            "metadata": {"fake.arm": self.arm},
        }

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(15)
