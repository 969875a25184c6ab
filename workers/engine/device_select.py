"""Which device and which GPU path a worker runs (`tolk worker --device`), checked at start.

`tolk worker --device auto|cpu|cuda` (default `auto`) with `--triton-kernels/--no-triton-kernels`
and `--cuda-graphs/--no-cuda-graphs` (both on by default) becomes one `EngineConfig` here, in
three steps, each one logged with its reason:

1. **Device** (`choose_device`). `cpu`: the CPU. `auto`: CUDA when it is usable (torch sees a
   device and a first small operation on it succeeds, `cuda_problem`), else the CPU, saying
   why. `cuda`: CUDA, and when it is absent or unusable `DeviceUnavailable` (the CLI prints it
   and exits 2): an operator who asked for the GPU gets a worker that refuses to start, not one
   with a fiftieth of the capacity planned for; `--device auto` is the way to ask for the
   fallback.
2. **Plan** (`plan`). On CUDA, the Triton kernels (workers/engine/triton_swaps.py) unless
   `--no-triton-kernels` or triton cannot be imported (`triton_problem`), and decode steps as
   CUDA graphs (workers/engine/cuda_graphs.py) unless `--no-cuda-graphs`. On the CPU both are
   off (the engine ignores them there anyway).
3. **Check** (`check_fast_path`, then `apply_check`). On the loaded model, before the worker's
   engine exists: a short greedy decode (`CHECK_NEW_TOKENS` tokens of three prompts: a
   translation prompt when the tokenizer has one, and two fixed id sequences, one crossing a
   KV block) by the eager engine, the reference, then by an engine with the Triton kernels,
   then by one with CUDA graphs (and the kernels, if they passed). A part passes when every
   prompt gives the eager tokens, or first differs where the eager logits were a near-tie: the
   token it took scores within `atol + rtol * max|logit|` of the eager argmax (`TOLERANCES`,
   per dtype; bfloat16 reorders sums, so exact ties break either way). A part that differs
   beyond that, raises, or does not run at all (no step replayed as a graph) is turned off,
   with a WARNING naming the part and why, and the worker runs the eager path for it. The
   swap is undone on the model when the kernels fail (it changes module classes in place).

`select_engine_config` runs the three with the probes, the loader and the check injected, so
the selection and every fallback are tested on the CPU with fakes (tests/engine/
test_device_select.py); the check itself runs on the CPU too, comparing the eager engine with
the Triton kernels under Triton's interpreter (tests/kernels/test_triton_device_select.py).
A CUDA error that poisons the context (an illegal address) cannot be recovered in-process: the
worker then fails its start and `--no-triton-kernels` / `--no-cuda-graphs` are the way round.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from workers.engine.engine_config import EngineConfig
from workers.engine.loader import LoadedModel
from workers.engine.sampling import TokenSampler
from workers.engine.types import GenerationRequest, SamplingParams

log = logging.getLogger(__name__)

DEVICES = ("auto", "cpu", "cuda")
CHECK_NEW_TOKENS = 16
CHECK_TEXT = "Thank you for your patience, your order will arrive on Monday."
# (atol, rtol) of the logit gap allowed where the fast path takes another token than the eager
# path: only a near-tie of the eager logits may break the other way
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-3, 1e-4),
    torch.bfloat16: (5e-2, 1e-2),
    torch.float16: (1e-2, 2e-3),
}


class DeviceUnavailable(RuntimeError):
    """`--device cuda` was asked for and CUDA is absent or unusable."""


@dataclass(frozen=True, slots=True)
class GpuOptions:
    """What the command line asked for."""

    device: str = "auto"  # auto | cpu | cuda
    triton_kernels: bool = True  # on CUDA: the Triton kernels, unless the check fails
    cuda_graphs: bool = True  # on CUDA: decode steps as CUDA graphs, unless the check fails


@dataclass(frozen=True, slots=True)
class CheckResult:
    """The start-up check: None for a part that passed or was not asked, else why it failed."""

    kernels: str | None = None
    graphs: str | None = None
    summary: str = ""  # what was compared, in how long


@dataclass(frozen=True, slots=True)
class Selection:
    config: EngineConfig
    notes: tuple[str, ...] = ()  # one log line each: what was chosen and why
    fallbacks: tuple[str, ...] = ()  # one WARNING each: a part turned off by the check

    @property
    def fast_parts(self) -> tuple[str, ...]:
        c = self.config
        return tuple(n for n, on in (("triton_kernels", c.triton_kernels),
                                     ("cuda_graphs", c.cuda_graphs)) if on)  # fmt: skip


def cuda_problem() -> str | None:
    """None when CUDA is usable here (a device, and a first small operation runs), else why."""
    if not torch.cuda.is_available():
        return (
            f"torch {torch.__version__} sees no CUDA device (built for CUDA {torch.version.cuda})"
        )
    try:
        x = torch.arange(8, dtype=torch.float32, device="cuda")
        if float((x * 2).sum().item()) != 56.0:
            return "a first CUDA operation gave a wrong result"
    except Exception as exc:  # driver mismatch, no kernel image for this GPU, out of memory
        return f"a first CUDA operation failed: {type(exc).__name__}: {exc}"
    return None


def triton_problem() -> str | None:
    """None when the Triton kernels can be imported, else why not."""
    try:
        import triton  # noqa: F401

        import workers.engine.triton_swaps  # noqa: F401
    except Exception as exc:
        return f"triton cannot be imported: {type(exc).__name__}: {exc}"
    return None


def choose_device(asked: str, cuda_trouble: str | None) -> tuple[str, str]:
    """(device, why) for `--device asked`; `cuda_trouble`: `cuda_problem()`'s answer."""
    if asked not in DEVICES:
        raise ValueError(f"--device must be one of {', '.join(DEVICES)}, not {asked!r}")
    if asked == "cpu":
        return "cpu", "device cpu (asked)"
    if cuda_trouble is None:
        return "cuda", "device cuda (" + ("asked" if asked == "cuda" else "auto: CUDA usable") + ")"
    if asked == "cuda":
        raise DeviceUnavailable(
            f"--device cuda, but CUDA is not usable here: {cuda_trouble} "
            "(--device auto falls back to the CPU)"
        )
    return "cpu", f"device cpu (auto: no usable CUDA: {cuda_trouble})"


