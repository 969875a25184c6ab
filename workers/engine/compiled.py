"""Compiled decode steps: the model's forward for decode-only batches through `torch.compile`.

A decode step at small batch runs ~45 small ops per layer; in eager mode each costs a dispatch,
which for SmolLM2 at batch 1 costs more than reading the weights. `CompiledDecode` traces the
same `Transformer.forward` (no second model) for steps in which every sequence adds one token,
with `kernels.attention.DecodeBatch` as the attention metadata: tensors only, so one graph with
dynamic batch and context sizes serves every such step (dynamo specializes size 1, so batch 1
gets a graph of its own: two compilations, ~40-80 s on two cores at start-up, `warm_up`; later
processes reuse inductor's on-disk cache). Inductor fuses norms, RoPE and residuals into C++
loops and, on the CPU, emits a C++ wrapper; projections and attention are extern calls (MKL
for float32, `tolk::int8_linear` for int8 weights, `tolk::decode_attention`). The graph ends at
the final norm of the rows that sample: the engine's sampler takes them as it takes an eager
step's (`workers/engine/sampling.py`), so greedy rows go through the LM head's screen (an int4
copy of an int8 head, an int8 copy of a float32 one) instead of the full head in the graph.

SmolLM2-135M, batch 1, 2 cores (tokens/s in bench/engine.py): eager float32 27.8, compiled
float32 40.2, compiled with int8 weights ~100 (docs/BENCHMARKS.md).

`warm_up` compiles at start-up before the engine serves (benchmarks, tests); the worker calls
`warm_up_in_background` instead (`EngineConfig.compile_in_background`): it serves every step
eagerly until the graphs are ready, then decode steps switch to them.

The engine uses it for decode-only steps of at most `max_batch` sequences (`EngineConfig.
compile_decode`, `compile_max_batch`), and for prefill and mixed steps of at most `max_rows`
tokens (`compile_max_rows`): a prefill chunk of n tokens is n rows at consecutive positions with
the chunk's block table, and since every row's K/V is written before any row attends and a row
at position p sees positions <= p, the rows attend causally as a prefill does; hidden rows
are gathered only for the rows that sample (`sample_rows`: one per sampling chunk), so a
12-token prefill pays the LM head once. Such steps had run eagerly (Gemma 3 270M int8, a warm
query's prefill on an Intel Xeon, 2 cores, bench/prefill_steps.py: 15 tokens 82 ms eager, 53
compiled; 32 tokens 111 / 100; 54 tokens 173 / 153). They take graphs of their own (dynamo
specializes one sampled row), so warm-up compiles four: decode at batch 1 and at a
dynamic batch, a prefill chunk, a mixed step. Longer steps (a long prompt's 512-token chunks),
where per-row attention would re-read the context per token, and larger decode batches, stay
eager. The eager path's cascade attention reads a shared language prefix once, but at
batch 12-32 the compiled step was still faster (Gemma 3 270M int8, AMD EPYC Zen 4: 57 vs 80
ms at 12, 64 vs 101 at 16, 149 vs 156 at 32), so the limit defaults to the whole batch.
Results are the same function up to float rounding (inductor sums reductions in another
order), so greedy tokens can differ from eager ones only at near-ties;
tests/engine/test_compiled.py checks them against transformers (tiny Llama and Gemma 3) and
the eager engine (SmolLM2's real weights).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import Tensor

from kernels import cpu_ops
from kernels.attention import DecodeBatch
from workers.engine.inductor_setup import configure_compiler
from workers.engine.model import Transformer
from workers.engine.threads import release_openmp_pool

log = logging.getLogger(__name__)


MAX_GRAPHS = 64  # compiled decode graphs one process may hold (see CompiledDecode.__init__)

_BACKGROUND: set[threading.Thread] = set()  # warm-ups under way in this process


def pin_fake_cuda_guard() -> bool:
    """Make the main thread own torch's stand-in CUDA device guard, before any tracing.

    torch's CUDA builds on a machine without a GPU: every `FakeTensorMode` entry (dynamo traces
    under it) calls `ensureCUDADeviceGuardSet`, which stores a guard held in a *thread-local*
    into the *process-wide* registry, unless the registered one reports devices. When the
    thread that stored it exits (our background compile thread, `tolk-compile`), the registry
    points at freed memory, and the next trace on any other thread calls into it: SIGSEGV in
    `FakeTensorMode.__enter__` (seen in CI twice, `tests/engine/test_prepare.py`; a worker that
    compiled in the background and recompiled later on its engine thread would die the same
    way). Called on the main thread first, the guard stored is the main thread's, which lives
    as long as the process, and later calls on other threads leave it in place. Returns
    whether it ran (main thread only; a no-op on machines with a GPU or CPU-only builds)."""
    if threading.current_thread() is not threading.main_thread():
        return False
    torch._C._ensureCUDADeviceGuardSet()
    return True


pin_fake_cuda_guard()  # at import, normally on the main thread (before any compile thread)


def background_compile_running() -> bool:
    """Whether a `warm_up_in_background` compilation is still under way in this process.

    A process must not run its normal interpreter exit then: the compiling thread is inside
    torch's C++ and the exit's static destructors abort the process ("terminate called without
    an active exception", SIGABRT; seen when a worker was stopped during its first minutes).
    The worker exits with `os._exit` instead once its Kafka work is done (workers/cli.py)."""
    return any(t.is_alive() for t in _BACKGROUND)


class CompiledDecode:
    """The model's decode step, compiled; called with python lists, returns the sampling rows'
    final hidden states."""

    def __init__(
        self, model: Transformer, block_size: int, max_batch: int = 8, max_rows: int = 0
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.max_batch = max_batch
        self.max_rows = max_rows  # prefill / mixed steps of up to this many tokens (0: none)
        self.windows: dict[str, int | None] = {
            group: model.config.sliding_window if group == "sliding" else None
            for group in model.config.kv_groups
        }
        on_cpu = model.embed.weight.device.type == "cpu"
        pin_fake_cuda_guard()  # again, if this module was first imported off the main thread
        if on_cpu:
            cpu_ops.load()  # tolk::decode_attention (and int8_linear), before any tracing
        # CPU: inductor's C++ wrapper calls the kernels without a Python frame per op (its
        # Python wrapper cost ~1.2 of ~10.5 ms per batch-1 SmolLM2 step, shape checks mostly)
        # dynamo caches graphs per code object, so every CompiledDecode of the process (one per
        # engine; ~2 graphs each) counts against one limit, 8 by default: a process that builds
        # a fifth compiled engine (tests, benchmarks, several models) would hit it and, with
        # fullgraph, fail. Room for 32 engines.
        configure_compiler()  # constants for floats, the SIMD probe kept on disk
        dynamo_config = torch._dynamo.config
        dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, MAX_GRAPHS)
        # whether decode steps may take the compiled path: True (compiled lazily on the first
        # call, or by warm_up) unless a background warm-up is under way, during which every step
        # stays eager (a plain attribute, read by the engine thread, set by the warm-up's)
        self.ready = True
        self.rows_ready = max_rows > 0  # the same for prefill / mixed steps (their own graphs)
        self.background: threading.Thread | None = None
        self._fn: Callable[..., Tensor] = torch.compile(
            self._forward, dynamic=True, fullgraph=True, options={"cpp_wrapper": on_cpu}
        )

    def _forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        batches: dict[str, DecodeBatch],
        sample_rows: Tensor,
    ) -> Tensor:
        hidden = self.model(input_ids, positions, dict(batches))  # [T, D]
        return hidden.index_select(0, sample_rows)  # [S, D]: only the rows that sample

    def applies(self, batch_size: int) -> bool:
        """Whether a decode-only step of this many sequences runs compiled (once compiled)."""
        return self.ready and 0 < batch_size <= self.max_batch

    def applies_rows(self, num_tokens: int) -> bool:
        """Whether a prefill or mixed step of this many tokens in all runs compiled."""
        return self.rows_ready and 0 < num_tokens <= self.max_rows

    def __call__(
        self,
        token_ids: Sequence[int],
        positions: Sequence[int],
        block_tables: Mapping[str, Sequence[Sequence[int]]],
        sample_rows: Sequence[int] | None = None,
    ) -> Tensor:
        """One token per row: ids, 0-based positions, each row's block table per KV group ->
        the final hidden states [S, D] of the rows `sample_rows` (default: every row), as
        `model(...)` gives them (`model.compute_logits` of them: the logits).

        A row is one token of a sequence: a decode step has one row per sequence, a prefill
        chunk of n tokens n rows with the same table at consecutive positions. Every row's K/V
        is written before any row attends (`model.Attention`), and the row at position p sees
        positions <= p, so a chunk's rows attend causally as a prefill does."""
        device = self.model.embed.weight.device
        batches = {
            group: DecodeBatch.build(
                positions, tables, self.block_size, self.windows[group], device
            )
            for group, tables in block_tables.items()
        }
        ids = torch.tensor(list(token_ids), dtype=torch.long, device=device)
        pos = torch.tensor(list(positions), dtype=torch.long, device=device)
        rows = range(len(ids)) if sample_rows is None else sample_rows
        picked = torch.tensor(list(rows), dtype=torch.long, device=device)
        for attempt in (1, 2):
            try:
                return self._fn(ids, pos, batches, picked)
            except torch._dynamo.exc.BackendCompilerFailed:
                # inductor's code generation can fail on a graph it compiles fine another time
                # (torch 2.11's C++ wrapper keys its array declarations by the id() of a bound
                # method, which the allocator reuses: "int_array_86 was not declared", seen in
                # CI): compile once more, then serve eagerly rather than fail the step's requests
                log.exception("compiling a decode graph failed (attempt %d of 2)", attempt)
        log.error("compiled decode turned off: this engine's steps stay eager")
        self.ready = self.rows_ready = False
        return self._forward(ids, pos, batches, picked)

    def warm_up(self, batch_sizes: Sequence[int] = (1, 2)) -> float:
        """Compile now, not at the first request: the decode graphs for these batch sizes, then
        (with `max_rows`) a prefill chunk's and a mixed step's, writing only the null block 0;
        returns the seconds it took."""
        t0 = time.perf_counter()
        with torch.inference_mode():
            for b in batch_sizes:
                tables = {group: [[0]] * b for group in self.windows}
                self([0] * b, [0] * b, tables)
            self.ready = True
            if self.max_rows > 0:
                # rows sample one (a prefill chunk) or some (a mixed step); sizes all distinct,
                # as dynamo gives equal sizes at tracing one symbol (and a guard)
                for rows, samples in ((5, [4]), (7, [2, 5, 6])):
                    null_table = [0] * (rows // self.block_size + 1)  # positions 0..rows-1
                    tables = {group: [null_table] * rows for group in self.windows}
                    self([0] * rows, list(range(rows)), tables, samples)
                self.rows_ready = True
        seconds = time.perf_counter() - t0
        log.info(
            "compiled decode graphs for batch sizes %s%s in %.1fs",
            list(batch_sizes),
            " and prefill / mixed steps" if self.rows_ready else "",
            seconds,
        )
        return seconds

    def warm_up_in_background(self, batch_sizes: Sequence[int] = (1, 2)) -> threading.Thread:
        """`warm_up` on a thread of its own: the engine serves eagerly meanwhile and takes the
        compiled path from the first step after `ready` (a start that consumes at once and gets
        faster, instead of one that waits for the compiler).

        The warm-up forward writes only the null block 0 of the pools bound to the model, which
        no request reads unmasked, so it does not take the prepared model's lock (holding it
        would stall the engine for the whole compilation); the model's forward keeps no state.
        Dynamo's frame hook and the dispatch modes of tracing are per thread, so the engine
        thread's eager steps are not traced. A failed compilation leaves the engine eager."""

        def run() -> None:
            try:
                self.warm_up(batch_sizes)  # sets ready
            except Exception:  # the eager path still serves: say so, do not crash the worker
                log.exception("compiling decode graphs failed: decode stays eager")
            finally:
                release_openmp_pool()  # this thread's OpenMP pool (workers/engine/threads.py)

        log.info(
            "compiling decode graphs in the background (batch sizes %s): serving eagerly until "
            "they are ready (minutes the first time on a machine, less from the disk cache)",
            list(batch_sizes),
        )
        self.ready = False  # eager until run() has compiled the graphs
        self.rows_ready = False
        self.background = threading.Thread(target=run, name="tolk-compile", daemon=True)
        _BACKGROUND.add(self.background)
        self.background.start()
        return self.background
