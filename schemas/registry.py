"""A Schema Registry client: the Confluent-compatible REST API, from the standard library.

Bots in other languages produce with their platform's serializers (issue #45: Node.js's
`@kafkajs/confluent-schema-registry`, Java's registry serdes), which look a schema up by
subject and write its id in the Confluent wire format (`00`, a 4-byte id, the body). tolk talks
to the same registry through this client: `tolk topics create` registers each topic's value
schema under `<topic>-value` (TopicNameStrategy) with BACKWARD compatibility, and a codec given the
registry (`AvroCodec(ids_from=...)`) resolves the ids it has not seen by asking once each and
writes the id a subject holds (`schemas/codec.py`).

The API is the one Confluent's registry, Apicurio's `ccompat` endpoint
(`http://host:8080/apis/ccompat/v7`) and Karapace serve; only what tolk needs is here:

- `register(subject, schema)` -> id: `POST /subjects/{subject}/versions`; a schema the
  subject's compatibility rule refuses raises `RegistryError` with the registry's own message
  (409), and `check(subject, schema)` asks first without registering
  (`POST /compatibility/subjects/{subject}/versions/latest?verbose=true`);
- `lookup(subject, schema)` -> id or None: `POST /subjects/{subject}`, never registers (a
  worker must not register schemas by accident);
- `schema_by_id(id)`: `GET /schemas/ids/{id}`;
- `subjects()`, `set_compatibility(subject, level)`.

Every failure is a `RegistryError` saying what was asked, of which URL, and what the registry
answered (its `error_code` and `message` when it sent them); a registry that cannot be reached
is one too, with the cause. Credentials (HTTP basic) and a CA file for TLS come from the
caller; they are never logged (the URL is shown without its password).
"""

from __future__ import annotations

import base64
import json
import ssl
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["COMPATIBILITY_LEVELS", "RegistryError", "SchemaRegistry", "value_subject"]

CONTENT_TYPE = "application/vnd.schemaregistry.v1+json"
COMPATIBILITY_LEVELS = (
    "BACKWARD",
    "BACKWARD_TRANSITIVE",
    "FORWARD",
    "FORWARD_TRANSITIVE",
    "FULL",
    "FULL_TRANSITIVE",
    "NONE",
)
SUBJECT_NOT_FOUND = 40401
SCHEMA_NOT_FOUND = 40403


def value_subject(topic: str) -> str:
    """The subject of a topic's values under TopicNameStrategy, what the bots' serializers use
    by default: `tolk.requests.de` -> `tolk.requests.de-value`."""
    return f"{topic}-value"