def plan(
    base: EngineConfig,
    options: GpuOptions,
    *,
    cuda_trouble: str | None,
    triton_trouble: str | None,
) -> Selection:
    """The device and the fast path to try, before the check."""
    device, why = choose_device(options.device, cuda_trouble)
    if device != "cuda":
        config = dataclasses.replace(base, device=device, triton_kernels=False, cuda_graphs=False)
        return Selection(config, (why,))
    kernels = options.triton_kernels and triton_trouble is None
    notes, fallbacks = [why], []
    if not options.triton_kernels:
        notes.append("Triton kernels off (--no-triton-kernels)")
    elif triton_trouble is not None:
        fallbacks.append(f"Triton kernels OFF, eager ops instead: {triton_trouble}")
    else:
        notes.append("Triton kernels on, to be checked")
    graphs = options.cuda_graphs
    notes.append("CUDA graphs " + ("on, to be checked" if graphs else "off (--no-cuda-graphs)"))
    config = dataclasses.replace(base, device="cuda", triton_kernels=kernels, cuda_graphs=graphs)
    return Selection(config, tuple(notes), tuple(fallbacks))


def apply_check(selection: Selection, result: CheckResult) -> Selection:
    """Turn off each part the check failed, with the reason as a fallback line."""
    config, fallbacks = selection.config, list(selection.fallbacks)
    if config.triton_kernels and result.kernels is not None:
        config = dataclasses.replace(config, triton_kernels=False)
        fallbacks.append(f"Triton kernels OFF, eager ops instead: check failed: {result.kernels}")
    if config.cuda_graphs and result.graphs is not None:
        config = dataclasses.replace(config, cuda_graphs=False)
        fallbacks.append(f"CUDA graphs OFF, eager decode steps: check failed: {result.graphs}")
    notes = selection.notes + ((result.summary,) if result.summary else ())
    return Selection(config, notes, tuple(fallbacks))


