"""Keeping secrets out of what tolk prints: reprs, log lines, CLI output, error texts.

The secrets tolk holds are the SASL password (`Settings.sasl_password`, kept out of `repr`) and
the redis password, which travels inside the redis URL (`redis://:pw@host:6379/0` or
`redis://user:pw@host/0`, the form redis-py takes). Wherever such a URL is shown it goes through
`mask_url` first, which keeps everything a reader needs to find the server (scheme, user, host,
port, path) and replaces the password with `***`.

`with_password` is the inverse at the edge: `Settings.from_env` folds `TOLK_REDIS_PASSWORD`
into the URL (percent-encoded), so lower layers take one URL and never see a second secret.

`redact` is the last line of defence for texts that come from elsewhere (an exception message
that might quote a URL, a log line): it replaces every occurrence of the given secrets.
"""

from __future__ import annotations

from collections.abc import Iterable
from urllib.parse import quote, urlsplit, urlunsplit

__all__ = ["MASK", "mask_url", "redact", "with_password"]

MASK = "***"


def _netloc(username: str | None, password: str | None, host: str) -> str:
    userinfo = username or ""
    if password is not None:
        userinfo += f":{password}"
    return f"{userinfo}@{host}" if userinfo else host


def _host_part(netloc: str) -> str:
    """`user:pw@host:port` -> `host:port` (the text after the last '@')."""
    return netloc.rpartition("@")[2]


def mask_url(url: str) -> str:
    """`redis://:secret@127.0.0.1:6379/0` -> `redis://:***@127.0.0.1:6379/0`; a URL without a
    password is returned unchanged."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return MASK  # not a URL we can read: show nothing of it
    if parts.password is None:
        return url
    netloc = _netloc(parts.username, MASK, _host_part(parts.netloc))
    return urlunsplit(parts._replace(netloc=netloc))


def with_password(url: str, password: str) -> str:
    """`url` with its password set to `password` (percent-encoded), the user kept."""
    parts = urlsplit(url)
    if not parts.hostname:
        raise ValueError(f"not a URL with a host: {mask_url(url)!r}")
    netloc = _netloc(parts.username, quote(password, safe=""), _host_part(parts.netloc))
    return urlunsplit(parts._replace(netloc=netloc))


def redact(text: str, secrets: Iterable[str]) -> str:
    """`text` with every non-empty secret (and its percent-encoded form) replaced by `***`."""
    for secret in secrets:
        if not secret:
            continue
        text = text.replace(secret, MASK)
        encoded = quote(secret, safe="")
        if encoded != secret:
            text = text.replace(encoded, MASK)
    return text
