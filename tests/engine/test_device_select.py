"""`tolk worker --device` and the GPU path (workers/engine/device_select.py), on the CPU.

The selection (flags + CUDA availability + triton import + the start-up check -> EngineConfig
and log lines) with fakes for "CUDA usable", "triton import fails", "the check mismatches";
the real check on tiny random models: its comparison catches a model that computes another
function and passes a different path to the same function, and on a CPU model it turns both
fast parts off because neither can run there (the Triton kernels compared with the eager path
for real: tests/kernels/test_triton_device_select.py, under Triton's interpreter).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import pytest
import torch

from workers.engine import device_select as ds
from workers.engine.device_select import (
    CheckResult,
    DeviceUnavailable,
    GpuOptions,
    Selection,
    apply_check,
    check_fast_path,
    choose_device,
    compare,
    greedy_tokens,
    plan,
    select_engine_config,
)
from workers.engine.engine import Engine, EngineConfig

# no GEMM probe, no C++ ops to build (the screened LM head: one test below)
BASE = EngineConfig(model="m", kv_cache_tokens=512, pack_weights=False, screen_lm_head=False)
NO_CUDA = "torch 2.x sees no CUDA device"


# -- the device ---------------------------------------------------------------------------------


def test_cpu_when_asked_whatever_cuda_says():
    assert choose_device("cpu", None) == ("cpu", "device cpu (asked)")


def test_auto_takes_cuda_when_usable_and_says_so():
    assert choose_device("auto", None) == ("cuda", "device cuda (auto: CUDA usable)")


def test_auto_falls_back_to_the_cpu_with_the_reason():
    device, why = choose_device("auto", NO_CUDA)
    assert device == "cpu"
    assert NO_CUDA in why


def test_cuda_asked_without_cuda_is_an_error_that_says_why_and_the_way_out():
    with pytest.raises(DeviceUnavailable, match="no CUDA device.*--device auto"):
        choose_device("cuda", NO_CUDA)


def test_an_unknown_device_is_refused():
    with pytest.raises(ValueError, match="auto, cpu, cuda"):
        choose_device("tpu", None)


# -- the plan and the check's verdict -------------------------------------------------------------


def test_cuda_plans_both_fast_parts_by_default():
    s = plan(BASE, GpuOptions("cuda"), cuda_trouble=None, triton_trouble=None)
    assert (s.config.device, s.config.triton_kernels, s.config.cuda_graphs) == ("cuda", True, True)
    assert s.fallbacks == ()


def test_each_flag_turns_its_part_off():
    s = plan(BASE, GpuOptions("cuda", triton_kernels=False), cuda_trouble=None, triton_trouble=None)
    assert (s.config.triton_kernels, s.config.cuda_graphs) == (False, True)
    assert "Triton kernels off (--no-triton-kernels)" in s.notes
    s = plan(BASE, GpuOptions("cuda", cuda_graphs=False), cuda_trouble=None, triton_trouble=None)
    assert (s.config.triton_kernels, s.config.cuda_graphs) == (True, False)
    assert "CUDA graphs off (--no-cuda-graphs)" in s.notes


def test_triton_that_cannot_be_imported_leaves_the_graphs_and_warns():
    trouble = "triton cannot be imported: ImportError: no module named triton"
    s = plan(BASE, GpuOptions("cuda"), cuda_trouble=None, triton_trouble=trouble)
    assert (s.config.triton_kernels, s.config.cuda_graphs) == (False, True)
    assert any(trouble in f and "Triton kernels OFF" in f for f in s.fallbacks)


def test_the_cpu_runs_no_fast_part_even_when_asked():
    s = plan(BASE, GpuOptions("auto"), cuda_trouble=NO_CUDA, triton_trouble=None)
    assert (s.config.device, s.config.triton_kernels, s.config.cuda_graphs) == ("cpu", False, False)
    assert s.fast_parts == ()


def test_a_failed_part_is_turned_off_and_named_with_its_reason():
    s = plan(BASE, GpuOptions("cuda"), cuda_trouble=None, triton_trouble=None)
    after = apply_check(s, CheckResult(kernels="prompt 1, token 3: 7 where the eager path gives 9"))
    assert (after.config.triton_kernels, after.config.cuda_graphs) == (False, True)
    assert after.fallbacks == (
        "Triton kernels OFF, eager ops instead: check failed: prompt 1, token 3: 7 where the "
        "eager path gives 9",
    )
    after = apply_check(s, CheckResult(graphs="raised RuntimeError: capture failed"))
    assert (after.config.triton_kernels, after.config.cuda_graphs) == (True, False)
    assert "CUDA graphs OFF" in after.fallbacks[0] and "capture failed" in after.fallbacks[0]


def test_a_passed_check_changes_nothing_and_adds_its_summary():
    s = plan(BASE, GpuOptions("cuda"), cuda_trouble=None, triton_trouble=None)
    after = apply_check(s, CheckResult(summary="checked: 3 prompts"))
    assert after.config == s.config and after.fallbacks == ()
    assert after.notes[-1] == "checked: 3 prompts"


# -- select_engine_config with fakes ----------------------------------------------------------


class Fakes:
    def __init__(self, cuda: str | None = None, triton: str | None = None,
                 result: CheckResult | None = None) -> None:  # fmt: skip
        self.cuda, self.triton, self.result = cuda, triton, result or CheckResult()
        self.loaded: list[EngineConfig] = []
        self.checked: list[EngineConfig] = []
        self.model = object()

    def select(self, options: GpuOptions) -> tuple[Selection, Any]:
        def load(config: EngineConfig) -> Any:
            self.loaded.append(config)
            return self.model

        def check(loaded: Any, config: EngineConfig) -> CheckResult:
            assert loaded is self.model
            self.checked.append(config)
            return self.result

        return select_engine_config(
            BASE, options, probe_cuda=lambda: self.cuda, probe_triton=lambda: self.triton,
            load=load, check=check,
        )  # fmt: skip


def test_cuda_usable_and_the_check_passing_runs_the_fast_path(caplog):
    fakes = Fakes(result=CheckResult(summary="checked Triton kernels and CUDA graphs"))
    with caplog.at_level(logging.INFO, logger=ds.__name__):
        selection, loaded = fakes.select(GpuOptions("auto"))
    assert loaded is fakes.model  # the engine takes the checked model
    assert [c.device for c in fakes.loaded] == ["cuda"]
    assert fakes.checked[0].triton_kernels and fakes.checked[0].cuda_graphs
    assert selection.config == dataclasses.replace(
        BASE, device="cuda", triton_kernels=True, cuda_graphs=True
    )
    assert "running on cuda, Triton kernels on, CUDA graphs on" in caplog.text
    assert "checked Triton kernels and CUDA graphs" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_triton_import_failing_checks_and_runs_the_graphs_alone(caplog):
    fakes = Fakes(triton="triton cannot be imported: ImportError: boom")
    with caplog.at_level(logging.INFO, logger=ds.__name__):
        selection, _ = fakes.select(GpuOptions("cuda"))
    assert not fakes.checked[0].triton_kernels and fakes.checked[0].cuda_graphs
    assert (selection.config.triton_kernels, selection.config.cuda_graphs) == (False, True)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("Triton kernels OFF" in w and "ImportError: boom" in w for w in warnings)


def test_a_mismatching_check_falls_back_to_the_eager_path_with_a_warning(caplog):
    why = "prompt 0, token 5: 17 where the eager path gives 4 (eager logit gap 2.1 > tolerance 0.2)"
    fakes = Fakes(result=CheckResult(kernels=why, graphs=f"raised RuntimeError: x; {why}"))
    with caplog.at_level(logging.INFO, logger=ds.__name__):
        selection, _ = fakes.select(GpuOptions("cuda"))
    c = selection.config
    assert (c.device, c.triton_kernels, c.cuda_graphs) == ("cuda", False, False)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2
    assert "Triton kernels OFF" in warnings[0] and why in warnings[0]
    assert "CUDA graphs OFF" in warnings[1]
    assert "running on cuda, Triton kernels off, CUDA graphs off" in caplog.text


def test_no_cuda_with_auto_runs_on_the_cpu_unloaded_and_says_why(caplog):
    fakes = Fakes(cuda=NO_CUDA)
    with caplog.at_level(logging.INFO, logger=ds.__name__):
        selection, loaded = fakes.select(GpuOptions("auto"))
    assert loaded is None and fakes.loaded == [] and fakes.checked == []
    assert selection.config.device == "cpu"
    assert NO_CUDA in caplog.text


def test_no_cuda_with_cuda_asked_refuses_before_loading():
    fakes = Fakes(cuda=NO_CUDA)
    with pytest.raises(DeviceUnavailable):
        fakes.select(GpuOptions("cuda"))
    assert fakes.loaded == []


def test_both_parts_off_skip_the_load_and_the_check():
    fakes = Fakes()
    selection, loaded = fakes.select(GpuOptions("cuda", triton_kernels=False, cuda_graphs=False))
    assert loaded is None and fakes.checked == []
    assert selection.config.device == "cuda"


def test_cpu_asked_probes_nothing():
    def no_probe() -> str | None:
        raise AssertionError("probed")

    selection, loaded = select_engine_config(
        BASE, GpuOptions("cpu"), probe_cuda=no_probe, probe_triton=no_probe
    )
    assert selection.config.device == "cpu" and loaded is None


# -- the real check on tiny random models --------------------------------------------------------

PROMPTS = [[5, 9, 2, 77, 31], [8, 1, 3, 3, 90, 14, 15, 16, 2, 9, 10, 40, 41, 42, 43, 44, 45, 46]]


def recorded(engine: Engine) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
    recorder = ds._LogitRecorder(engine.model)
    engine.use_sampler(recorder)
    tokens = greedy_tokens(engine, PROMPTS, 10)
    return tokens, [recorder.logits[f"check-{i}"] for i in range(len(PROMPTS))]


def test_the_comparison_passes_another_path_to_the_same_function(tiny_config, tiny_models):
    _, loaded = tiny_models(tiny_config("llama", vocab_size=128))
    screened = dataclasses.replace(BASE, screen_lm_head=True)  # the recorder reads full logits
    want, logits = recorded(Engine(loaded, screened))
    assert all(len(x) == 10 for x in logits)
    other = Engine(loaded, dataclasses.replace(screened, block_size=4, enable_prefix_caching=False))
    got = greedy_tokens(other, PROMPTS, 10)
    assert compare(want, logits, got, ds.TOLERANCES[torch.float32]) == (None, 0)


def test_the_comparison_catches_a_model_that_computes_another_function(tiny_config, tiny_models):
    cfg = tiny_config("llama", vocab_size=128)
    _, loaded = tiny_models(cfg)
    want, logits = recorded(Engine(loaded, BASE))
    _, broken = tiny_models(cfg)  # the same weights (seeded), then one layer changed
    with torch.no_grad():
        broken.model.layers[0].mlp.down_proj.weight.mul_(-3.0)
    got = greedy_tokens(Engine(broken, BASE), PROMPTS, 10)
    assert got != want
    why, _ = compare(want, logits, got, ds.TOLERANCES[torch.float32])
    assert why is not None and why.startswith("prompt 0, token 0: ") and "> tolerance" in why


def test_a_near_tie_may_break_the_other_way_but_not_a_clear_winner():
    logits = torch.tensor([0.0, 5.0, 4.99, 1.0])
    tol = (0.05, 0.0)
    assert compare([[1, 1]], [[logits, logits]], [[2, 0]], tol) == (None, 1)  # 4.99 vs 5.0
    why, _ = compare([[1, 1]], [[logits, logits]], [[3, 0]], tol)  # 1.0 vs 5.0
    assert why is not None and "prompt 0, token 0: 3 where the eager path gives 1" in why
    nan = torch.full((4,), float("nan"))
    assert compare([[1]], [[nan]], [[2]], tol)[0] is not None  # NaN never passes


def test_the_check_on_a_cpu_model_turns_both_parts_off_with_reasons(tiny_config, tiny_models):
    pytest.importorskip("triton")
    _, loaded = tiny_models(tiny_config("llama", vocab_size=128))
    asked = dataclasses.replace(BASE, triton_kernels=True, cuda_graphs=True)
    result = check_fast_path(loaded, asked, new_tokens=6, prompts=PROMPTS)
    if ds.triton_problem() is None and not _interpreting():
        assert result.kernels is not None and "CUDA only" in result.kernels
    assert result.graphs == "no decode step ran as a CUDA graph (device cpu)"
    assert "2 prompts x 6 greedy tokens" in result.summary
    assert type(loaded.model.layers[0]).__name__ == "Block"  # nothing left swapped


def _interpreting() -> bool:
    from kernels import triton_common

    return bool(triton_common.INTERPRETED)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen2", "qwen3"])
def test_the_check_passes_kernels_and_graphs_on_cuda(arch: str, tiny_config, tiny_models):
    no_caps = {"attn_logit_softcapping": None, "final_logit_softcapping": None}
    _, loaded = tiny_models(
        tiny_config(arch, vocab_size=512, **(no_caps if arch == "gemma3" else {})), "cuda"
    )
    asked = dataclasses.replace(
        BASE, device="cuda", max_model_len=256, triton_kernels=True, cuda_graphs=True
    )
    result = check_fast_path(loaded, asked, new_tokens=12, prompts=PROMPTS)
    assert (result.kernels, result.graphs) == (None, None), result
    from workers.engine.triton_swaps import uses_triton_kernels

    assert uses_triton_kernels(loaded.model)