Loader = Callable[[EngineConfig], LoadedModel]
Checker = Callable[[LoadedModel, EngineConfig], CheckResult]


def load_for(config: EngineConfig) -> LoadedModel:
    from workers.engine import disk_cache
    from workers.engine.loader import load_model

    dtype = getattr(torch, config.dtype) if config.dtype else None
    weights = disk_cache.cache_root(config.cache_dir) / "weights"
    return load_model(config.model, dtype=dtype, device=config.device, cache_dir=weights)


def select_engine_config(
    base: EngineConfig,
    options: GpuOptions,
    *,
    probe_cuda: Callable[[], str | None] = cuda_problem,
    probe_triton: Callable[[], str | None] = triton_problem,
    load: Loader = load_for,
    check: Checker | None = None,
) -> tuple[Selection, LoadedModel | None]:
    """The worker's engine config, every choice logged. On CUDA with a fast part on, the model
    is loaded here and checked (`check`, default `check_fast_path`); the loaded model comes
    back for the engine (None: the engine loads it, as on the CPU). Raises DeviceUnavailable."""
    cuda_trouble = probe_cuda() if options.device != "cpu" else "not asked"
    wants_kernels = options.triton_kernels and options.device != "cpu"
    selection = plan(
        base,
        options,
        cuda_trouble=cuda_trouble,
        triton_trouble=probe_triton() if wants_kernels and cuda_trouble is None else None,
    )
    loaded = None
    if selection.fast_parts:
        loaded = load(selection.config)
        selection = apply_check(selection, (check or check_fast_path)(loaded, selection.config))
    for note in selection.notes:
        log.info("device selection: %s", note)
    for line in selection.fallbacks:
        log.warning("device selection: %s", line)
    c = selection.config
    log.info(
        "device selection: running on %s, Triton kernels %s, CUDA graphs %s",
        c.device, "on" if c.triton_kernels else "off", "on" if c.cuda_graphs else "off",
    )  # fmt: skip
    return selection, loaded


# -- the check --------------------------------------------------------------------------------


class _LogitRecorder(TokenSampler):
    """The reference engine's sampler: full logits for every step (no screened head), each
    sampled row's logits kept per request."""

    def __init__(self, model: Any) -> None:
        super().__init__(model, None)
        self.logits: dict[str, list[torch.Tensor]] = {}

    def sample(self, seqs: Any, logits: torch.Tensor, greedy: torch.Tensor | None = None) -> Any:
        for row, seq in enumerate(seqs):
            self.logits.setdefault(seq.request_id, []).append(logits[row].float().cpu())
        return super().sample(seqs, logits, greedy)


def check_prompts(engine: Any, vocab_size: int) -> list[list[int]]:
    """A translation prompt (when the tokenizer builds one) and two fixed id sequences."""
    prompts: list[list[int]] = []
    languages = sorted(getattr(engine, "languages", ()) or ())
    if languages:
        target = "de" if "de" in languages else languages[0]
        source = "en" if target != "en" else "de"
        try:
            prompts.append(engine.translation_request(CHECK_TEXT, source, target).prompt_ids)
        except Exception as exc:  # a model without this prompt template
            log.debug("no translation prompt for the check: %s", exc)
    for n in (5, 21):
        prompts.append([(i * 7919 + 13) % vocab_size for i in range(n)])
    return prompts


def greedy_tokens(
    engine: Any, prompts: Sequence[Sequence[int]], new_tokens: int
) -> list[list[int]]:
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True, stop_at_newline=False)
    reqs = [GenerationRequest(f"check-{i}", list(p), params) for i, p in enumerate(prompts)]
    return [r.token_ids for r in engine.generate(reqs)]


