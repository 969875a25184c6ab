"""A small in-memory Schema Registry speaking the Confluent-compatible REST API, for the unit
tests of `schemas/registry.py` and the codec's id resolution: subjects, versions, ids shared by
identical schemas, compatibility judged the simple way (BACKWARD: a new schema gives every field
it adds a default; FORWARD: the old one every field the new one drops; FULL: both), verbose
compatibility checks, basic-auth capture. The real registry's tests run against the stack's."""

from __future__ import annotations

import json
import threading
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class FakeRegistry:
    def __init__(self) -> None:
        self.ids: dict[str, int] = {}  # canonical schema JSON -> id
        self.schemas: dict[int, str] = {}
        self.versions: dict[str, list[int]] = {}
        self.compatibility: dict[str, str] = {}
        self.calls: list[tuple[str, str]] = []
        self.auth: list[str | None] = []

    def incompatibility(self, subject: str, schema: dict[str, Any]) -> list[str]:
        level = self.compatibility.get(subject, "BACKWARD")
        if level == "NONE" or not self.versions.get(subject):
            return []
        latest = json.loads(self.schemas[self.versions[subject][-1]])
        messages = []
        if not level.startswith("FORWARD"):  # BACKWARD, FULL: the new schema reads old data
            messages += _missing_defaults(schema, latest)
        if level.startswith(("FORWARD", "FULL")):  # the old schema reads new data
            messages += _missing_defaults(latest, schema)
        return messages

    def handle(self, method: str, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        parsed = urllib.parse.urlsplit(path)
        parts = [urllib.parse.unquote(p) for p in parsed.path.strip("/").split("/")]
        self.calls.append((method, parsed.path))
        if method == "GET" and parts == ["subjects"]:
            return 200, sorted(self.versions)
        if method == "GET" and parts[:2] == ["schemas", "ids"]:
            schema_id = int(parts[2])
            if schema_id not in self.schemas:
                return 404, {"error_code": 40403, "message": "Schema not found"}
            return 200, {"schema": self.schemas[schema_id]}
        if method == "PUT" and parts[0] == "config":
            self.compatibility[parts[1]] = body["compatibility"]
            return 200, {"compatibility": body["compatibility"]}
        if method == "POST" and parts[0] == "compatibility":
            messages = self.incompatibility(parts[2], json.loads(body["schema"]))
            return 200, {"is_compatible": not messages, "messages": messages}
        if method == "POST" and parts[0] == "subjects":
            subject, schema = parts[1], json.loads(body["schema"])
            canonical = json.dumps(schema, sort_keys=True)
            if len(parts) == 2:  # lookup
                if subject not in self.versions:
                    return 404, {"error_code": 40401, "message": f"Subject '{subject}' not found."}
                found = self.ids.get(canonical)
                if found is None or found not in self.versions[subject]:
                    return 404, {"error_code": 40403, "message": "Schema not found"}
                return 200, {"subject": subject, "id": found, "version": 1}
            messages = self.incompatibility(subject, schema)
            if messages:
                return 409, {
                    "error_code": 409,
                    "message": "Schema being registered is incompatible with an earlier "
                    f'schema for subject "{subject}", details: {messages}',
                }
            schema_id = self.ids.setdefault(canonical, len(self.ids) + 1)
            self.schemas[schema_id] = canonical
            versions = self.versions.setdefault(subject, [])
            if schema_id not in versions:
                versions.append(schema_id)
            return 200, {"id": schema_id}
        return 404, {"error_code": 404, "message": f"no route {method} {path}"}


def _missing_defaults(reader: dict[str, Any], writer: dict[str, Any]) -> list[str]:
    """The reader's fields the writer lacks that have no default (what makes Avro fail)."""
    written = {f["name"] for f in writer.get("fields", [])}
    return [
        f"READER_FIELD_MISSING_DEFAULT_VALUE, location:/fields/{i}, field {f['name']} "
        "has no default value"
        for i, f in enumerate(reader.get("fields", []))
        if f["name"] not in written and "default" not in f
    ]


@contextmanager
def serve(registry: FakeRegistry | None = None) -> Iterator[tuple[FakeRegistry, str]]:
    """The fake on 127.0.0.1 (an ephemeral port): (registry, base URL)."""
    fake = registry or FakeRegistry()

    class Handler(BaseHTTPRequestHandler):
        def _answer(self, method: str) -> None:
            fake.auth.append(self.headers.get("Authorization"))
            size = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(size) or b"{}") if size else {}
            status, out = fake.handle(method, self.path, body)
            data = json.dumps(out).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/vnd.schemaregistry.v1+json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 (http.server's names)
            self._answer("GET")

        def do_POST(self) -> None:  # noqa: N802
            self._answer("POST")

        def do_PUT(self) -> None:  # noqa: N802
            self._answer("PUT")

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield fake, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
