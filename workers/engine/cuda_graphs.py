"""Decode steps as CUDA graphs: one graph per batch-size bucket, replayed with static buffers.

On a GPU a small model's decode step is launch-bound: ~20 kernel launches per layer per step,
each a few microseconds of host work, against well under a millisecond of weight reads for
the whole model. A CUDA graph replays every launch of a step from one host call. Graphs need
fixed shapes and fixed addresses, so:

- **Buckets.** A decode-only step of `n` sequences runs the graph of the smallest bucket
  `>= n` (`DEFAULT_BUCKETS`, up to the engine's `max_num_seqs`); rows `n..bucket-1` are
  padding. Larger steps, prefill and mixed steps stay eager (their shapes vary every step;
  prefill is compute-bound anyway, and a newcomer's prefill is a one-off per request).
- **Static buffers.** A step's inputs are token ids, positions and one block table per KV
  group. `StepLayout` packs them into one int32 vector: on the host (pinned memory, filled with
  numpy, no per-element Python work past the real rows' tables) and on the device (the graph's
  input, viewed as `StaticInputs`), so a step costs one host-to-device copy. Tables are padded
  to `max_blocks = ceil(max_model_len / block_size)` columns with the null block 0; padding
  rows get token 0, position 0 and an all-null table, so they write their K/V into slot 0 of
  the null block (which every real row masks) and read only it.
- **In the graph.** Everything else derives from those buffers on the device: sequence
  lengths (position + 1), slot mappings (`table[pos // bs] * bs + pos % bs`), and either the
  Triton kernels' `PagedDecodeBatch` (`workers/engine/triton_swaps.py` swapped in: the decode
  kernel reads `seq_lens` on the device, so one graph serves every context length) or, without
  the kernels, the reference path's `DecodeBatch` over all `max_blocks` blocks with a mask
  (correct, but it gathers the whole `max_model_len` per row: the kernels are what makes graphs
  pay). Then the model's forward, the logits and their argmax: greedy selection on the device.
- **One host sync per step.** The engine copies the packed inputs (non-blocking, pinned),
  replays, and reads back the `[n]` argmax (`TokenSampler.sample` calls `.tolist()` once).
  Sampled (temperature > 0) rows read their logits row too.

The pure bookkeeping (`choose_bucket`, `StepLayout.pack`, `StepLayout.views`,
`paged_batches`, `reference_batches`) runs on any device and is tested on the CPU
(tests/engine/test_cuda_graphs.py); `CudaGraphDecode` needs CUDA. Captures happen lazily at a
bucket's first step, or all at once in `warm_up` (largest first, sharing one memory pool).
A graph bakes in the addresses of the KV pools bound at capture: the engine captures with its
own pools bound, and its graphs only ever write those.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch
from torch import Tensor

from kernels.attention import DecodeBatch
from workers.engine.model import Transformer

log = logging.getLogger(__name__)

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def choose_bucket(batch_size: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket >= batch_size (buckets sorted ascending); None if none fits."""
    if batch_size <= 0:
        return None
    i = bisect.bisect_left(buckets, batch_size)
    return buckets[i] if i < len(buckets) else None


@dataclass(frozen=True, slots=True)
class StaticInputs:
    """Views of one packed int32 buffer: a step's inputs at fixed addresses."""

    token_ids: Tensor  # [bucket] int32
    positions: Tensor  # [bucket] int32: 0-based position of each row's new token
    block_tables: dict[str, Tensor]  # per KV group [bucket, max_blocks] int32, 0 = null block


