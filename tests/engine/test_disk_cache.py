"""What a worker keeps on disk between starts: keyed records (the auto probe's), the dequantized
checkpoint cache of a GGUF, the cache root and torch's cache variables.

Each cache: a second load reads it (the build does not run again), a changed key rebuilds it, a
corrupt file is rebuilt with a warning."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from workers.engine import disk_cache, gguf_parse, loader
from workers.engine.disk_cache import cache_root, read_record, record_key, write_record


def test_root_is_the_override_then_env_then_xdg_then_home(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("TOLK_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "tolk"
    monkeypatch.setenv("TOLK_CACHE_DIR", str(tmp_path / "mine"))
    assert cache_root() == tmp_path / "mine"
    assert cache_root(tmp_path / "flag") == tmp_path / "flag"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.delenv("TOLK_CACHE_DIR")
    assert cache_root() == Path.home() / ".cache" / "tolk"


def test_settings_read_the_cache_dir() -> None:
    from workers.settings import Settings

    assert Settings.from_env({"TOLK_CACHE_DIR": "/srv/tolk-cache"}).cache_dir == "/srv/tolk-cache"
    assert Settings.from_env({}).cache_dir == ""


def test_compile_caches_point_into_the_root_unless_set(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import torch._inductor.config as inductor_config

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "/operator/choice")
    monkeypatch.setattr(inductor_config, "fx_graph_cache", False)
    for name in ("TORCHINDUCTOR_FX_GRAPH_CACHE", "TORCHINDUCTOR_AUTOGRAD_CACHE"):
        monkeypatch.delenv(name, raising=False)
    disk_cache.configure_compile_caches(tmp_path)
    import os

    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor")
    assert os.environ["TORCH_EXTENSIONS_DIR"] == "/operator/choice"
    assert inductor_config.fx_graph_cache is True  # imported already: set directly


def test_a_fresh_process_gets_the_caches_from_the_variables(tmp_path: Path) -> None:
    """Without importing inductor (2.6 s of a first start): the configs read the variables."""
    import os
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from workers.engine import disk_cache\n"
        f"disk_cache.configure_compile_caches(Path({str(tmp_path)!r}))\n"
        "assert 'torch._inductor.config' not in sys.modules\n"
        "import torch._inductor.config as i, torch._functorch.config as f\n"
        "print(i.fx_graph_cache, f.enable_autograd_cache)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHINDUCTOR")}
    env["TORCHINDUCTOR_FX_GRAPH_CACHE_DEFAULT"] = "0"  # the caches off unless we switch them on
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True"]


def test_record_is_read_back_for_its_key_only(tmp_path: Path) -> None:
    path = tmp_path / "probes" / "p.json"
    key = record_key(cpu="x", model="abc")
    assert read_record(path, key) is None  # missing: build it
    write_record(path, key, [{"tok_s": 12.5}])
    assert read_record(path, key) == [{"tok_s": 12.5}]
    assert read_record(path, record_key(cpu="y", model="abc")) is None  # another CPU: rebuild
    assert list(path.parent.iterdir()) == [path]  # no temporary file left behind


def test_corrupt_record_is_rebuilt_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "p.json"
    key = record_key(a=1)
    write_record(path, key, 1)
    path.write_text(path.read_text()[:10])  # truncated
    with caplog.at_level(logging.WARNING):
        assert read_record(path, key) is None
    assert "corrupt" in caplog.text
    write_record(path, key, 2)
    assert read_record(path, key) == 2


# -- the dequantized checkpoint cache of a GGUF (loader.checkpoint_dir) ----------------------------
@pytest.fixture
def fake_gguf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, list[Path]]:
    """A .gguf file and a stand-in for the (~80 s) conversion that counts its calls."""
    from safetensors.torch import save_file

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(range(200)))
    calls: list[Path] = []

    def convert(path: Path, target: Path, **_: object) -> None:
        calls.append(target)
        target.mkdir(parents=True)
        save_file({"w": torch.ones(4)}, str(target / "model.safetensors"))
        meta = {"cache_version": loader.CACHE_VERSION, "source_hash": target.name}
        (target / loader.TOLK_CONFIG).write_text(json.dumps(meta))

    monkeypatch.setattr(loader, "_convert_gguf", convert)
    return gguf, calls


def test_second_load_reads_the_converted_checkpoint(
    fake_gguf: tuple[Path, list[Path]], tmp_path: Path
) -> None:
    gguf, calls = fake_gguf
    first = loader.checkpoint_dir(str(gguf), tmp_path / "weights")
    second = loader.checkpoint_dir(str(gguf), tmp_path / "weights")
    assert first == second and len(calls) == 1


def test_changed_file_is_converted_again(
    fake_gguf: tuple[Path, list[Path]], tmp_path: Path
) -> None:
    gguf, calls = fake_gguf
    first = loader.checkpoint_dir(str(gguf), tmp_path / "weights")
    gguf.write_bytes(b"GGUF" + bytes(range(100)))  # another file: another key
    second = loader.checkpoint_dir(str(gguf), tmp_path / "weights")
    assert first != second and len(calls) == 2


def test_stale_layout_is_converted_again(
    fake_gguf: tuple[Path, list[Path]], tmp_path: Path
) -> None:
    gguf, calls = fake_gguf
    target = loader.checkpoint_dir(str(gguf), tmp_path / "weights")
    meta = json.loads((target / loader.TOLK_CONFIG).read_text())
    meta["cache_version"] = loader.CACHE_VERSION - 1
    (target / loader.TOLK_CONFIG).write_text(json.dumps(meta))
    assert loader.checkpoint_dir(str(gguf), tmp_path / "weights") == target
    assert len(calls) == 2


@pytest.mark.parametrize("damage", ["truncate_weights", "garble_meta"])
def test_corrupt_checkpoint_is_converted_again_with_a_warning(
    fake_gguf: tuple[Path, list[Path]],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    damage: str,
) -> None:
    gguf, calls = fake_gguf
    target = loader.checkpoint_dir(str(gguf), tmp_path / "weights")
    if damage == "truncate_weights":
        weights = target / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:-8])
    else:
        (target / loader.TOLK_CONFIG).write_text("{not json")
    with caplog.at_level(logging.WARNING):
        again = loader.checkpoint_dir(str(gguf), tmp_path / "weights")
    assert again == target and len(calls) == 2
    assert "corrupt" in caplog.text
    from safetensors import safe_open

    with safe_open(str(target / "model.safetensors"), framework="pt") as st:
        assert list(st.keys()) == ["w"]  # readable again


# -- the linear-backend probe's choices (linear_backends.use_disk_cache) ---------------------------
def test_linear_probe_choices_persist_per_cpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from workers.engine import linear_backends as lb

    monkeypatch.setattr(lb, "_probed", {})
    monkeypatch.setattr(lb, "ROUNDS", 1)
    lb.use_disk_cache(tmp_path / "linear_backends.json")
    try:
        first = lb.probe_shape(24, 16)
        monkeypatch.setattr(lb, "_probed", {})  # a new process

        def no_timing(*args: object) -> None:
            raise AssertionError("probed again although the choice is on disk")

        monkeypatch.setattr(lb, "_time", no_timing)
        again = lb.probe_shape(24, 16)
        assert again.picks == first.picks and again.shape == (24, 16)
        monkeypatch.setattr(lb, "_probed", {})
        monkeypatch.setattr(lb, "cpu_fingerprint", lambda: "another CPU")
        with pytest.raises(AssertionError, match="probed again"):
            lb.probe_shape(24, 16)  # another key: measured again
    finally:
        lb.use_disk_cache(None)


@pytest.mark.slow
def test_the_fast_conversion_writes_transformers_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The conversion parses the GGUF once, from memory (workers/engine/gguf_parse.py: 40 s ->
    10 s for Gemma 3 270M) and reads the weights without a transformers model
    (workers/engine/gguf_convert.py); what it writes is byte for byte what transformers' own
    model path with its repeated memmap parses writes (converted here both ways: ~50 s)."""
    import contextlib
    import filecmp

    import gguf

    _, path = loader.resolve_source("gemma3-270m")
    loader._convert_gguf(path, tmp_path / "fast")
    assert gguf.GGUFReader.__name__ == "GGUFReader"  # the patch is gone after the conversion
    monkeypatch.setattr(gguf_parse, "one_gguf_parse", contextlib.nullcontext)
    loader._convert_gguf(path, tmp_path / "transformers", via_transformers=True)
    names = sorted(p.name for p in (tmp_path / "transformers").iterdir())
    assert "model.safetensors" in names and "config.json" in names
    assert names == sorted(p.name for p in (tmp_path / "fast").iterdir())
    for name in names:
        if name != loader.TOLK_CONFIG:  # holds the target's name
            a, b = tmp_path / "transformers" / name, tmp_path / "fast" / name
            assert filecmp.cmp(a, b, shallow=False), name


def test_a_conversion_killed_halfway_is_cleaned_up_and_a_live_one_kept(
    tmp_path: Path, fake_gguf: tuple[Path, list[Path]], caplog: pytest.LogCaptureFixture
) -> None:
    import os
    import time

    gguf, calls = fake_gguf
    weights = tmp_path / "weights"
    target = weights / loader.file_hash(gguf)
    dead, alive = Path(f"{target}.tmpdead"), Path(f"{target}.tmpalive")
    for d in (dead, alive):
        d.mkdir(parents=True)
        (d / "model.safetensors").write_bytes(b"partial")
    old = time.time() - loader.STALE_CONVERSION_S - 60
    for p in (dead, dead / "model.safetensors"):
        os.utime(p, (old, old))
    with caplog.at_level(logging.WARNING):
        assert loader.checkpoint_dir(str(gguf), weights) == target
    assert calls == [target]
    assert not dead.exists() and alive.exists()  # another process's conversion, still writing
    assert "stopped halfway" in caplog.text
