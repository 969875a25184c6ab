"""What a worker computes once per machine and keeps on disk: one directory, keyed records.

A start of `tolk worker` does work whose result depends only on the machine, the model file and
the code: the GGUF dequantized to float32 safetensors (~80 s for Gemma 3 270M), the C++ ops
built (~20 s), the compiled decode graphs (inductor's FX graph and AOTAutograd caches, ~1-3 min),
the auto configuration's speed probe (`workers/engine/autoconfig.py`). All of it lives under one
root, so one `rm -rf` clears it (docs/OPERATIONS.md):

    root = TOLK_CACHE_DIR  >  $XDG_CACHE_HOME/tolk  >  ~/.cache/tolk
    root/weights/<gguf hash>/      dequantized checkpoints (workers/engine/loader.py)
    root/inductor/                 TORCHINDUCTOR_CACHE_DIR (FX graph + AOTAutograd caches)
    root/torch_extensions/         TORCH_EXTENSIONS_DIR (kernels/cpu_ops.py's build)
    root/probes/<name>.json        keyed JSON records (the auto configuration's probe,
                                   inductor's SIMD checks: inductor_setup.py)

A record is valid only for its key: `read_record(path, key)` returns None for a missing file,
another key (another CPU, model, torch or tolk version: the caller rebuilds and overwrites) or a
file that does not parse (logged as a warning, then rebuilt). Writes are atomic (a temporary
file renamed), so a crash or two workers starting together never leave half a record.

`configure_compile_caches(root)` points torch's own caches into the root; an operator's
TORCHINDUCTOR_CACHE_DIR / TORCH_EXTENSIONS_DIR are kept. It must run before the first compile
and before `kernels.cpu_ops.load()` (the CLI and `Engine.from_config` call it first).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import sys
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

ENV_ROOT = "TOLK_CACHE_DIR"


def tolk_version() -> str:
    try:
        return metadata.version("tolk")
    except metadata.PackageNotFoundError:
        return "dev"


def cache_root(override: str | os.PathLike[str] | None = None) -> Path:
    """`override`, else TOLK_CACHE_DIR, else $XDG_CACHE_HOME/tolk, else ~/.cache/tolk."""
    if override:
        return Path(override).expanduser()
    env = os.environ.get(ENV_ROOT)
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "tolk"


def configure_compile_caches(root: Path) -> None:
    """Inductor's FX graph and AOTAutograd caches on disk under `root/inductor`, the C++ ops'
    build under `root/torch_extensions` (unless the operator set either variable).

    The caches are switched on through the variables torch's configs read when first imported
    (importing `torch._inductor.config` here cost 2.6 s of a first start's path to consuming,
    for a compiler that runs later, in the background); a config already imported is set
    directly."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(root / "inductor"))
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(root / "torch_extensions"))
    os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
    os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "1")
    inductor_config: Any = sys.modules.get("torch._inductor.config")
    if inductor_config is not None:
        inductor_config.fx_graph_cache = True
    functorch_config: Any = sys.modules.get("torch._functorch.config")
    if functorch_config is not None:
        functorch_config.enable_autograd_cache = True


def cpu_fingerprint() -> str:
    """CPU model name and feature flags (Linux /proc/cpuinfo; the platform elsewhere), hashed
    with the core count: what a speed measurement is valid for."""
    model, flags = platform.processor() or platform.machine(), ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            if name.strip() == "model name" and model in ("", platform.machine(), "x86_64"):
                model = value.strip()
            elif name.strip() == "flags" and not flags:
                flags = value.strip()
    except OSError:
        pass
    digest = hashlib.sha256(f"{model}|{flags}|{os.cpu_count()}".encode()).hexdigest()[:16]
    return f"{model} [{os.cpu_count()} cpus, {digest}]"


def record_key(**parts: Any) -> str:
    """A stable key for a record: the parts as sorted JSON (readable in the file)."""
    return json.dumps(parts, sort_keys=True, default=str)


def read_record(path: Path, key: str) -> Any | None:
    """The value stored under `key` at `path`; None if missing, keyed otherwise, or corrupt
    (a warning: the caller rebuilds it)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.warning("cache record %s unreadable (%s): rebuilding it", path, exc)
        return None
    try:
        data = json.loads(text)
        stored_key, value = data["key"], data["value"]
    except (ValueError, KeyError, TypeError) as exc:
        log.warning("cache record %s is corrupt (%s): rebuilding it", path, exc)
        return None
    if stored_key != key:
        log.info("cache record %s was made for another key: rebuilding it", path)
        return None
    return value


def write_record(path: Path, key: str, value: Any) -> None:
    """Store `value` under `key` at `path`, atomically (temporary file, then rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"key": key, "value": value}, f, indent=1)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
