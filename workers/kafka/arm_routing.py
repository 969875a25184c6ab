"""An arm's worker: which records it answers, how its replies are marked, where they are stored.

`Worker` builds an `ArmRouter` when `Settings.arm` is set (`ArmRouter.for_settings`; None
otherwise, and the worker behaves exactly as it did without arms). The router:

* follows the share table (`workers.kafka.arm_reader.ArmControlReader` on the control topic, or a
  given `ShareSource`), started before the worker subscribes so the first request is routed
  with the table as it stands;
* decides per consumed record (`serves`, with `workers.arms.route_request`; an undecodable
  record is routed by its key, so exactly one arm dead-letters it). A record that is another
  arm's is marked done by the worker without a reply and counted in
  `tolk_arm_skipped_total{lang}`. A language with nothing configured is logged once per table;
* marks replies: `model_version` becomes `"<engine version>@<arm>"` (`"@<arm>"` on replies
  made without the engine: rejected, expired, errors);
* scopes the result store (`ArmScopedStore`): every arm answers a mirrored request under the
  same request id, so each arm stores and looks up its reply under `<request id>@<arm>`;
  otherwise arm B would answer a redelivery with arm A's stored reply.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from workers.arms import ARM_SEPARATOR, ShareTable, arm_model_version, route_request
from workers.kafka.arm_control import ShareSource
from workers.kafka.arm_reader import ArmControlReader
from workers.kafka.records import ConsumedRecord
from workers.metrics import WorkerMetrics
from workers.settings import Settings
from workers.store.results import ResultStore

__all__ = ["ArmRouter", "ArmScopedStore"]

log = logging.getLogger(__name__)


class ArmScopedStore:
    """A `ResultStore` whose keys carry the arm: `<request id>@<arm>`."""

    def __init__(self, inner: ResultStore, arm: str) -> None:
        self.inner = inner
        self.arm = arm

    def _key(self, request_id: str) -> str:
        return f"{request_id}{ARM_SEPARATOR}{self.arm}"

    def get(self, request_id: str) -> bytes | None:
        return self.inner.get(self._key(request_id))

    def get_many(self, request_ids: Sequence[str]) -> list[bytes | None]:
        return self.inner.get_many([self._key(rid) for rid in request_ids])

    def put(self, request_id: str, value: bytes) -> None:
        self.inner.put(self._key(request_id), value)

    def close(self) -> None:
        self.inner.close()


class ArmRouter:
    """Routing for one arm's worker (see the module docstring)."""

    def __init__(self, arm: str, shares: ShareSource, metrics: WorkerMetrics) -> None:
        self.arm = arm
        self.shares = shares
        self.metrics = metrics
        self._unconfigured_logged: tuple[ShareTable, set[str]] = (ShareTable(), set())

    @classmethod
    def for_settings(
        cls, settings: Settings, metrics: WorkerMetrics, shares: ShareSource | None = None
    ) -> ArmRouter | None:
        """The router of `settings.arm` (None without an arm); by default it reads the
        control topic under the settings' topic prefix."""
        if settings.arm is None:
            return None
        if shares is None:
            from topics.catalog import arm_control_topic

            topic = arm_control_topic(settings.topic_prefix)
            shares = ArmControlReader(settings.kafka_common(), topic)
        return cls(settings.arm, shares, metrics)

    def start(self) -> None:
        self.shares.start()
        log.info("serving as arm %r", self.arm)

    def stop(self) -> None:
        self.shares.stop()

    def model_version(self, engine_version: str) -> str:
        return arm_model_version(engine_version, self.arm)

    def serves(self, rec: ConsumedRecord) -> bool:
        """Is `rec` this arm's to answer? Counts it in `tolk_arm_skipped_total` when not."""
        table_at = getattr(self.shares, "table_at", None)  # the entries in force at its time
        table = table_at(rec.broker_ts_ms) if table_at is not None else self.shares.table()
        route = route_request(
            rec.request, arm=self.arm, lang=rec.lang, table=table, record_key=rec.key
        )
        if route.rule == "unconfigured":
            self._log_unconfigured(table, rec.lang)
        if not route.serve:
            self.metrics.arm_skipped_total.labels(lang=rec.lang).inc()
        return route.serve

    def _log_unconfigured(self, table: ShareTable, lang: str) -> None:
        seen_table, langs = self._unconfigured_logged
        if seen_table is not table:
            langs = set()
            self._unconfigured_logged = (table, langs)
        if lang not in langs:
            langs.add(lang)
            log.info("arm %s: no shares for %r (nor '*'): serving every request", self.arm, lang)