@dataclass(frozen=True, slots=True)
class StepLayout:
    """Where a decode step's inputs sit in one int32 vector: ids, positions, then one
    `[bucket, max_blocks]` table per KV group (in `groups` order)."""

    bucket: int  # rows, padding included
    max_blocks: int  # table columns
    groups: tuple[str, ...]  # KV groups ("full", "sliding")

    @property
    def size(self) -> int:
        return self.bucket * (2 + len(self.groups) * self.max_blocks)

    def views(self, buffer: Tensor) -> StaticInputs:
        """The inputs as views of `buffer` (int32, `size` elements): host or device alike."""
        b, m = self.bucket, self.max_blocks
        tables = {
            group: buffer[2 * b + i * b * m : 2 * b + (i + 1) * b * m].view(b, m)
            for i, group in enumerate(self.groups)
        }
        return StaticInputs(buffer[:b], buffer[b : 2 * b], tables)

    def pack(
        self,
        token_ids: Sequence[int],
        positions: Sequence[int],
        block_tables: Mapping[str, Sequence[Sequence[int]]],
        buffer: Tensor,
    ) -> bool:
        """Write one step's inputs into `buffer` (a CPU int32 tensor of `size`), padding rows
        and columns with 0 (token 0, position 0, the null block). False, with the buffer
        unspecified, when the step does not fit: more rows than the bucket, or a row whose
        position lies past `max_blocks` blocks (that step runs eagerly)."""
        n = len(token_ids)
        if n > self.bucket or len(positions) != n:
            return False
        flat = cast(np.ndarray, buffer.numpy())
        b, m = self.bucket, self.max_blocks
        flat[:] = 0
        flat[:n] = token_ids
        flat[b : b + n] = positions
        for i, group in enumerate(self.groups):
            rows = block_tables[group]
            if len(rows) != n:
                raise ValueError(f"group {group!r}: {len(rows)} tables for {n} rows")
            table = flat[2 * b + i * b * m : 2 * b + (i + 1) * b * m].reshape(b, m)
            for row, blocks in enumerate(rows):
                kept = blocks[:m]  # blocks past max_blocks lie past max_model_len: never read
                table[row, : len(kept)] = kept
        return True

    def fits_positions(self, positions: Sequence[int], block_size: int) -> bool:
        """Whether every position's block lies inside the table's `max_blocks` columns."""
        return all(p // block_size < self.max_blocks for p in positions)


def paged_batches(
    inputs: StaticInputs, block_size: int, num_splits: int
) -> dict[str, Any]:  # dict[str, PagedDecodeBatch]; Any keeps triton out of the import
    """The Triton kernels' metadata per KV group, computed from the static buffers with
    device ops (inside the graph): seq_lens = position + 1, slot = table[pos // bs] * bs +
    pos % bs (padding rows: slot 0, the null block's first)."""
    from kernels.triton_attention import PagedDecodeBatch  # imports triton: CUDA engines only

    pos = inputs.positions.long()
    seq_lens = inputs.positions + 1
    out = {}
    for group, table in inputs.block_tables.items():
        blocks = table.gather(1, (pos // block_size)[:, None])[:, 0].long()
        out[group] = PagedDecodeBatch(table, seq_lens, blocks * block_size + pos % block_size,
                                      num_splits)  # fmt: skip
    return out


def reference_batches(
    inputs: StaticInputs, block_size: int, windows: Mapping[str, int | None]
) -> dict[str, DecodeBatch]:
    """The reference path's `DecodeBatch` per KV group from the static buffers: every row reads
    all `max_blocks` blocks of its table, masked to the positions its query sees."""
    pos = inputs.positions.long()
    out = {}
    for group, table in inputs.block_tables.items():
        width = table.shape[1] * block_size
        seen = torch.arange(width, device=table.device)[None, :]  # [1, L] absolute positions
        valid = seen <= pos[:, None]
        window = windows[group]
        if window is not None:
            valid &= seen > pos[:, None] - window
        blocks = table.gather(1, (pos // block_size)[:, None])[:, 0].long()
        out[group] = DecodeBatch(blocks, pos % block_size, table.long(), valid)
    return out


@dataclass(eq=False)
class _Captured:
    layout: StepLayout
    host: Tensor  # pinned int32 [size]: filled by `pack`
    staging: Tensor  # device int32 [size]: the graph's input
    copied: torch.cuda.Event  # the last host -> device copy finished (host may be refilled)
    graph: torch.cuda.CUDAGraph
    logits: Tensor  # [bucket, V] float32, the graph's output
    greedy: Tensor  # [bucket] long


class CudaGraphDecode:
    """Decode-only steps through captured CUDA graphs (one per bucket); see the module doc.

    Called with what `workers.engine.compiled.CompiledDecode` takes (python ids, positions and
    tables); (logits [n, V] float32, argmax [n]) out, both views of the graph's static
    outputs, valid until the next call. Returns None for a step that does not fit (run it
    eagerly)."""

    def __init__(
        self,
        model: Transformer,
        block_size: int,
        max_model_len: int,
        buckets: Sequence[int] = DEFAULT_BUCKETS,
        max_batch: int | None = None,
        use_triton: bool = True,
    ) -> None:
        device = model.embed.weight.device
        if device.type != "cuda":
            raise RuntimeError("CUDA graphs need the model on a CUDA device")
        if use_triton:
            from workers.engine.triton_swaps import uses_triton_kernels

            if not uses_triton_kernels(model):
                raise ValueError("use_triton needs the Triton swap (apply_triton_kernels) first")
        self.model = model
        self.device = device
        self.block_size = block_size
        self.use_triton = use_triton
        self.max_blocks = -(-max_model_len // block_size)
        limit = max_batch if max_batch is not None else max(buckets)
        self.buckets = sorted(b for b in set(buckets) if 0 < b <= limit)
        if not self.buckets:
            raise ValueError(f"no bucket <= max_batch {limit}: {list(buckets)}")
        self.groups = tuple(model.config.kv_groups)
        self.windows: dict[str, int | None] = {
            g: model.config.sliding_window if g == "sliding" else None for g in self.groups
        }
        self._graphs: dict[int, _Captured] = {}
        self._pool: Any = None  # one memory pool for every bucket's graph

    def applies(self, batch_size: int) -> bool:
        return choose_bucket(batch_size, self.buckets) is not None

    def _num_splits(self, bucket: int) -> int:
        from kernels.triton_attention import default_num_splits

        kvh = self.model.config.num_kv_heads
        return default_num_splits(bucket, kvh, self.max_blocks * self.block_size, self.device)

    def _forward(self, inputs: StaticInputs, num_splits: int) -> tuple[Tensor, Tensor]:
        if self.use_triton:
            batches = paged_batches(inputs, self.block_size, num_splits)
        else:
            batches = reference_batches(inputs, self.block_size, self.windows)
        hidden = self.model(inputs.token_ids.long(), inputs.positions.long(), batches)
        logits = self.model.compute_logits(hidden)  # [bucket, V] float32
        return logits, logits.argmax(dim=-1)

    def capture(self, bucket: int) -> _Captured:
        """Capture the graph of one bucket (with the engine's KV pools bound)."""
        layout = StepLayout(bucket, self.max_blocks, self.groups)
        host = torch.zeros(layout.size, dtype=torch.int32).pin_memory()
        staging = torch.zeros(layout.size, dtype=torch.int32, device=self.device)
        inputs = layout.views(staging)  # all padding: the warm-up writes only the null block
        splits = self._num_splits(bucket)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # Triton's JIT, cuBLAS handles: before the capture
            for _ in range(2):
                self._forward(inputs, splits)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits, greedy = self._forward(inputs, splits)
        captured = _Captured(layout, host, staging, torch.cuda.Event(), graph, logits, greedy)
        captured.copied.record()
        self._graphs[bucket] = captured
        return captured

    def __call__(
        self,
        token_ids: Sequence[int],
        positions: Sequence[int],
        block_tables: Mapping[str, Sequence[Sequence[int]]],
    ) -> tuple[Tensor, Tensor] | None:
        bucket = choose_bucket(len(token_ids), self.buckets)
        if bucket is None:
            return None
        captured = self._graphs.get(bucket) or self.capture(bucket)
        if not captured.layout.fits_positions(positions, self.block_size):
            return None
        captured.copied.synchronize()  # the last copy out of the pinned buffer is done
        if not captured.layout.pack(token_ids, positions, block_tables, captured.host):
            return None
        captured.staging.copy_(captured.host, non_blocking=True)
        captured.copied.record()
        captured.graph.replay()
        n = len(token_ids)
        return captured.logits[:n], captured.greedy[:n]

    def warm_up(self, buckets: Sequence[int] | None = None) -> float:
        """Capture these buckets' graphs now (default: all), largest first; returns seconds."""
        t0 = time.perf_counter()
        with torch.inference_mode():
            for bucket in sorted(buckets or self.buckets, reverse=True):
                if bucket not in self._graphs:
                    self.capture(bucket)
        seconds = time.perf_counter() - t0
        log.info("captured decode graphs for buckets %s in %.1fs", self.buckets, seconds)
        return seconds
