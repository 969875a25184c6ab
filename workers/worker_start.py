"""`tolk worker` after its options are read: the engine chosen, built, wrapped and served.

`workers/cli.py` parses and checks the command line (log level, ports, device name, broker
reachable) and hands over a `WorkerPlan`; `run_worker` then

1. opens the TM index when retrieved examples are asked for (a bad one refuses the start);
2. resolves the weights and compiled decode (flags, else the auto configuration's cached
   probe, `workers/engine/autoprobe.py`; without one, the unmeasured choice, int8 eager,
   served at once while the tuner probes in the background, `workers/engine/tuner.py`), with
   the compile caches under the cache root, and the running batch's cap from the probe's
   speeds (`workers/engine/batch_cap.py`);
3. picks the engine for the device (`workers/engine/device_select.py`: the GPU path checked
   against the eager one) and builds the weighted fair engine over the languages' policies;
4. wraps it in the serving stages through the one builder (`workers/serving/pipeline.py`);
5. on the CPU with the auto configuration, starts the tuner (background probe when none is
   stored, the served speed checked against the probe's, a move without a restart);
6. runs the Kafka worker until it is stopped, and returns the process's exit code.

One concern, over 400 lines: the start-up above, its steps in the order they run (step 5's
wiring, `_start_tuner` and `after_switch`, included: what a switch changes is the start's own
choices, its cache variant and the pace's step).

A configuration that cannot start raises `StartRefused` (a message, the exit code, and the
option to blame when there is one) before any record is consumed. SIGTERM / SIGINT before the
worker consumes end the process by their default action (nothing consumed, nothing to drain);
from then on they stop intake and drain (`Worker.run`). Heavy imports stay inside
the function so that `tolk --help` answers at once.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from workers.engine.batch_cap import BatchCap

log = logging.getLogger(__name__)

BUILD_NICE = 10  # the C++ ops' background build yields to the start-up path (Linux nice)
WARM_WAIT_S = 120.0  # the tuner's first probe waits at most this long for the warm-up


class StartRefused(Exception):
    """The worker cannot start as configured (nothing was consumed)."""

    def __init__(self, message: str, code: int = 2, option: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.option = option  # the command-line option at fault, if one is


@dataclass(frozen=True)
class WorkerPlan:
    """What the command line asked for, checked (see `tolk worker --help` for each)."""

    device: str  # as asked: auto | cpu | cuda
    resolved_device: str  # what the device probe resolved it to
    triton_kernels: bool
    cuda_graphs: bool
    quantize: str | None  # None: the auto configuration's choice
    compile_decode: bool | None
    auto: bool
    tm_examples: int  # retrieved examples per prompt (0: none) from the TM in `tm_dir`
    tm_dir: Path
    faithful: bool
    faithful_policy: str
    protect_spans: bool
    cache: bool | None  # None: the settings' default (TOLK_CACHE)
    context: bool
    drill_latency: tuple[str, ...] = ()
    drill_errors: tuple[str, ...] = ()
    draft: str | None = None  # speculative decoding's proposer ("ngram"); None: none
    cascade: str | None = None  # the cascade's large model (a preset); None: no cascade
    cascade_thresholds: Path | None = None  # its thresholds file; None: the packaged one
    cascade_early: bool = True  # the small answer stops once its total is under the threshold


def run_worker(settings: Any, plan: WorkerPlan) -> int:
    """Build the served engine for `settings` and `plan`, run the worker; its exit code."""
    from workers.engine import device_select
    from workers.engine.autoprobe import resolve_worker_config
    from workers.engine.batch_cap import choose_batch_cap
    from workers.engine.disk_cache import cache_root, configure_compile_caches
    from workers.engine.engine import EngineConfig
    from workers.engine.speculative import DRAFTERS
    from workers.serving.fair_engine import build_fair_engine
    from workers.serving.pipeline import ServingOptions, build_served_engine

    if plan.draft is not None and plan.draft not in DRAFTERS:
        raise StartRefused(
            f"unknown draft method {plan.draft!r} (known: {', '.join(DRAFTERS)})", option="--draft"
        )
    retriever = _open_retriever(plan) if plan.tm_examples > 0 else None  # before the model
    root = cache_root(settings.cache_dir)
    configure_compile_caches(root)  # before anything compiles or builds (disk_cache.py)
    if plan.resolved_device == "cpu":
        _build_cpu_ops_in_background()
    try:
        choice = resolve_worker_config(
            settings.model, device=plan.resolved_device, quantize=plan.quantize,
            compile_decode=plan.compile_decode, auto=plan.auto, cache_root=root, background=True,
        )  # fmt: skip
    except ValueError as exc:
        raise StartRefused(str(exc), option="--quantize") from None
    chosen = choice.candidate
    if plan.draft is not None and not chosen.compile_decode:
        log.warning(
            "--draft %s without compiled decode: draft checks run eagerly, where float rounding "
            "may flip a near-tie (workers/engine/speculative.py); --compile-decode keeps the "
            "output the model's own, token for token", plan.draft,
        )  # fmt: skip
    policies = {k: v for k, v in settings.policies.items() if k in settings.languages}
    max_new_tokens = max((p.max_new_tokens for p in policies.values()), default=256)
    # the running batch's cap from the probe's speeds and the tightest SLO (batch_cap.py)
    tightest_slo = min((p.slo_p99_s for p in policies.values()), default=None)
    cap = choose_batch_cap(choice.tok_s_by_batch, tightest_slo, EngineConfig().max_num_seqs)
    log.info("running batch cap %s", cap.reason)
    engine_config = EngineConfig(
        model=settings.model,
        device=plan.device,
        dtype=chosen.dtype,
        quantize=chosen.quantize,
        compile_decode=chosen.compile_decode,
        compile_in_background=True,  # consume at once, eager until the graphs are ready
        cache_dir=str(root),
        warm_languages=tuple(settings.languages),  # each language's prefix cached up front,
        warm_in_background=True,  # as the loop's first work: the group join overlaps it
        max_new_tokens=max_new_tokens,
        max_num_seqs=cap.max_num_seqs,
        draft=plan.draft,
    )
    try:
        selection, loaded = device_select.select_engine_config(
            engine_config,
            device_select.GpuOptions(plan.device, plan.triton_kernels, plan.cuda_graphs),
        )
    except device_select.DeviceUnavailable as exc:  # CUDA lost since the first probe
        raise StartRefused(str(exc)) from None
    # weighted fair share (VTC) across languages, deadline admission, no OK after a deadline
    engine = build_fair_engine(
        selection.config, policies, burst_tokens=settings.burst_tokens, loaded=loaded,
        decode_steps=cap.steps,
    )  # fmt: skip
    del loaded  # the engine holds it; a switch of configuration must be able to free it
    cascade = (  # the large model on the device and paths the small one was given
        _cascade_setup(settings, plan, root, selection.config) if plan.cascade is not None else None
    )
    final = selection.config  # the translation cache keeps each weight format's answers apart
    # the stages and their order (which one sees which request): workers/serving/pipeline.py
    options = ServingOptions.of(
        settings,
        retriever=retriever,
        faithful=plan.faithful,
        faithful_policy=plan.faithful_policy,
        max_new_tokens=max_new_tokens,
        protect_spans=plan.protect_spans,
        cache=settings.cache_enabled if plan.cache is None else plan.cache,
        cache_variant=cache_variant(final),
        drill_latency=plan.drill_latency,
        drill_errors=plan.drill_errors,
        context=plan.context,
        cascade=cascade,
    )
    served = build_served_engine(engine, options)
    tuner = None
    if plan.auto and plan.resolved_device == "cpu" and (choice.pending_probe or choice.figures):
        tuner = _start_tuner(engine.engine, served, choice, settings, plan, root, tightest_slo)
    try:
        code = _serve(settings, served)
    finally:
        if tuner is not None:
            tuner.stop(timeout=1.0)
    if tuner is not None and tuner.busy:  # compiling on its thread: as exit_past_compiler says
        log.info("the tuner is still probing at exit: exiting without waiting for it")
        _exit_now(code)
    return code


def _cascade_setup(settings: Any, plan: WorkerPlan, root: Path, small_config: Any) -> Any:
    """The cascade's large model and thresholds (`--cascade`, workers/stages/cascade/stage.py):
    its weights as its stored probe chose them (else the unmeasured choice; it is not probed
    while serving), its own KV pools and engine thread. Thresholds calibrated for another
    scoring model refuse the start: their scale is that model's."""
    from dataclasses import replace

    from workers.engine.autoprobe import resolve_worker_config
    from workers.engine.engine import Engine
    from workers.stages.cascade.rules import SCORER, CascadeThresholds, packaged_thresholds
    from workers.stages.cascade.stage import CascadeSetup

    large_model = plan.cascade
    assert large_model is not None
    if large_model == settings.model:
        raise StartRefused(
            "--cascade names the model the worker already serves", option="--cascade"
        )
    try:
        path = plan.cascade_thresholds
        thresholds = CascadeThresholds.load(path) if path else packaged_thresholds()
    except ValueError as exc:
        raise StartRefused(str(exc), option="--cascade-thresholds") from None
    by_large = SCORER[thresholds.signal] == "large"
    scorer = thresholds.large if by_large else thresholds.small
    wanted = large_model if by_large else settings.model
    if scorer != wanted:
        raise StartRefused(
            f"the cascade thresholds were calibrated with {thresholds.small} -> "
            f"{thresholds.large} ({thresholds.signal}); for {settings.model} -> {large_model} "
            "calibrate them: python -m bench.cascade --calibrate --small "
            f"{settings.model} --large {large_model} --out-thresholds FILE",
            option="--cascade-thresholds",
        )
    if (thresholds.small, thresholds.large) != (settings.model, large_model):
        log.warning(
            "cascade thresholds calibrated for %s -> %s, serving %s -> %s: the deferred share "
            "will differ from the calibrated %s", thresholds.small, thresholds.large,
            settings.model, large_model, thresholds.defer_share,
        )  # fmt: skip
    try:
        choice = resolve_worker_config(
            large_model, device=plan.resolved_device, quantize=None, compile_decode=None,
            auto=plan.auto, cache_root=root, background=True,
        )  # fmt: skip
    except ValueError as exc:
        raise StartRefused(str(exc), option="--cascade") from None
    chosen = choice.candidate
    config = replace(
        small_config,
        model=large_model,
        dtype=chosen.dtype,
        quantize=chosen.quantize,
        compile_decode=chosen.compile_decode,
        draft=None,
        release_pool_when_idle=True,  # idle most of the time: its threads go back meanwhile
    )
    log.info("cascade: %s on %s (%s)", large_model, chosen.label, choice.reason)
    return CascadeSetup(Engine.from_config(config), thresholds, early=plan.cascade_early)


