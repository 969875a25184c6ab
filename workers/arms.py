"""Arms: which serving configuration answers a request. Pure logic: no Kafka, no metrics.

An *arm* is a named serving configuration (model, quantization, prompt set, options) that a
worker started with `tolk worker --arm NAME` serves. Every arm reads the same request topics,
each in its own consumer group (`Settings.consumer_group()`), and decides per record whether
the record is its to answer (`route_request`); one that is not is marked done without a reply.

How a request finds its arm, first rule that applies:

1. **Mirror.** `metadata["tolk.mirror"] == "1"`: every arm answers it (the replay job sets it,
   so A and B see the same traffic).
2. **Named arm.** `model_version` names an arm: `"...@B"` always means arm B; a plain
   `"B"` means arm B when B is this worker's arm or an arm of the share table (otherwise it is
   an ordinary wanted model version and rule 3 applies). Only that arm answers.
3. **Shares.** The language's entry of the share table (else the default entry `"*"`) maps arm
   names to percents summing to 100. `bucket(key)` maps the routing key (the conversation id,
   else the request id) to [0, 100) with BLAKE2b; arms are taken in sorted name order with
   cumulative shares, and the first arm whose cumulative share exceeds the bucket answers. So
   the arms of a language answer every request exactly once, and a conversation stays on one
   arm while the shares stay the same (a share change moves only the conversations whose
   bucket lies in the moved band). An arm missing from the entry has share 0.
4. **Nothing configured** for the language (no entry and no `"*"`): every arm answers
   (mirror), and the worker logs it.

The reply of arm A carries `model_version = f"{engine_version}@A"` (`arm_model_version`);
`split_arm` takes it apart again (the replay report attributes replies with it). A worker
without an arm behaves as before: no suffix, every request served.

The share table is built from the compacted control topic (`workers.kafka.arm_control`); a
`ShareTable` is immutable, so the thread that reads the topic swaps a new one in and the poll
thread reads whichever is current without a lock.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from schemas.wire import WireRequest

__all__ = [
    "ARM_SEPARATOR",
    "DEFAULT_LANGUAGE",
    "MIRROR_METADATA_KEY",
    "Route",
    "ShareTable",
    "arm_model_version",
    "bucket",
    "choose_arm",
    "describe_shares",
    "named_arm",
    "parse_share_args",
    "route_request",
    "routing_key",
    "split_arm",
    "validate_arm_name",
    "validate_shares",
]

ARM_SEPARATOR = "@"
DEFAULT_LANGUAGE = "*"  # the share-table entry of every language without its own
MIRROR_METADATA_KEY = "tolk.mirror"  # metadata[...] == "1": every arm answers
SHARE_SUM_TOLERANCE = 0.01  # percents; shares must sum to 100 within this

# Arm names end up in consumer group ids, metric-free logs and model_version: no '@', no spaces.
_ARM_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def validate_arm_name(name: str) -> str:
    """`name` if it can be an arm name (letters, digits, '.', '_', '-'; at most 64), else
    ValueError."""
    if not isinstance(name, str) or not _ARM_NAME_RE.match(name):
        raise ValueError(
            f"invalid arm name {name!r}: letters, digits, '.', '_' or '-', at most 64, "
            f"no {ARM_SEPARATOR!r}"
        )
    return name


def arm_model_version(version: str, arm: str | None) -> str:
    """The `model_version` a reply of `arm` carries: `"gemma3@B"`; unchanged without an arm."""
    return version if arm is None else f"{version}{ARM_SEPARATOR}{arm}"


def split_arm(model_version: str) -> tuple[str, str | None]:
    """`"gemma3@B"` -> `("gemma3", "B")`; `"gemma3"` -> `("gemma3", None)`."""
    version, sep, arm = model_version.rpartition(ARM_SEPARATOR)
    if not sep:
        return model_version, None
    return version, arm or None


def bucket(key: str) -> float:
    """The key's place in [0, 100): BLAKE2b (8 bytes, big-endian) scaled. Stable across
    processes, hosts and Python versions (unlike `hash()`)."""
    digest = hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 * 100


def validate_shares(shares: Mapping[str, float]) -> dict[str, float]:
    """Shares as a plain dict of floats, checked: valid arm names, finite, 0..100, summing to
    100 (within `SHARE_SUM_TOLERANCE`). ValueError names what is wrong."""
    if not shares:
        raise ValueError("shares are empty: name at least one arm")
    out: dict[str, float] = {}
    for name, value in shares.items():
        validate_arm_name(name)
        share = float(value)
        if not math.isfinite(share) or not 0.0 <= share <= 100.0:
            raise ValueError(f"share of arm {name!r} must be within 0..100, got {value!r}")
        out[name] = share
    total = sum(out.values())
    if abs(total - 100.0) > SHARE_SUM_TOLERANCE:
        raise ValueError(f"shares must sum to 100, got {total:g} ({describe_shares(out)})")
    return out


def parse_share_args(args: Iterable[str]) -> dict[str, float]:
    """`["A=30", "B=70"]` -> `{"A": 30.0, "B": 70.0}` (validated)."""
    shares: dict[str, float] = {}
    for arg in args:
        name, sep, value = arg.partition("=")
        name = name.strip()
        if not sep or not name:
            raise ValueError(f"expected ARM=PERCENT, got {arg!r}")
        if name in shares:
            raise ValueError(f"arm {name!r} given twice")
        try:
            shares[name] = float(value)
        except ValueError:
            raise ValueError(f"share of arm {name!r} is not a number: {value!r}") from None
    return validate_shares(shares)


def describe_shares(shares: Mapping[str, float] | None) -> str:
    """`"A=30 B=70"` (sorted); `"(none)"` for no entry. For log lines and the CLI."""
    if shares is None:
        return "(none)"
    return " ".join(f"{name}={shares[name]:g}" for name in sorted(shares))


def choose_arm(shares: Mapping[str, float], key: str) -> str | None:
    """The arm whose cumulative share (arms in sorted name order) first exceeds `bucket(key)`;
    None when no arm has a share above 0."""
    point = bucket(key)
    cumulative = 0.0
    last_positive: str | None = None
    for name in sorted(shares):
        share = shares[name]
        if share <= 0:
            continue
        cumulative += share
        last_positive = name
        if point < cumulative:
            return name
    return last_positive  # shares summing to a hair under 100: the top band goes to the last


@dataclass(frozen=True)
class ShareTable:
    """Language (or `"*"`) -> arm -> percent; immutable (swap in `with_entry`'s result)."""

    entries: Mapping[str, Mapping[str, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        frozen = {lang: MappingProxyType(dict(s)) for lang, s in self.entries.items()}
        object.__setattr__(self, "entries", MappingProxyType(frozen))

    def shares_for(self, lang: str) -> Mapping[str, float] | None:
        """The language's shares, else the default entry's, else None (nothing configured)."""
        entry = self.entries.get(lang)
        return entry if entry is not None else self.entries.get(DEFAULT_LANGUAGE)

    def with_entry(self, lang: str, shares: Mapping[str, float] | None) -> ShareTable:
        """A new table with `lang`'s entry set, or removed when `shares` is None (a tombstone)."""
        entries = dict(self.entries)
        if shares is None:
            entries.pop(lang, None)
        else:
            entries[lang] = dict(shares)
        return ShareTable(entries)

    def arms(self) -> frozenset[str]:
        """Every arm named in any entry."""
        return frozenset(name for shares in self.entries.values() for name in shares)

    def __bool__(self) -> bool:
        return bool(self.entries)


@dataclass(frozen=True, slots=True)
class Route:
    """Whether this arm answers a request, and by which rule."""

    serve: bool
    rule: str  # "mirror" | "named" | "share" | "unconfigured"
    arm: str | None = None  # the arm that answers (None: every arm)


def routing_key(request: WireRequest | None, record_key: bytes | None = None) -> str:
    """The conversation id, else the request id, else the record's key (an undecodable record,
    `request` None: producers key by the same ids, so it lands on the same arm its request
    would)."""
    if request is not None and (request.conversation_id or request.request_id):
        return request.conversation_id or request.request_id
    return record_key.decode("utf-8", "replace") if record_key else ""


def named_arm(model_version: str | None, *, arm: str, known: frozenset[str]) -> str | None:
    """The arm a request's `model_version` names, if any (rule 2 of the module docstring)."""
    if not model_version:
        return None
    if ARM_SEPARATOR in model_version:
        return split_arm(model_version)[1]
    return model_version if model_version == arm or model_version in known else None


def route_request(
    request: WireRequest | None,
    *,
    arm: str,
    lang: str,
    table: ShareTable,
    record_key: bytes | None = None,
) -> Route:
    """Does `arm` answer `request` (of the topic language `lang`; None: a record that did not
    decode, routed by its key)? See the module docstring."""
    metadata = request.metadata if request is not None else {}
    if metadata.get(MIRROR_METADATA_KEY) == "1":
        return Route(True, "mirror")
    wanted = request.model_version if request is not None else None
    named = named_arm(wanted, arm=arm, known=table.arms())
    if named is not None:
        return Route(named == arm, "named", named)
    shares = table.shares_for(lang)
    if shares is None:
        return Route(True, "unconfigured")
    chosen = choose_arm(shares, routing_key(request, record_key))
    return Route(chosen == arm, "share", chosen)
