"""Settings that make `torch.compile` start fast: what a compile costs beyond the graphs.

Measured on an Intel Xeon (2 cores, 2026-12-03), SmolLM2 with two decode graphs, both from
inductor's disk cache: 63 s before these settings, 31 s with `specialize_float`, 14 s with the
SIMD probe's answers kept on disk as well (docs/BENCHMARKS.md). Two costs:

- **Traced twice.** Left to its default (`specialize_float=False`), dynamo traces the model's
  float attributes (RMSNorm eps, scales) as symbolic floats; inductor's pass that turns them
  into tensors gives up and dynamo traces the whole model again ("Restarting analysis due to
  ... tensorify_python_scalars"). They are constants: `specialize_float=True` bakes them in.
- **SIMD levels probed per process.** Inductor checks each vector ISA the CPU reports
  (AVX-512 with VNNI, AVX-512 with BF16, AVX2, ...) by building a test library (cached) and
  loading it in a fresh `python -c "import torch ..."`: six subprocesses, ~15 s, in every
  process that compiles, even when every graph is cached. `remember_isa_probes()` wraps the
  check so that its answer is kept per machine under the cache root's `probes/` (disk_cache.py),
  keyed by torch version, CPU fingerprint, compiler flags and test code: the first process on
  a machine probes as before, later ones read the answer. Only a passed probe is kept: a
  failed one (that level not used, as before) is probed again by the next process, so a
  passing failure (a full disk, say) does not lose the level for good.

`configure_compiler()` applies both; `CompiledDecode` calls it before its first compile.
Private torch attributes are looked up defensively: a torch without them keeps its defaults.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from workers.engine import disk_cache

log = logging.getLogger(__name__)

_ORIGINAL_CHECK = "_tolk_original_check_build"
_probe_dir: Path | None = None  # where the answers are kept (use_disk_cache); None: the default


def use_disk_cache(directory: Path) -> None:
    """Keep the SIMD probe's answers under `directory` (`Engine.from_config`: the configured
    cache root's `probes/`, as the linear backends' records); unset, the default root's."""
    global _probe_dir
    _probe_dir = directory


def configure_compiler() -> None:
    """Both settings of the module docstring; idempotent."""
    torch._dynamo.config.specialize_float = True
    remember_isa_probes()


def remember_isa_probes() -> bool:
    """Wrap inductor's `VecISA.check_build` with an on-disk memo; False if this torch has none."""
    try:
        from torch._inductor import cpu_vec_isa
    except ImportError:  # a torch without inductor: nothing compiles
        return False
    vec_isa = getattr(cpu_vec_isa, "VecISA", None)
    check = getattr(vec_isa, "check_build", None)
    if vec_isa is None or check is None:
        return False
    if getattr(vec_isa, _ORIGINAL_CHECK, None) is not None:
        return True  # wrapped already
    setattr(vec_isa, _ORIGINAL_CHECK, check)
    vec_isa.check_build = _remembered(check)
    return True


def _remembered(check: Callable[[Any, str], bool]) -> Callable[[Any, str], bool]:
    def check_build(self: Any, code: str) -> bool:
        flags = str(getattr(self, "_arch_flags", ""))
        code_hash = hashlib.sha256(code.encode()).hexdigest()[:16]
        key = disk_cache.record_key(
            torch=torch.__version__, cpu=disk_cache.cpu_fingerprint(), flags=flags, code=code_hash
        )
        name = hashlib.sha256(key.encode()).hexdigest()[:16]
        directory = _probe_dir if _probe_dir is not None else disk_cache.cache_root() / "probes"
        path = directory / f"inductor-isa-{name}.json"
        if disk_cache.read_record(path, key) is True:
            return True
        result = bool(check(self, code))
        if result:  # a failure is probed again next time (it may have been passing trouble)
            try:
                disk_cache.write_record(path, key, True)
            except OSError as exc:  # a read-only cache: probe again next time
                log.warning("could not keep the SIMD probe's answer in %s: %s", path, exc)
        return result

    return check_build