def cache_variant(config: Any) -> str:
    """The translation cache's runtime variant of an engine config: its weight format."""
    dtype_part = f",dtype={config.dtype}" if config.dtype else ""
    return f"quantize={config.quantize or ''}{dtype_part}"


def after_switch(engine: Any, served: Any, cap: BatchCap | None) -> None:
    """What the worker changes once the tuner moved `engine` to another configuration: the
    translation cache keys answers by the new weight format, and the scheduler's pace hook
    (workers/serving/pace.py) takes the new configuration's decode steps by batch size up to
    its cap (`cap.steps`, measured by the probe). Kept as they were, a first start's pace held
    the unmeasured start's figures for good: the latency prior's (95 ms at the default cap of
    32), with which many running requests read as at risk and newcomers of the other languages
    waited for them."""
    served.set_cache_variant(cache_variant(engine.config))
    pace = engine.scheduler.pace  # None without the fair engine's hook
    steps = cap.steps if cap is not None else {}
    if pace is not None and steps:
        log.info("pace: a decode step now counts %s (was %s)", _ms_by_batch(steps),
                 _ms_by_batch(pace.decode_steps))  # fmt: skip
        pace.decode_steps = steps


def _ms_by_batch(steps: dict[int, float]) -> str:
    """A pace's decode steps for the log: "b1 21.3 ms, b16 130.1 ms"."""
    return ", ".join(f"b{b} {s * 1e3:.1f} ms" for b, s in sorted(steps.items()))