def compare(
    want: Sequence[Sequence[int]],
    want_logits: Sequence[Sequence[torch.Tensor]],
    got: Sequence[Sequence[int]],
    tolerance: tuple[float, float],
) -> tuple[str | None, int]:
    """(why the fast tokens fail, None if they pass; how many prompts diverged at a near-tie)."""
    atol, rtol = tolerance
    ties = 0
    for p, (w, g) in enumerate(zip(want, got, strict=True)):
        if len(w) != len(g):
            return f"prompt {p}: {len(g)} tokens where the eager path gives {len(w)}", ties
        i = next((i for i, (a, b) in enumerate(zip(w, g, strict=True)) if a != b), None)
        if i is None:
            continue
        row = want_logits[p][i]
        gap = float(row[w[i]] - row[g[i]])
        tol = atol + rtol * float(row.abs().max())
        if not gap <= tol:  # NaN fails too
            return (
                f"prompt {p}, token {i}: {g[i]} where the eager path gives {w[i]} "
                f"(eager logit gap {gap:.3g} > tolerance {tol:.3g})"
            ), ties
        ties += 1
    return None, ties


def check_fast_path(
    loaded: LoadedModel,
    config: EngineConfig,
    *,
    new_tokens: int = CHECK_NEW_TOKENS,
    prompts: Sequence[Sequence[int]] | None = None,
) -> CheckResult:
    """Greedy tokens of the eager engine vs the Triton kernels, then vs CUDA graphs (with the
    kernels if they passed), on `loaded` (see the module docstring). Small engines of their own
    (KV pool, batch cap 4); the swap stays on the model when the kernels pass."""
    from workers.engine.engine import Engine

    t0 = time.perf_counter()
    small = dataclasses.replace(
        config, kv_cache_tokens=1024, max_num_seqs=4, warm_languages=(), compile_decode=False,
        triton_kernels=False, cuda_graphs=False,
    )  # fmt: skip
    dtype = next(loaded.model.parameters()).dtype
    tolerance = TOLERANCES.get(dtype, TOLERANCES[torch.bfloat16])
    eager = Engine(loaded, small)
    recorder = _LogitRecorder(eager.model)
    eager.use_sampler(recorder)
    prompts = (
        list(prompts) if prompts is not None else check_prompts(eager, loaded.config.vocab_size)
    )
    want = greedy_tokens(eager, prompts, new_tokens)
    want_logits = [recorder.logits[f"check-{i}"] for i in range(len(prompts))]
    del eager
    ties = 0

    def run(part: str, cfg: EngineConfig, prepare: Callable[[], None]) -> str | None:
        nonlocal ties
        engine = None
        try:
            prepare()
            engine = Engine(loaded, cfg)
            got = greedy_tokens(engine, prompts, new_tokens)
            if part == "graphs" and engine.stats.graph_steps == 0:
                return f"no decode step ran as a CUDA graph (device {engine.device})"
            why, n = compare(want, want_logits, got, tolerance)
            ties += n
            return why
        except Exception as exc:
            return f"raised {type(exc).__name__}: {exc}"
        finally:
            del engine
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    kernels_why = graphs_why = None
    kernels = config.triton_kernels
    if kernels:
        kernels_why = run("kernels", dataclasses.replace(small, triton_kernels=True), _swap(loaded))
        if kernels_why is not None:
            _unswap(loaded)
            kernels = False
    if config.cuda_graphs:
        cfg = dataclasses.replace(small, triton_kernels=kernels, cuda_graphs=True)
        graphs_why = run("graphs", cfg, lambda: None)
    parts = [p for p, on in (("Triton kernels", config.triton_kernels),
                             ("CUDA graphs", config.cuda_graphs)) if on]  # fmt: skip
    summary = (
        f"checked {' and '.join(parts)} against the eager path: {len(prompts)} prompts x "
        f"{new_tokens} greedy tokens, {ties} near-tie divergence(s), "
        f"{time.perf_counter() - t0:.1f} s"
    )
    return CheckResult(kernels_why, graphs_why, summary)


def _swap(loaded: LoadedModel) -> Callable[[], None]:
    def apply() -> None:
        from workers.engine.triton_swaps import apply_triton_kernels, uses_triton_kernels

        apply_triton_kernels(loaded.model)  # raises off CUDA (outside Triton's interpreter)
        if not uses_triton_kernels(loaded.model):
            raise RuntimeError("the Triton swap left no Triton attention in the model")

    return apply


def _unswap(loaded: LoadedModel) -> None:
    try:
        from workers.engine.triton_swaps import remove_triton_kernels
    except ImportError:  # triton absent: nothing was swapped
        return
    remove_triton_kernels(loaded.model)
