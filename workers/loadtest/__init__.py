"""`tolk load`: an open-loop Locust load test over Kafka, per language (docs/OPERATIONS.md).

* `texts.py`    the per-language mix of real support texts (the shipped sample, BConTrasT)
* `bridge.py`   one asyncio loop on a real thread with the project's `TranslationClient`;
                Locust's greenlets hand it sends and collect finished requests
* `locustfile.py` the Kafka user: one timer-driven user per language at a fixed rate
* `report.py`   per-language P50/P95/P99 and throughput from the raw latencies (JSON, CSV)
* `cli.py`      the headless command: `tolk load --rate de=2,fr=1 --duration 60 --out DIR`

Locust is imported without gevent's monkey-patching (`LOCUST_SKIP_MONKEY_PATCH=1`, set here,
so before any module of the package can import locust): confluent-kafka blocks in C and the
client runs its own threads and asyncio loop, which patched threads (greenlets) would stall.
A process that imported `locustfile.py` without it (a test of the dashboard did) had its
`threading` patched for good; under pytest-xdist that broke the worker's own queue
("LoopExit: This operation would block forever").
"""

import os

os.environ.setdefault("LOCUST_SKIP_MONKEY_PATCH", "1")