def _start_tuner(
    engine: Any,
    served: Any,
    choice: Any,
    settings: Any,
    plan: WorkerPlan,
    root: Path,
    slo: float | None,
) -> Any:
    """The background probe and online check of the served configuration (tuner.py); after a
    switch, `after_switch`."""
    from dataclasses import replace

    from workers.engine.autoconfig import Overrides
    from workers.engine.autoprobe import QUANTIZE_FLAGS, auto_config
    from workers.engine.batch_cap import choose_batch_cap
    from workers.engine.engine import Engine, EngineConfig
    from workers.engine.tuner import ConfigTuner, TunerSettings

    weights = QUANTIZE_FLAGS[plan.quantize] if plan.quantize is not None else None
    over = Overrides(weights, plan.compile_decode)

    def probe() -> Any:
        wait_until_warm(engine, WARM_WAIT_S)
        return auto_config(settings.model, root, over, settings.model, force=True)

    caps: dict[str, BatchCap] = {}  # the batch cap of the configuration last built

    def build(new: Any) -> Any:
        cap = caps["built"] = choose_batch_cap(new.tok_s_by_batch, slo, EngineConfig().max_num_seqs)
        c = new.candidate
        config = replace(
            engine.config, dtype=c.dtype, quantize=c.quantize, compile_decode=c.compile_decode,
            compile_in_background=False, warm_in_background=False,  # never started: warm now
            max_num_seqs=cap.max_num_seqs,
        )  # fmt: skip
        return Engine.from_config(config)

    def switched(old: str, new: str, why: str) -> None:
        after_switch(engine, served, caps.get("built"))

    watch = plan.cascade is None  # the large model's steps would read as a slow configuration
    if not watch:
        log.info("config tuner: the served-speed check is off (a cascade shares the cores)")
    tuner = ConfigTuner(
        engine, choice, probe=probe, build=build, on_switch=switched,
        settings=TunerSettings(watch_served=watch),
    )  # fmt: skip
    tuner.start()
    return tuner


