"""Model presets: part packages joined once, in order, and refused unless their bytes are the
pinned ones (fake part packages on sys.path); the real Qwen presets resolve to their checked
files (the `qwen` extra)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from workers.engine.presets import (
    PRESETS,
    QWEN25_CODER_05B,
    QWEN25_CODER_15B,
    PartsPreset,
    WeightHashMismatch,
)


def _fake_parts(root: Path, name: str, chunks: list[bytes]) -> None:
    """Packages `<name>1..N`, each with a `get_part_path()` to its slice, as the real ones."""
    for i, chunk in enumerate(chunks, 1):
        package = root / f"{name}{i}"
        (package / "data").mkdir(parents=True)
        (package / "data" / f"part{i:02d}.bin").write_bytes(chunk)
        (package / "__init__.py").write_text(
            "import os\n"
            "def get_part_path():\n"
            f"    return os.path.join(os.path.dirname(__file__), 'data', 'part{i:02d}.bin')\n"
        )


Parts = tuple[Path, list[bytes], str]  # (directory, the parts' bytes, their module prefix)


@pytest.fixture
def parts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Parts:
    chunks = [b"GGUF" + bytes(range(7)) * 3, b"second part", b"third and last part"]
    name = f"tolk_fake_parts_{tmp_path.name.replace('-', '_')}_part"
    _fake_parts(tmp_path / "site", name, chunks)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    return tmp_path, chunks, name


def _preset(name: str, chunks: list[bytes], sha256: str | None = None) -> PartsPreset:
    joined = b"".join(chunks)
    return PartsPreset(
        name="fake-model",
        module=name,
        count=len(chunks),
        size=len(joined),
        sha256=sha256 or hashlib.sha256(joined).hexdigest(),
    )


def test_parts_are_joined_in_order_once(parts: Parts) -> None:
    root, chunks, module = parts
    preset = _preset(module, chunks)
    path = preset.path(root / "models")
    assert path.read_bytes() == b"".join(chunks)
    assert path.name == f"fake-model-{preset.sha256[:12]}.gguf"
    stamp = path.stat().st_mtime_ns
    assert preset.path(root / "models") == path and path.stat().st_mtime_ns == stamp  # reused
    assert [p.name for p in (root / "models").iterdir()] == [path.name]  # no temporary left


def test_other_bytes_are_refused_naming_both_hashes(parts: Parts) -> None:
    root, chunks, module = parts
    pinned = "0" * 64
    preset = _preset(module, chunks, sha256=pinned)
    got = hashlib.sha256(b"".join(chunks)).hexdigest()
    with pytest.raises(WeightHashMismatch) as err:
        preset.path(root / "models")
    assert pinned in str(err.value) and got in str(err.value)
    assert list((root / "models").iterdir()) == []  # nothing kept under any name


def test_a_missing_part_package_names_the_package_and_the_extra(tmp_path: Path) -> None:
    preset = PartsPreset("absent", "tolk_no_such_parts_part", 2, 10, "0" * 64)
    with pytest.raises(FileNotFoundError, match=r"tolk-no-such-parts-part1.*\.\[qwen\]"):
        preset.path(tmp_path)


@pytest.mark.slow
def test_the_qwen_presets_resolve_to_their_checked_gguf() -> None:
    from gguf import GGUFReader

    from workers.engine.gguf_parse import one_gguf_parse

    for preset in (QWEN25_CODER_05B, QWEN25_CODER_15B):
        path = PRESETS[preset.name]()
        assert path == preset.target() and path.stat().st_size == preset.size
        with one_gguf_parse():  # the reader's own parse: a minute per file on a slow host
            fields = GGUFReader(path).fields
        arch = fields["general.architecture"]
        assert bytes(arch.parts[arch.data[0]]).decode() == "qwen2"
