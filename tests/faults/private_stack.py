"""A Kafka broker and a redis-server of the fault tests' own, and broker settings they change.

`PrivateStack` starts them with ``bash compose/stack.sh up`` under a temporary
`TOLK_STATE_DIR` on free loopback ports (probed upwards from 19092 / 19093 / 16379), so a test
may stop and start them without touching the shared stack on 9092 / 6379 that other tests and
people use. The broker's jars are hard-linked from the shared stack's state dir when it has
them (else `stack.sh` gathers them with mvn from ~/.m2). `stop_kafka()` / `stop_redis()`
signal the pid in the stack's pidfile and wait until the process is gone; `start_kafka()` /
`start_redis()` run ``stack.sh up`` again, which starts what is not running and waits until it
answers. No edit of `compose/stack.sh` is needed for any of it.

`set_producer_quota()` sets a client's `producer_byte_rate` quota on the broker, a raw
AlterClientQuotas request since confluent-kafka's AdminClient has no call for it.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
STACK_SCRIPT = REPO / "compose" / "stack.sh"
DEFAULT_STATE_DIR = Path.home() / ".local" / "state" / "tolk"


class StackError(RuntimeError):
    """compose/stack.sh failed; the message carries the tail of its log."""


def free_port(start: int, taken: Sequence[int] = ()) -> int:
    """The first port >= `start` that nothing listens on or holds on 127.0.0.1."""
    for port in range(start, start + 500):
        if port in taken:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {start}..{start + 499}")


def _alive(pid: int) -> bool:
    """True while `pid` runs (a zombie left to an init that does not reap counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def last_lines(text: str, lines: int = 30) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


class PrivateStack:
    """Kafka + redis of this test session only, under `state_dir` (see the module docstring)."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self.kafka_port = free_port(19092)
        self.controller_port = free_port(19093, taken=[self.kafka_port])
        self.redis_port = free_port(16379, taken=[self.kafka_port, self.controller_port])
        self.env = os.environ | {
            "TOLK_STATE_DIR": str(state_dir),
            "TOLK_KAFKA_PORT": str(self.kafka_port),
            "TOLK_KAFKA_CONTROLLER_PORT": str(self.controller_port),
            "TOLK_REDIS_PORT": str(self.redis_port),
            "TOLK_PYTHON": sys.executable,
        }

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.kafka_port}"

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.redis_port}/0"

    def _stack(self, command: str, timeout: float = 600) -> str:
        done = subprocess.run(
            ["bash", str(STACK_SCRIPT), command],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )
        if done.returncode != 0:
            raise StackError(
                f"stack.sh {command} failed (exit {done.returncode}):\n{last_lines(done.stderr)}"
            )
        return done.stderr

    def _seed_jars(self) -> None:
        """Hard-link the shared stack's gathered jars (saves an mvn run); stack.sh checks
        their stamp against compose/pom.xml and gathers again if it differs."""
        source = Path(os.environ.get("TOLK_STATE_DIR") or DEFAULT_STATE_DIR) / "kafka-libs"
        target = self.state_dir / "kafka-libs"
        if target.exists() or not (source / ".gathered").is_file():
            return
        try:
            shutil.copytree(source, target, copy_function=os.link)
        except OSError:
            shutil.rmtree(target, ignore_errors=True)
            shutil.copytree(source, target)

    def up(self) -> None:
        """Start whatever is not running (idempotent) and wait until both answer."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self._seed_jars()
        self._stack("up")

    def down(self) -> None:
        self._stack("down", timeout=180)

    def _pid(self, pidfile: Path) -> int | None:
        try:
            pid = int(pidfile.read_text().strip())
        except (OSError, ValueError):
            return None
        return pid if _alive(pid) else None

    def kafka_pid(self) -> int | None:
        return self._pid(self.state_dir / "kafka" / "kafka.pid")

    def redis_pid(self) -> int | None:
        return self._pid(self.state_dir / "redis" / "redis.pid")

    def _stop(self, pid: int | None, sig: signal.Signals, timeout: float, what: str) -> None:
        if pid is None:
            raise StackError(f"{what} is not running under {self.state_dir}")
        os.kill(pid, sig)
        end = time.monotonic() + timeout
        while _alive(pid):
            if time.monotonic() > end:
                os.kill(pid, signal.SIGKILL)
                end = time.monotonic() + 10
            time.sleep(0.05)

    def stop_kafka(self, sig: signal.Signals = signal.SIGTERM, timeout: float = 60) -> None:
        """Stop the broker process (SIGTERM: its controlled shutdown) and wait until it is gone."""
        self._stop(self.kafka_pid(), sig, timeout, "kafka")

    def start_kafka(self) -> None:
        self.up()

    def stop_redis(self, sig: signal.Signals = signal.SIGTERM, timeout: float = 20) -> None:
        self._stop(self.redis_pid(), sig, timeout, "redis")

    def start_redis(self) -> None:
        self.up()


# -- client quotas -------------------------------------------------------------------------------


def _kafka_string(text: str | None) -> bytes:
    if text is None:
        return struct.pack(">h", -1)
    raw = text.encode()
    return struct.pack(">h", len(raw)) + raw


def set_producer_quota(bootstrap: str, client_id: str, byte_rate: float | None) -> None:
    """Set (or, with None, remove) the `producer_byte_rate` quota of `client_id`.

    confluent-kafka's AdminClient has no client-quota call, so this sends one AlterClientQuotas
    request (API key 49, version 0, KIP-546) over a plain socket: a real broker setting, the
    one `kafka-configs --entity-type clients --add-config producer_byte_rate=N` makes.
    """
    host, _, port = bootstrap.split(",")[0].rpartition(":")
    op = _kafka_string("producer_byte_rate") + struct.pack(
        ">d?", byte_rate if byte_rate is not None else 0.0, byte_rate is None
    )
    entity = _kafka_string("client-id") + _kafka_string(client_id)
    body = (
        struct.pack(">i", 1)  # entries
        + struct.pack(">i", 1)  # entity parts
        + entity
        + struct.pack(">i", 1)  # ops
        + op
        + struct.pack(">?", False)  # validate_only
    )
    header = struct.pack(">hhi", 49, 0, 1) + _kafka_string("tolk-faults")
    payload = header + body
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(struct.pack(">i", len(payload)) + payload)
        size = struct.unpack(">i", _read_exact(sock, 4))[0]
        response = _read_exact(sock, size)
    # correlation id, throttle ms, entries count, then the first entry's error code
    _corr, _throttle, count = struct.unpack(">iii", response[:12])
    (error_code,) = struct.unpack(">h", response[12:14]) if count else (0,)
    if error_code != 0:
        raise StackError(f"AlterClientQuotas for {client_id!r} failed: error code {error_code}")


def _read_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise StackError("the broker closed the connection")
        data += chunk
    return data
