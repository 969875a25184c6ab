"""The reply's metadata keys (workers/reply_metadata.py): each declared once, with a comment,
and spelled nowhere else in product code, the replay or the benchmarks."""

from __future__ import annotations

import ast
from pathlib import Path

from workers import reply_metadata as meta

ROOT = Path(__file__).resolve().parents[2]
HOME = ROOT / "workers" / "reply_metadata.py"


def test_each_key_is_declared_once_with_a_comment() -> None:
    assert len(set(meta.REPLY_KEYS)) == len(meta.REPLY_KEYS) == 21
    assert all(key.startswith("tolk.") for key in meta.REPLY_KEYS)
    source = HOME.read_text(encoding="utf-8").splitlines()
    for key in meta.REPLY_KEYS:
        (line,) = [i for i, text in enumerate(source) if f'= "{key}"' in text]
        # the comment is on the line or on the line above it
        assert "#" in source[line] or source[line - 1].lstrip().startswith("#"), key


def spelled_keys(path: Path, root: Path = ROOT) -> list[str]:
    """String constants of `path` that are a declared key or a key under a declared one."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            value = node.value
            if any(value == k or value.startswith(k + ".") for k in meta.REPLY_KEYS):
                hits.append(f"{path.relative_to(root)}:{node.lineno} {value}")
    return hits


def test_no_other_module_spells_a_key() -> None:
    files = [
        f
        for folder in ("workers", "replay", "bench", "schemas", "topics")
        for f in sorted((ROOT / folder).rglob("*.py"))
        if f != HOME
    ]
    assert len(files) > 80
    assert [hit for f in files for hit in spelled_keys(f)] == []


def test_the_scan_catches_a_spelled_key(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text('KEY = "tolk.cache"\nOTHER = "tolk.faithful.extra"\nLOG = "tolk.kafka"\n')
    assert spelled_keys(bad, tmp_path) == ["bad.py:1 tolk.cache", "bad.py:2 tolk.faithful.extra"]
