"""`ArmControlReader.table_at`: a request is routed by the share entries in force at its own
timestamp, so two arms reading it at different moments around a change route it alike."""

from __future__ import annotations

from typing import Any

from schemas.codec import encode_arm_shares
from workers.kafka.arm_reader import ArmControlReader


class _Msg:
    def __init__(self, key: bytes, value: bytes | None, offset: int, ts_ms: int) -> None:
        self._key, self._value, self._offset, self._ts = key, value, offset, ts_ms

    def error(self) -> None:
        return None

    def key(self) -> bytes:
        return self._key

    def value(self) -> bytes | None:
        return self._value

    def offset(self) -> int:
        return self._offset

    def partition(self) -> int:
        return 0

    def timestamp(self) -> tuple[int, int]:
        return (1, self._ts)


def _entry(lang: str, shares: dict[str, float], at: int, offset: int) -> Any:
    value = encode_arm_shares(
        {"language": lang, "shares": shares, "updated_at": at, "updated_by": "t"}
    )
    return _Msg(lang.encode(), value, offset, at - 2000)


def test_requests_are_routed_by_the_entry_in_force_at_their_time() -> None:
    reader = ArmControlReader({}, "control", consumer_factory=lambda conf: None)
    reader._apply(_entry("de", {"A": 95.0, "B": 5.0}, at=1_000, offset=0))
    reader._apply(_entry("de", {"A": 75.0, "B": 25.0}, at=5_000, offset=1))  # written ahead
    assert dict(reader.table().entries["de"]) == {"A": 75.0, "B": 25.0}  # the latest
    assert reader.table_at(500).shares_for("de") is None  # before any entry: unconfigured
    assert dict(reader.table_at(4_999).entries["de"]) == {"A": 95.0, "B": 5.0}
    assert dict(reader.table_at(5_000).entries["de"]) == {"A": 75.0, "B": 25.0}
    assert reader.table_at(4_000) is reader.table_at(4_500)  # cached per set of entries
    reader._apply(_Msg(b"de", None, 2, 9_000))  # a tombstone: in force at its record time
    assert dict(reader.table_at(8_999).entries["de"]) == {"A": 75.0, "B": 25.0}
    assert reader.table_at(9_000).shares_for("de") is None
