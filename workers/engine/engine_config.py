"""What an engine is asked to be (`EngineConfig`) and what it counts as it runs (`EngineStats`).

`EngineConfig` is one frozen record read once at the edge (the CLI, a benchmark, a test) and
handed down: the model to load and how to prepare it (`preparation`: the speed swaps of
`workers/engine/swaps.py`, applied once per loaded model by `workers/engine/prepare.py`), the
KV cache's shape, the scheduler's limits and the defaults of a translation. `EngineStats` is
the engine's running tally of steps, tokens and batch sizes, written only by the thread that
steps the engine.

Both are re-exported by `workers.engine.engine`, where callers import them with `Engine`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from workers.engine.prepare import Preparation


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str = "gemma3-270m"  # preset name, .gguf path or HF checkpoint directory
    dtype: str | None = None  # "float32" / "bfloat16"; None = float32 on CPU, bf16 on CUDA
    device: str = "cpu"
    quantize: str | None = None  # None, "int8" or "int4" (weight-only, workers/engine/swaps.py)
    # decode-only steps of <= compile_max_batch sequences through torch.compile (compiled.py);
    # two graphs compiled at start-up: ~3 min the first time, then from inductor's disk cache.
    # The graph is dynamic in the batch size, so a larger limit costs no compilation; compiled
    # steps beat eager ones at every batch size measured (8-32, docs/BENCHMARKS.md)
    compile_decode: bool = False
    compile_max_batch: int = 32
    # prefill and mixed steps of <= compile_max_rows tokens through the same graph, one row per
    # token (compiled.py; 0: eager); larger steps (a long prompt's chunks) stay eager
    compile_max_rows: int = 64
    # compile those graphs on a background thread while the engine serves eagerly (the worker:
    # it consumes at once and gets faster when they are ready); False: before serving
    compile_in_background: bool = False
    # free the engine thread's OpenMP pool each time it runs out of work: for a second engine
    # of the process (the cascade's large model), whose idle pool would otherwise hold threads
    # beyond the CPUs and throttle the busy engine's parallel ops (workers/engine/threads.py)
    release_pool_when_idle: bool = False
    # CUDA only, ignored elsewhere: the Triton kernels swapped into the model
    # (workers/engine/triton_swaps.py), and decode-only steps of up to max_num_seqs sequences
    # replayed as CUDA graphs per batch-size bucket (workers/engine/cuda_graphs.py; with
    # triton_kernels the graphs run the Triton decode kernel, else the reference ops)
    triton_kernels: bool = False
    cuda_graphs: bool = False
    pack_weights: bool = True  # CPU float32: projections via the probed fastest GEMM (swaps.py)
    # CPU: greedy tokens from a cheaper copy of the LM head: a float32 head's argmax from an
    # int8 copy and a rigorous bound (kernels/greedy_head.py), an int8 head's from an int4 copy
    # and a 6-sigma margin (kernels/int8_head_screen.py)
    screen_lm_head: bool = True
    # q/k/v as one projection and gate/up as one, bit-identical (workers/engine/swaps.py)
    fuse_projections: bool = True
    # speculative decoding of greedy requests (workers/engine/speculative.py): "ngram" drafts
    # from the prompt and the output so far (prompt lookup), at most draft_max tokens a step;
    # None: one token a step. Greedy output is the same either way
    draft: str | None = None
    draft_max: int = 8
    block_size: int = 16  # tokens per KV block
    kv_cache_tokens: int = 16384  # KV pool size per group, in tokens
    max_num_seqs: int = 32  # running batch cap (`tolk worker`: from its probe, batch_cap.py)
    max_num_batched_tokens: int = 512  # per-step token budget (decode + prefill chunks)
    max_model_len: int = 2048
    enable_prefix_caching: bool = True
    share_partial_blocks: bool = True  # prefix hits may end inside a block (copied slots)
    max_new_tokens: int = 256  # default cap of a translation's output
    # prompts.json form of every translation prompt (None: the template's default_form); a
    # request may name another (Engine.translation_request(prompt_form=))
    prompt_form: str | None = None
    warm_languages: tuple[str, ...] = ()  # prompt prefixes computed at start-up
    # True: those prefixes are the loop's first work once `start()` runs, not computed before
    # `from_config` returns (the worker: consuming, and joining its group, meanwhile; /readyz
    # names the languages still cold)
    warm_in_background: bool = False
    model_version: str = ""  # the A/B arm name on replies; default: model name
    # what is computed once per machine (dequantized weights, inductor's caches, the C++ ops'
    # build): workers/engine/disk_cache.py; None: TOLK_CACHE_DIR or ~/.cache/tolk
    cache_dir: str | None = None

    @property
    def preparation(self) -> Preparation:
        """The model preparation this engine needs (workers/engine/prepare.py)."""
        return Preparation(
            fuse_projections=self.fuse_projections,
            quantize=self.quantize,
            pack_weights=self.pack_weights,
            screen_lm_head=self.screen_lm_head,
        )


@dataclass(slots=True)
class EngineStats:
    steps: int = 0
    prefill_tokens: int = 0  # computed prompt tokens (cache hits excluded)
    decode_tokens: int = 0  # sampled tokens
    finished: int = 0
    preemptions: int = 0
    last_batch_size: int = 0
    step_seconds: float = 0.0  # total time inside model steps
    compiled_steps: int = 0  # decode steps run by the compiled graph (compile_decode)
    compiled_rows_steps: int = 0  # prefill / mixed steps run by it (compile_max_rows)
    graph_steps: int = 0  # decode steps replayed as a CUDA graph (cuda_graphs)
    screened_steps: int = 0  # steps whose greedy tokens came from the screened LM head
    draft_steps: int = 0  # steps that checked draft tokens (speculative decoding)
    draft_tokens: int = 0  # draft tokens checked
    accepted_draft_tokens: int = 0  # of those, the ones the target agreed with
    batch_sizes: list[int] = field(default_factory=list)  # recent decode batch sizes (bounded)
    # decode-only steps (no prefill row, no draft; not the eager ones served while a compiled
    # configuration's graphs build) by batch size: (steps, seconds), cumulative;
    # the tuner compares the served speed with the probe's (workers/engine/tuner.py)
    decode_by_batch: dict[int, tuple[int, float]] = field(default_factory=dict)
    # model steps and their seconds by kind ("decode", "mixed", "prefill": step_results.py's
    # `step_kind`): where a request's time goes under load (a decode-only step runs compiled,
    # the other kinds eagerly)
    steps_by_kind: dict[str, int] = field(default_factory=dict)
    seconds_by_kind: dict[str, float] = field(default_factory=dict)
