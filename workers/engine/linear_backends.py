"""Float32 CPU projections through the fastest correct GEMM of the machine, chosen by a probe.

Why a probe: torch's `F.linear` on the CPU calls MKL's sgemm, and MKL picks its code path by CPU
vendor. On an Intel Xeon it runs its AVX-512 kernels, and its packed GEMM (`cblas_sgemm_pack`)
is 2-4x faster than the plain one at 4-48 rows. On an AMD EPYC (Zen 4, AVX-512 too) MKL reports
"Intel(R) Architecture processors" in `MKL_VERBOSE` and runs a generic path; oneDNN's JIT GEMM
picks its code by CPU *features* and runs AVX-512 on both vendors. Measured single-threaded on
an EPYC (Zen 4): 576x1536 at 1 row, MKL 109 us vs oneDNN 73 us; at 8 rows 300 vs 189 us. Which
backend wins depends on the CPU, the weight's shape and the row count, so nothing is assumed:

- `BACKENDS`: `aten` (`F.linear`, MKL sgemm), `mkl-packed` (MKL's packed GEMM on a weight
  packed once; torch's `mkl::_mkl_linear`, any row count, see below) and `onednn-packed`
  (oneDNN's inner product on a weight reordered once; `mkldnn::_linear_pointwise`, the op
  inductor uses when it freezes a CPU graph). Each returns `F.linear`'s result up to float32
  rounding.
- `probe_shape(n, k)`: for each row bucket (`ROW_BUCKETS`: 1-3, 4-15, 16-63 and 64+ rows,
  timed at 1, 8, 32 and 128 rows), every available backend is first checked against `F.linear`
  on random input (a backend that differs beyond float32 rounding is dropped for that shape)
  and then timed: `ROUNDS` interleaved rounds, the minimum per backend (the least disturbed by
  a busy machine). The fastest wins unless it beats `aten` by less than `MIN_GAIN`, so a
  packed copy is kept only where it pays. One probe per distinct shape per process (a model's
  30 layers share 4-5 shapes), ~0.1-0.5 s each; with `use_disk_cache(path)` (the engine sets
  it under its cache root) the choices persist, keyed by the CPU and torch, and a later process
  reads them instead of probing.
- `ProbedLinear`: one projection with its per-bucket choice; it keeps only the packed copies its
  choices use. Inside `torch.compile` it is plain `F.linear` (inductor packs weights its own way).

MKL's packed buffer does not depend on the packing size hint (it packs by N and K), so each call
passes its own row count; MKL documents the buffer for the hint only, which is why the
correctness check covers several row counts (`CHECK_ROWS`). `choices()` reports what was picked,
for the benchmark JSON and the worker's start-up log line.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from workers.engine.disk_cache import cpu_fingerprint, read_record, record_key, write_record

log = logging.getLogger(__name__)

BACKENDS = ("aten", "mkl-packed", "onednn-packed")
ROW_BUCKETS: tuple[tuple[int, int], ...] = ((1, 1), (4, 8), (16, 32), (64, 128))  # (from, timed)
CHECK_ROWS = (1, 3, 4, 7, 16, 33, 100)
ROUNDS = 7
MIN_GAIN = 0.05  # a packed backend must be this much faster than aten to be kept
PACK_HINT = 32

Kernel = Callable[[Tensor], Tensor]  # [M, K] -> [M, N]


def available_backends() -> tuple[str, ...]:
    out = ["aten"]
    if torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear"):
        out.append("mkl-packed")
    if torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        out.append("onednn-packed")
    return tuple(out)


def make_kernel(backend: str, weight: Tensor) -> Kernel:
    """The projection `x [M, K] -> x @ weight.T [M, N]` through `backend` (weight packed now)."""
    if backend == "aten":
        return lambda x: F.linear(x, weight)
    if backend == "mkl-packed":
        packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, PACK_HINT)
        return lambda x: torch.ops.mkl._mkl_linear(x, packed, weight, None, x.shape[0])
    if backend == "onednn-packed":
        reordered = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_HINT)
        return lambda x: torch.ops.mkldnn._linear_pointwise(x, reordered, None, "none", [], "")
    raise ValueError(f"unknown linear backend {backend!r}; known: {', '.join(BACKENDS)}")


@dataclass(frozen=True, slots=True)
class ShapeChoice:
    """The backend per row bucket for one weight shape, and what the probe measured."""

    shape: tuple[int, int]  # (N, K)
    picks: tuple[str, ...]  # one backend per ROW_BUCKETS entry
    micros: dict[str, tuple[float, ...]]  # backend -> min time per bucket (us); inf = rejected

    def backend_for(self, rows: int) -> str:
        pick = self.picks[0]
        for (start, _), name in zip(ROW_BUCKETS, self.picks, strict=True):
            if rows >= start:
                pick = name
        return pick


_probed: dict[tuple[int, int], ShapeChoice] = {}
_probe_lock = threading.Lock()
_disk: Path | None = None  # where probed choices persist across processes (use_disk_cache)


def use_disk_cache(path: Path | None) -> None:
    """Keep the probes' choices in a keyed record at `path` (`disk_cache.write_record`): a later
    process on the same CPU (model name, flags, core count) and torch reads a shape's choice
    instead of probing it again. None: probe in every process."""
    global _disk
    _disk = path


def _disk_key() -> str:
    return record_key(cpu=cpu_fingerprint(), torch=torch.__version__, backends=available_backends())


def _stored(key: tuple[int, int]) -> ShapeChoice | None:
    if _disk is None:
        return None
    entry = (read_record(_disk, _disk_key()) or {}).get(f"{key[0]}x{key[1]}")
    if not isinstance(entry, dict):
        return None
    try:
        micros = {b: tuple(float(t) for t in ts) for b, ts in entry["micros"].items()}
        picks = tuple(str(p) for p in entry["picks"])
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
    if len(picks) != len(ROW_BUCKETS) or not set(picks) <= set(available_backends()):
        return None
    return ShapeChoice(key, picks, micros)


def _store(choice: ShapeChoice) -> None:
    if _disk is None:
        return
    key = _disk_key()
    table = read_record(_disk, key) or {}
    n, k = choice.shape
    table[f"{n}x{k}"] = {"picks": list(choice.picks), "micros": choice.micros}
    write_record(_disk, key, table)


def _matches(got: Tensor, x: Tensor, weight: Tensor) -> bool:
    want = F.linear(x, weight)
    scale = float(F.linear(x.abs(), weight.abs()).max())  # the size float32 rounding scales with
    return bool(torch.allclose(got, want, rtol=0.0, atol=1e-5 * max(scale, 1e-30)))


def probe_shape(n: int, k: int, backends: tuple[str, ...] | None = None) -> ShapeChoice:
    """Check and time every backend for a [n, k] weight (random, same shape); cached."""
    key = (n, k)
    with _probe_lock:
        if key in _probed and backends is None:
            return _probed[key]
        stored = _stored(key) if backends is None else None
        if stored is not None:  # probed by an earlier process on this CPU and torch
            _probed[key] = stored
            return stored
        gen = torch.Generator().manual_seed(n * 131 + k)
        weight = torch.randn(n, k, generator=gen) / k**0.5
        kernels: dict[str, Kernel] = {}
        for name in backends or available_backends():
            try:
                kernel = make_kernel(name, weight)
                ok = all(
                    _matches(kernel(x), x, weight)
                    for x in (torch.randn(m, k, generator=gen) for m in CHECK_ROWS)
                )
            except RuntimeError as exc:  # an op missing from this build of torch
                log.info("linear backend %s unavailable for %s: %s", name, key, exc)
                continue
            if ok:
                kernels[name] = kernel
            else:
                log.warning("linear backend %s differs from F.linear on %s: not used", name, key)
        micros = _time(kernels, k, gen)
        picks: list[str] = []
        for b in range(len(ROW_BUCKETS)):
            times = {name: ts[b] for name, ts in micros.items()}
            best = min(times, key=times.__getitem__)
            aten = times.get("aten", float("inf"))
            picks.append(best if times[best] < aten * (1 - MIN_GAIN) else "aten")
        choice = ShapeChoice(key, tuple(picks), micros)
        if backends is None:
            _probed[key] = choice
            _store(choice)
        return choice


def _time(kernels: dict[str, Kernel], k: int, gen: torch.Generator) -> dict[str, tuple[float, ...]]:
    """Per backend and bucket, the minimum over ROUNDS of the mean time of a few calls (us).

    The backends take turns within each round, so a busy moment of the machine hits them alike."""
    best = {name: [float("inf")] * len(ROW_BUCKETS) for name in kernels}
    for b, (_, m) in enumerate(ROW_BUCKETS):
        x = torch.randn(m, k, generator=gen)
        calls = max(2, 32 // m)
        for _ in range(ROUNDS):
            for name, kernel in kernels.items():
                kernel(x)  # warm the caches with this kernel's buffers
                t0 = time.perf_counter()
                for _ in range(calls):
                    kernel(x)
                best[name][b] = min(best[name][b], (time.perf_counter() - t0) / calls * 1e6)
    return {name: tuple(ts) for name, ts in best.items()}


def choices() -> dict[str, dict[str, object]]:
    """What the probes of this process picked, by "NxK" (for logs and benchmark JSON)."""
    out: dict[str, dict[str, object]] = {}
    for (n, k), c in sorted(_probed.items()):
        out[f"{n}x{k}"] = {
            "picks": {
                f"{start}+ rows": p for (start, _), p in zip(ROW_BUCKETS, c.picks, strict=True)
            },
            "min_us": {b: [round(t, 1) for t in ts] for b, ts in c.micros.items()},
        }
    return out


def summary() -> str:
    """One line of what was picked: `960x576: onednn-packed,onednn-packed,aten,aten; ...`."""
    return "; ".join(f"{n}x{k}: {','.join(c.picks)}" for (n, k), c in sorted(_probed.items()))


class ProbedLinear(nn.Module):
    """`F.linear` (no bias) through the backend the shape's probe picked for each row count."""

    weight: Tensor

    def __init__(self, linear: nn.Linear, choice: ShapeChoice | None = None) -> None:
        super().__init__()
        assert linear.bias is None, "the model's projections have no bias"
        w = linear.weight.detach()
        self.in_features: int = linear.in_features
        self.out_features: int = linear.out_features
        self.register_buffer("weight", w)
        self.choice: ShapeChoice = choice or probe_shape(*w.shape)
        # packed copies are plain attributes (not buffers): opaque oneDNN tensors do not belong
        # in a state dict, and they are rebuilt from `weight` whenever the module is made
        self._kernels: dict[str, Kernel] = {
            name: make_kernel(name, w) for name in sorted(set(self.choice.picks))
        }

    def forward(self, x: Tensor) -> Tensor:
        if torch.compiler.is_compiling():  # inductor packs the weight its own way
            return F.linear(x, self.weight)
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])  # [M, K]
        y = self._kernels[self.choice.backend_for(x2.shape[0])](x2)  # [M, N]
        return y.reshape(*shape[:-1], self.out_features)


def probed_linears_available() -> bool:
    return len(available_backends()) > 1