def wait_until_warm(engine: Any, timeout_s: float, poll_s: float = 0.1) -> bool:
    """Wait until `engine` has warmed the languages it warms at start (`warm_in_background`:
    its loop's first work); False when `timeout_s` passed first. The tuner's first probe runs
    after it: the two side by side on two cores slowed the warm-up, and so readiness, from ~5
    to 7-9 s on a 2-vCPU AMD EPYC, and the probe measured a busy host."""
    import time

    wanted = {lang for lang in engine.config.warm_languages if lang in engine.languages}
    end = time.monotonic() + timeout_s
    while not wanted <= set(engine.warmed_languages):
        if time.monotonic() >= end:
            return False
        time.sleep(poll_s)
    return True


def _build_cpu_ops_in_background() -> None:
    """Start the C++ ops' first build (~20 s of g++ on a machine never seen, kernels/cpu_ops.py)
    now, beside the model's loading and conversion: the compiler runs in child processes, so
    the two overlap on two cores. The build thread runs at a lower priority (nice 10, which
    the compiler it starts inherits): where the cores are few, the conversion on the way to
    consuming goes first. The ops' first user waits on `cpu_ops.load()`'s lock."""
    import threading

    from kernels import cpu_ops

    def build() -> None:
        try:  # Linux: a thread id as PRIO_PROCESS sets that thread's nice, and its children's
            tid = threading.get_native_id()
            os.setpriority(
                os.PRIO_PROCESS, tid, min(os.getpriority(os.PRIO_PROCESS, tid) + BUILD_NICE, 19)
            )
        except (AttributeError, OSError):  # another OS: the build at the usual priority
            pass
        cpu_ops.load()

    threading.Thread(target=build, name="tolk-cpu-ops-build", daemon=True).start()


def _open_retriever(plan: WorkerPlan) -> Any:
    """The TM index of retrieved examples (workers/stages/examples/stage.py); a bad one
    refuses the start, before the model loads."""
    from workers.stages.examples.stage import open_retriever
    from workers.tm.phrase_index import IndexMismatchError

    try:
        return open_retriever(plan.tm_dir, plan.tm_examples)
    except (IndexMismatchError, ValueError) as exc:
        raise StartRefused(str(exc)) from None


def _serve(settings: Any, served: Any) -> int:
    from confluent_kafka import KafkaException

    from workers.engine.threads import release_openmp_pool
    from workers.ports import PortUnavailable
    from workers.worker import Worker

    runner = Worker(settings, served)
    # whatever torch work start-up ran on this thread (loading, the probe, the stages): its
    # OpenMP pool must not outlive it, or the engine's steps pay libgomp's throttled barriers
    # (workers/engine/threads.py; measured: decode steps 57 ms instead of 23)
    release_openmp_pool()
    code = 0
    try:
        runner.run()
    except PortUnavailable as exc:  # taken since the command line checked it
        print(f"error: {exc}", file=sys.stderr)
        code = 2
    except KafkaException as exc:  # fatal: logged by the worker; the supervisor restarts us
        print(f"error: fatal Kafka error, worker stopped: {exc}", file=sys.stderr)
        code = 1
    exit_past_compiler(code)
    return code


def exit_past_compiler(code: int) -> None:
    """A worker stopped while its decode graphs still compile in the background ends here with
    `os._exit`: its replies are produced and offsets committed (the worker stopped), and the
    interpreter's normal exit would abort in torch's C++ under the compiling thread
    (workers/engine/compiled.py, `background_compile_running`)."""
    from workers.engine.compiled import background_compile_running

    if not background_compile_running():
        return
    log.info("decode graphs still compiling at exit: exiting without waiting for the compiler")
    _exit_now(code)


def _exit_now(code: int) -> None:
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
