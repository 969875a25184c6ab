"""tolk's C++ CPU ops (`kernels/cpu/*.cpp`), built on first use and loaded as `torch.ops.tolk`.

- `tolk::int8_linear(x, w, scales, exact_float32=False)`: see `kernels/int8_linear.py`.
- `tolk::int4_linear(x, w, scales, mins)` (and `int4_linear_plain`, its portable float32 loop;
  `int4_linear_vector_loop()`, whether this build runs a vector loop): see `kernels/int4_linear.py`.
- `tolk::decode_attention(q, k_cache, v_cache, blocks, valid, scale, softcap=None)`: see
  `kernels/attention.py` (`decode_attention`).
- `tolk::screened_argmax(x, approx, weight, act, wt, softcap=None)`: see
  `kernels/greedy_head.py` (`greedy_tokens`).
- `tolk::int4_screen_union(x, approx, act, wt)`: see `kernels/int8_head_screen.py`
  (`screened_int8_argmax`; called eagerly only, so it has no fake).

`load()` compiles every source into one library with `torch.utils.cpp_extension.load` (a C++
compiler and `ninja` are needed; cached under `$TORCH_EXTENSIONS_DIR`, by default
~/.cache/torch_extensions, and rebuilt when a source changes), with `-march=native` since it is
built on the machine that runs it. The sources are compiled as one translation unit
(`unity_source`: the headers they include once at file scope, then each source inside a
namespace of its own, so their helpers' names never meet): g++ spends ~14 s parsing ATen's
headers per unit, so four units cost ~63 s of CPU on a 2-vCPU AMD EPYC (38 s wall on both
cores, beside the model's conversion on a first start) and one unit ~20 s on one core. Each op
a graph may call gets a fake (meta) implementation, so `torch.compile` graphs call it as one
extern kernel. When the build fails (no toolchain), `load()` returns False once, logs why, and
callers use their torch reference. `LOADED` is a plain module global so that compiled graphs
read it as a constant. This module is a leaf: it imports torch only.

A build killed halfway (a worker SIGKILLed while compiling, a test timeout) leaves torch's
build marker, the file `lock` in the build directory, behind; torch then waits for it to go
forever, and every later start on the host hangs without a word. So the build runs under an
`flock` of our own (`build.flock` beside it, released by the kernel when its holder dies): a
`lock` found while holding that flock belongs to a dead build and is removed with a warning.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import re
import threading
from pathlib import Path

import torch
from torch import Tensor

log = logging.getLogger(__name__)

SOURCES = sorted((Path(__file__).parent / "cpu").glob("*.cpp"))
EXTENSION_NAME = "tolk_cpu_kernels"
TORCH_BATON = "lock"  # torch.utils.file_baton's marker in the build directory
FLOCK_NAME = "build.flock"
_SYSTEM_INCLUDE = re.compile(r"^\s*#\s*include\s*<([^>]+)>", re.MULTILINE)
LOADED = False
_lock = threading.Lock()
_tried = False
_error: str | None = None


def load() -> bool:
    """Build (first time) and load the ops; thread-safe, tried once per process."""
    global LOADED, _tried, _error
    with _lock:
        if _tried:
            return LOADED
        _tried = True
        try:
            from torch.utils import cpp_extension

            build_dir = Path(cpp_extension._get_build_directory(EXTENSION_NAME, False))
            with BuildFlock(build_dir):
                cpp_extension.load(
                    name=EXTENSION_NAME,
                    sources=[str(unity_source(build_dir))],
                    extra_cflags=["-O3", "-march=native", "-fopenmp"],
                    extra_ldflags=["-fopenmp"],
                    is_python_module=False,
                    verbose=False,
                    build_directory=str(build_dir),
                )
            _register_fakes()
            LOADED = True
        except Exception as exc:  # no compiler, no ninja, unsupported platform
            _error = f"{type(exc).__name__}: {exc}"
            log.warning("tolk C++ CPU ops unavailable, using the torch references: %s", exc)
        return LOADED


class BuildFlock:
    """Hold `build_dir/build.flock` exclusively; clear a dead build's torch marker under it."""

    def __init__(self, build_dir: Path) -> None:
        self.build_dir = build_dir
        self._fd: int | None = None

    def __enter__(self) -> BuildFlock:
        self.build_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.build_dir / FLOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)  # waits for a live build of another process
        self._fd = fd
        baton = self.build_dir / TORCH_BATON
        if baton.exists():  # every live builder holds the flock: this one's builder is dead
            log.warning("removing %s left by a build that did not finish", baton)
            baton.unlink(missing_ok=True)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def unity_source(build_dir: Path) -> Path:
    """`build_dir/tolk_cpu_unity.cpp`: every source as one translation unit (see the module
    notes), written only when its text changes (torch rebuilds when a source's text does;
    the sources' digest in its first line makes a changed kernel a changed unit)."""
    headers: list[str] = []
    for path in SOURCES:
        for match in _SYSTEM_INCLUDE.finditer(path.read_text()):
            if match.group(1) not in headers:
                headers.append(match.group(1))
    lines = [f"// generated by kernels/cpu_ops.py from kernels/cpu/*.cpp ({sources_digest()})"]
    for header in headers:  # before the namespaces: inside them, each include is a no-op
        lines += [f"#if __has_include(<{header}>)", f"#include <{header}>", "#endif"]
    for path in SOURCES:
        lines += [
            f"namespace tolk_unity_{path.stem} {{",
            f'#include "{path.resolve()}"',
            f"}}  // namespace tolk_unity_{path.stem}",
        ]
    text = "\n".join(lines) + "\n"
    unity = build_dir / "tolk_cpu_unity.cpp"
    build_dir.mkdir(parents=True, exist_ok=True)
    if not unity.exists() or unity.read_text() != text:
        unity.write_text(text)
    return unity


def sources_digest() -> str:
    """A short hash of the C++ sources: what a measurement of the ops' speed depends on (the
    worker's start-up probe keys its record by it, so a changed kernel is measured again)."""
    digest = hashlib.sha256()
    for path in SOURCES:
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux names them (/proc/cpuinfo: "avx2", "avx512f", ...);
    empty where that file is not. What `-march=native` will compile the ops for, known before
    they are built (the first build takes ~20 s on a machine never seen)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def error() -> str | None:
    """Why the ops are not in use (None when they are, or were never tried)."""
    return _error


def _register_fakes() -> None:
    @torch.library.register_fake("tolk::int8_linear")
    def _int8_linear(x: Tensor, w: Tensor, scales: Tensor, exact_float32: bool = False) -> Tensor:
        return x.new_empty((*x.shape[:-1], w.shape[0]))

    @torch.library.register_fake("tolk::int4_linear")
    def _int4_linear(x: Tensor, w: Tensor, scales: Tensor, mins: Tensor) -> Tensor:
        return x.new_empty((*x.shape[:-1], w.shape[0]))

    @torch.library.register_fake("tolk::decode_attention")
    def _decode_attention(
        q: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        blocks: Tensor,
        valid: Tensor,
        scale: float,
        softcap: float | None = None,
    ) -> Tensor:
        return torch.empty_like(q)

    @torch.library.register_fake("tolk::screened_argmax")
    def _screened_argmax(
        x: Tensor,
        approx: Tensor,
        weight: Tensor,
        act: Tensor,
        wt: Tensor,
        softcap: float | None = None,
    ) -> Tensor:
        return x.new_empty((x.shape[0],), dtype=torch.long)
