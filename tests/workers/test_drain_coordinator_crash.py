"""The drain monitor survives a broker that answers NOT_COORDINATOR (issue 26, the native crash).

librdkafka (2.16 and earlier: confluentinc/librdkafka#5040) handles an OffsetFetch answer of
NOT_COORDINATOR by asking the handle's consumer group to look up its coordinator again
(`rd_kafka_cgrp_op(rk->rk_cgrp, ...)`); an AdminClient has no consumer group, so its
`list_consumer_group_offsets` reads NULL + 0x58 on the `rdk:main` thread and the process dies
with SIGSEGV, the "segfault at 58 ... in librdkafka" of the issue. librdkafka's threads block
every signal, so the kernel kills the process without running faulthandler: no dump, no log
line (docs/OPERATIONS.md, "Native crashes").

A real broker answers so only while a group's coordinator moves or loads, so the answer is
injected here with librdkafka's own mock cluster (`test.mock.num.brokers`, driven through
ctypes from the very librdkafka the confluent-kafka wheel ships): the next OffsetFetch requests
are answered NOT_COORDINATOR. The reader runs in a child process, so the old code's crash
fails the test instead of killing pytest. The child first proves the injection reaches the
crashing path: the same answer given to an AdminClient's `list_consumer_group_offsets` kills a
second child.
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

MOCK = """
import ctypes, os
import confluent_kafka
from confluent_kafka import Producer

libs = os.path.join(os.path.dirname(confluent_kafka.__file__), "..", "confluent_kafka.libs")
lib = ctypes.CDLL(os.path.join(libs, next(f for f in os.listdir(libs) if "rdkafka" in f)))
lib.rd_kafka_handle_mock_cluster.restype = ctypes.c_void_p
lib.rd_kafka_handle_mock_cluster.argtypes = [ctypes.c_void_p]
lib.rd_kafka_mock_cluster_bootstraps.restype = ctypes.c_char_p
lib.rd_kafka_mock_cluster_bootstraps.argtypes = [ctypes.c_void_p]
lib.rd_kafka_mock_topic_create.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int,
                                           ctypes.c_int]
lib.rd_kafka_mock_push_request_errors.argtypes = [ctypes.c_void_p, ctypes.c_int16,
                                                  ctypes.c_size_t, ctypes.c_int, ctypes.c_int]
OFFSET_FETCH, NOT_COORDINATOR = 9, 16

holder = Producer({"test.mock.num.brokers": 1, "log_level": 0})  # owns the mock cluster
rk = ctypes.c_void_p.from_address(id(holder) + 16).value  # confluent-kafka's Handle.rk
cluster = lib.rd_kafka_handle_mock_cluster(rk)
assert cluster, "no mock cluster"
bootstrap = lib.rd_kafka_mock_cluster_bootstraps(cluster).decode()
lib.rd_kafka_mock_topic_create(cluster, b"t26.requests.de", 2, 1)
lib.rd_kafka_mock_push_request_errors(cluster, OFFSET_FETCH, 2, NOT_COORDINATOR, NOT_COORDINATOR)
print("injected", flush=True)
"""

READER = """
from confluent_kafka import KafkaException
from workers.kafka.drain import BrokerOffsetsReader

reader = BrokerOffsetsReader({"bootstrap.servers": bootstrap, "log_level": 0}, "g26",
                             {"de": ["t26.requests.de"]}, timeout_s=5.0)
answers = []
for _ in range(4):  # two NOT_COORDINATOR answers, then the real one
    try:
        parts = reader()["de"]
        answers.append(sorted((p.partition, p.committed) for p in parts))
        break
    except KafkaException as exc:
        answers.append(exc.args[0].name())
reader.close()
print("answers", answers, flush=True)
"""

ADMIN = """
from confluent_kafka import ConsumerGroupTopicPartitions, TopicPartition
from confluent_kafka.admin import AdminClient

admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 0})
request = [ConsumerGroupTopicPartitions("g26", [TopicPartition("t26.requests.de", 0)])]
futures = admin.list_consumer_group_offsets(request, request_timeout=5)
print("admin answered", futures["g26"].exception(10), flush=True)
"""


def _child(body: str, *, expect_crash: bool = False) -> subprocess.CompletedProcess[str]:
    """Run `body` after the mock cluster's set-up in a child process. A child expected to
    crash dumps no core and says so in the file `TOLK_EXPECTED_CRASHES` names (CI's "native
    crashes" step, .ci/run, then tells this deliberate segfault in the kernel log from a real
    one)."""
    if expect_crash and os.environ.get("TOLK_EXPECTED_CRASHES"):
        with open(os.environ["TOLK_EXPECTED_CRASHES"], "a") as f:
            f.write(f"{__name__}: the AdminClient reproduction of librdkafka#5040 (SIGSEGV)\n")
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(MOCK) + textwrap.dedent(body)],
        cwd=REPO,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
        preexec_fn=_no_core_dump if expect_crash else None,
    )


def _no_core_dump() -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def test_the_offsets_reader_survives_a_not_coordinator_answer() -> None:
    proc = _child(READER)
    assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr[-2000:])
    assert "injected" in proc.stdout
    answers = proc.stdout.split("answers ", 1)[1]
    # each injected answer is a retriable error the monitor retries; then the real offsets
    assert "NOT_COORDINATOR" in answers
    assert "[(0, -1001), (1, -1001)]" in answers  # a fresh group: nothing committed


def test_the_injected_answer_is_the_one_that_crashes_an_admin_client() -> None:
    """The reproduction of the native crash itself (why the reader must not use the
    AdminClient for committed offsets): if a librdkafka fix lands, this fails and says so."""
    proc = _child(ADMIN, expect_crash=True)
    assert "injected" in proc.stdout, proc.stderr[-2000:]
    assert proc.returncode == -signal.SIGSEGV, (
        "list_consumer_group_offsets no longer crashes on NOT_COORDINATOR "
        f"(librdkafka fixed?): rc={proc.returncode} {proc.stdout!r}"
    )
    assert "admin answered" not in proc.stdout
    assert "Fatal Python error" not in proc.stderr  # rdk:main blocks signals: no dump