class RegistryError(RuntimeError):
    """A registry call failed; `status` is the HTTP status (0: not reached), `code` the
    registry's `error_code` when it sent one."""

    def __init__(self, message: str, *, status: int = 0, code: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


@dataclass(frozen=True)
class SchemaRegistry:
    """A registry at `url` (e.g. `http://127.0.0.1:8081/apis/ccompat/v7`)."""

    url: str
    username: str | None = None
    password: str | None = field(default=None, repr=False)  # never in a repr or a log
    ca_file: str | None = None  # TLS: the CA that signed the registry's certificate
    timeout_s: float = 5.0

    def __post_init__(self) -> None:
        parts = urllib.parse.urlsplit(self.url)
        if parts.scheme not in ("http", "https"):
            raise ValueError(f"registry URL must be http(s)://..., got {self.shown_url!r}")
        if parts.username is not None:
            raise ValueError("credentials in the URL: use SchemaRegistry.from_url")

    @classmethod
    def from_url(
        cls, url: str, *, ca_file: str | None = None, timeout_s: float = 5.0
    ) -> SchemaRegistry:
        """A registry from a URL that may carry `user:password@` (TOLK_SCHEMA_REGISTRY_URL)."""
        parts = urllib.parse.urlsplit(url)
        user = urllib.parse.unquote(parts.username) if parts.username else None
        password = urllib.parse.unquote(parts.password) if parts.password else None
        return cls(_without_credentials(url), username=user, password=password,
                   ca_file=ca_file or None, timeout_s=timeout_s)  # fmt: skip

    @property
    def shown_url(self) -> str:
        """The URL without credentials (for messages and logs)."""
        return _without_credentials(self.url)

    # -- the calls ----------------------------------------------------------------------------

    def subjects(self) -> list[str]:
        return [str(s) for s in self._call("GET", "/subjects")]

    def register(self, subject: str, schema: Mapping[str, Any]) -> int:
        """Register `schema` under `subject` (a no-op returning the id when it is already
        there); a schema the subject's compatibility refuses raises `RegistryError` (409)."""
        out = self._call("POST", f"/subjects/{_q(subject)}/versions", _schema_body(schema))
        return int(out["id"])

    def lookup(self, subject: str, schema: Mapping[str, Any]) -> int | None:
        """The id of `schema` under `subject`, None when it is not registered there."""
        try:
            out = self._call("POST", f"/subjects/{_q(subject)}", _schema_body(schema))
        except RegistryError as exc:
            if exc.code in (SUBJECT_NOT_FOUND, SCHEMA_NOT_FOUND) or exc.status == 404:
                return None
            raise
        return int(out["id"])

    def check(self, subject: str, schema: Mapping[str, Any]) -> list[str]:
        """Why `schema` may not be registered under `subject` by its compatibility rule; []
        when it may (or the subject has no version yet)."""
        path = f"/compatibility/subjects/{_q(subject)}/versions/latest?verbose=true"
        try:
            out = self._call("POST", path, _schema_body(schema))
        except RegistryError as exc:
            if exc.code == SUBJECT_NOT_FOUND or exc.status == 404:
                return []
            raise
        if out.get("is_compatible", True):
            return []
        messages = out.get("messages") or ["incompatible (the registry gave no reason)"]
        return [str(m) for m in messages]

    def schema_by_id(self, schema_id: int) -> dict[str, Any]:
        """The (Avro) schema the registry gave id `schema_id`."""
        out = self._call("GET", f"/schemas/ids/{int(schema_id)}")
        try:
            schema = json.loads(out["schema"])
        except (KeyError, TypeError, json.JSONDecodeError) as exc:
            raise RegistryError(f"schema id {schema_id}: unreadable answer ({exc})") from exc
        if not isinstance(schema, dict):
            raise RegistryError(f"schema id {schema_id} is not an Avro record schema")
        return schema

    def set_compatibility(self, subject: str, level: str) -> None:
        if level not in COMPATIBILITY_LEVELS:
            raise ValueError(f"unknown compatibility {level!r}; one of {COMPATIBILITY_LEVELS}")
        self._call("PUT", f"/config/{_q(subject)}", {"compatibility": level})

    # -- HTTP ----------------------------------------------------------------------------------

    def _call(self, method: str, path: str, body: Mapping[str, Any] | None = None) -> Any:
        url = self.url.rstrip("/") + path
        shown = self.shown_url.rstrip("/") + path
        data = None if body is None else json.dumps(body).encode("utf-8")
        request = urllib.request.Request(url, data=data, method=method)
        request.add_header("Accept", f"{CONTENT_TYPE}, application/json")
        if data is not None:
            request.add_header("Content-Type", CONTENT_TYPE)
        if self.username is not None:
            token = base64.b64encode(f"{self.username}:{self.password or ''}".encode()).decode()
            request.add_header("Authorization", f"Basic {token}")
        context = ssl.create_default_context(cafile=self.ca_file) if self.ca_file else None
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s, context=context) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            raise _http_error(method, shown, exc) from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise RegistryError(f"{method} {shown}: registry not reachable ({reason})") from exc
        try:
            return json.loads(raw) if raw else {}
        except json.JSONDecodeError as exc:
            raise RegistryError(f"{method} {shown}: not JSON ({raw[:80]!r})") from exc


def _without_credentials(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


def _q(subject: str) -> str:
    return urllib.parse.quote(subject, safe="")


def _schema_body(schema: Mapping[str, Any]) -> dict[str, str]:
    return {"schema": json.dumps(schema, separators=(",", ":")), "schemaType": "AVRO"}


def _http_error(method: str, shown: str, exc: urllib.error.HTTPError) -> RegistryError:
    code: int | None = None
    message = exc.reason
    try:
        answer = json.loads(exc.read() or b"{}")
        code = int(answer["error_code"]) if "error_code" in answer else None
        message = str(answer.get("message") or message)
    except (ValueError, TypeError, AttributeError):
        pass
    return RegistryError(f"{method} {shown}: {exc.code} {message}", status=int(exc.code), code=code)
