"""Shared fixtures: real models loaded once per session, the data directory, and a minimal
paged greedy driver.

The model fixtures load the GGUF presets through `workers.engine.loader` (the first run
dequantizes and caches them, ~80 s for Gemma; later runs read the cache). Tests that use them
are marked `slow`. `data_dir` is `replay.datasets.data_dir()` (the repository's data/ or
$TOLK_DATA_DIR); missing data fails the test, it never skips. The Kafka and redis fixtures
live in `tests/kafka_fixtures.py` (they start the local stack when it is not running); the
terminal summary says when they did.

The suite runs in parallel under pytest-xdist (`-n` in pyproject's addopts, `--dist
loadgroup`): each worker process is a pytest session of its own, so the session fixtures (the
models above) load once per worker that needs them. What must not be split or run side by side
gets one `xdist_group` (`SERIAL_GROUPS`, given out at collection): tests of one group run on one
worker, one after the other. Each worker sets torch's intra-op threads to its share of the CPUs
(`worker_threads`): two workers of two threads each on two cores would spin against each
other.
"""

from __future__ import annotations

import math
import os
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from kernels.attention import AttentionMetadata

# `tolk worker` picks its configuration by a start-up probe (workers/engine/autoprobe.py: model
# loads and a compilation the first time on a machine). Tests that start workers (in process or
# as subprocesses, which inherit this) keep the fixed eager float32 engine their timings assume;
# tests of the auto configuration call it directly or set TOLK_AUTO themselves.
os.environ.setdefault("TOLK_AUTO", "0")

# (group, why, fixtures, test files under tests/): a test that uses one of the fixtures or lives
# in one of the files is in the group, and the tests of a group go to one xdist worker.
SERIAL_GROUPS: tuple[tuple[str, str, tuple[str, ...], tuple[str, ...]], ...] = (
    (
        "triton-interpreter",
        "one TRITON_INTERPRET=1 child runs every triton case of the session "
        "(tests/kernels/triton_interpreter.py); split, each worker would run it whole",
        (),
        ("kernels/test_triton_",),
    ),
    (
        "fault-stack",
        "one private Kafka + redis per session (tests/faults/conftest.py) on ports probed from "
        "19092 / 16379; the tests stop and break it",
        ("fault_stack",),
        (),
    ),
    (
        "secure-stack",
        "one SASL_SSL stack per module on ports probed from 29092 / 26379",
        ("secure_stack",),
        (),
    ),
    (
        "qwen-models",
        "the Qwen 0.5B and its transformers reference take ~4 GB in float32 and stay loaded for "
        "the session of each worker that asked for them: on one worker only, so that both "
        "workers' models fit in the machine's memory together (a CI run on 2026-12-06 had a "
        "worker OOM-killed at 13.8 GB)",
        ("qwen05", "qwen05_reference"),
        (),
    ),
    (
        "private-redis",
        "redis-servers of their own on ports probed from 36379 / 36380: probed at the same "
        "time, two tests would pick the same port",
        (),
        (
            "workers/test_store_outage.py",
            "workers/test_cache_outage.py",
            "compose/test_stack_redis_bounded.py",
        ),
    ),
)

TESTS_DIR = Path(__file__).resolve().parent


def serial_group(path: Path, fixturenames: Sequence[str] = ()) -> str | None:
    """The `SERIAL_GROUPS` group of a test (its file, the fixtures it uses), or None."""
    try:
        rel = path.resolve().relative_to(TESTS_DIR).as_posix()
    except ValueError:
        rel = ""
    for name, _why, fixtures, files in SERIAL_GROUPS:
        if any(f in fixturenames for f in fixtures) or any(rel.startswith(f) for f in files):
            return name
    return None


@pytest.hookimpl(tryfirst=True)  # before xdist's worker reads the marks into the node ids
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        group = serial_group(Path(item.path), getattr(item, "fixturenames", ()))
        if group is not None and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(group))


def worker_threads(cpus: int | None, workers: int) -> int:
    """Torch intra-op threads for one of `workers` processes on `cpus` CPUs (at least 1)."""
    return max(1, (cpus or 1) // max(1, workers))


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):  # set in xdist's worker processes only
        workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
        torch.set_num_threads(worker_threads(os.cpu_count(), workers))


def pytest_sessionfinish(session: pytest.Session) -> None:
    """An xdist worker tells the controller that it started the stack (the controller's
    terminal summary says so)."""
    from tests.kafka_fixtures import session_stack_start

    workeroutput = getattr(session.config, "workeroutput", None)
    start = session_stack_start()
    if workeroutput is not None and start is not None and start.ok:
        workeroutput["tolk_stack_started"] = True


_workers_started_stack: list[str] = []


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    """xdist's controller: note a worker that started the stack."""
    if getattr(node, "workeroutput", {}).get("tolk_stack_started"):
        _workers_started_stack.append(str(node.gateway.id))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Say so when the session (or one of its xdist workers) started the local stack
    (`tests/kafka_fixtures.py`): it is left running for the next run."""
    from tests.kafka_fixtures import STACK_LEFT_RUNNING, session_stack_start

    start = session_stack_start()
    if (start is not None and start.ok) or _workers_started_stack:
        terminalreporter.write_line(f"tolk: {STACK_LEFT_RUNNING}")


@pytest.fixture(scope="session")
def data_dir() -> Path:
    """The public data sets: `replay.datasets.data_dir()` (the checkout's data/, or
    $TOLK_DATA_DIR). Missing data is an error, never a skip."""
    from replay.datasets import data_dir as find_data_dir

    return find_data_dir()


def _load(preset: str) -> Any:
    from workers.engine.loader import load_model

    return load_model(preset, dtype=torch.float32, device="cpu")


def _load_reference(preset: str) -> Any:
    from workers.engine.loader import load_reference_hf_model

    return load_reference_hf_model(preset)


@pytest.fixture(scope="session")
def smollm2() -> Any:
    """LoadedModel of SmolLM2-135M-Instruct (Llama), float32 on CPU."""
    return _load("smollm2-135m")


@pytest.fixture(scope="session")
def gemma3() -> Any:
    """LoadedModel of Gemma 3 270M base, float32 on CPU."""
    return _load("gemma3-270m")


@pytest.fixture(scope="session")
def smollm2_reference() -> Any:
    """(transformers model, tokenizer) on the same dequantized SmolLM2 weights."""
    return _load_reference("smollm2-135m")


@pytest.fixture(scope="session")
def gemma3_reference() -> Any:
    """(transformers model, tokenizer) on the same dequantized Gemma 3 weights."""
    return _load_reference("gemma3-270m")


@pytest.fixture(scope="session")
def qwen05() -> Any:
    """LoadedModel of Qwen2.5-Coder-0.5B-Instruct (Qwen 2, the `qwen` extra), float32 on CPU."""
    return _load("qwen2.5-coder-0.5b")


@pytest.fixture(scope="session")
def qwen05_reference() -> Any:
    """(transformers model, tokenizer) on the same dequantized Qwen2.5-Coder-0.5B weights."""
    return _load_reference("qwen2.5-coder-0.5b")


def split_evenly(n: int, parts: int) -> list[int]:
    """End offsets of `parts` near-equal chunks of range(n)."""
    parts = max(1, min(parts, n))
    return [round(n * (i + 1) / parts) for i in range(parts)]


@torch.inference_mode()
def paged_greedy(
    model: Any,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    block_size: int = 16,
    prefill_chunks: int = 1,
    shuffle_blocks: bool = False,
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy decoding through the paged cache, the way the engine drives the model.

    All prompts are prefilled in `prefill_chunks` steps (each step one chunk of every prompt,
    a mixed varlen batch when there are several prompts), then every step decodes one token
    per sequence (a decode-only batch). Generates exactly `max_new_tokens` (no EOS stop).
    Returns the token ids per prompt and, per step, the logits [B, vocab] that chose them.
    """
    cfg = model.config
    device = model.embed.weight.device
    n_per_seq = [math.ceil((len(p) + max_new_tokens) / block_size) for p in prompts]
    ids = list(range(1, sum(n_per_seq) + 1))
    if shuffle_blocks:
        random.Random(0).shuffle(ids)  # scattered, non-contiguous block tables
    tables, start = [], 0
    for n in n_per_seq:
        tables.append(ids[start : start + n])
        start += n
    model.allocate_kv_cache(
        {g: len(ids) + 1 for g in cfg.kv_groups}, block_size, model.embed.weight.dtype, device
    )

    def step(chunks: list[list[int]], done: list[int]) -> torch.Tensor:
        q_lens = [len(c) for c in chunks]
        seq_lens = [d + q for d, q in zip(done, q_lens, strict=True)]
        meta = AttentionMetadata.build(q_lens, seq_lens, tables, block_size, device)
        input_ids = torch.tensor([t for c in chunks for t in c], device=device)
        positions = torch.tensor(
            [p for d, q in zip(done, q_lens, strict=True) for p in range(d, d + q)], device=device
        )
        hidden = model(input_ids, positions, {g: meta for g in cfg.kv_groups})  # [T, D]
        last = torch.tensor(q_lens, device=device).cumsum(0) - 1  # each sequence's last token
        return model.compute_logits(hidden[last])  # [B, V]

    done = [0] * len(prompts)
    bounds = [split_evenly(len(p), prefill_chunks) for p in prompts]
    for i in range(max(len(b) for b in bounds)):
        ends = [b[min(i, len(b) - 1)] for b in bounds]
        chunks = [list(p[d:e]) for p, d, e in zip(prompts, done, ends, strict=True)]
        if i > 0 and any(not c for c in chunks):
            raise ValueError("prompts too short for that many prefill chunks")
        logits = step(chunks, done)
        done = [d + len(c) for d, c in zip(done, chunks, strict=True)]
    outputs: list[list[int]] = [[] for _ in prompts]
    history = []
    for _ in range(max_new_tokens):
        history.append(logits)
        nxt = logits.argmax(-1).tolist()
        for out, tok in zip(outputs, nxt, strict=True):
            out.append(tok)
        if len(outputs[0]) == max_new_tokens:
            break
        logits = step([[t] for t in nxt], done)
        done = [d + 1 for d in done]
    model.free_kv_cache()
    return outputs, history


@pytest.fixture(scope="session")
def greedy() -> Any:
    """The paged greedy driver (see `paged_greedy`)."""
    return paged_greedy


def staggered_greedy(
    engine: Any, prompts: list[list[int]], max_new_tokens: int = 14, alone_steps: int = 3
) -> list[list[int]]:
    """Greedy tokens of `prompts` on `engine`: the first prompt alone for `alone_steps` steps,
    then the others join while it decodes: a prefill step, decode steps, then mixed steps
    (decode rows beside prefill chunks)."""
    from workers.engine.types import GenerationRequest, SamplingParams

    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True, stop_at_newline=False)
    handles = [engine.submit(GenerationRequest("r0", prompts[0], params))]
    for _ in range(alone_steps):
        engine.step()
    handles += [
        engine.submit(GenerationRequest(f"r{i}", p, params)) for i, p in enumerate(prompts[1:], 1)
    ]
    engine.run_until_done()
    return [h.result(timeout=0).token_ids for h in handles]


def tiny_hf_config(arch: str, **overrides: Any) -> Any:
    """Small transformers configs (Llama, Gemma 3 text, Qwen 2, Qwen 3) that still exercise every
    flag of the model file (windows shorter than the text, soft-caps, linear RoPE scaling, q/k/v
    biases, grouped-query attention); `overrides` replace any field (Gemma: give `layer_types`
    with `num_hidden_layers`)."""
    from transformers import Gemma3TextConfig, LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=101, hidden_size=64, intermediate_size=96, num_attention_heads=4,
        max_position_embeddings=256, attn_implementation="eager",
    )  # fmt: skip
    if arch == "llama":
        llama = dict(
            num_hidden_layers=2, num_key_value_heads=2, rope_theta=500.0,
            rope_scaling={"rope_type": "linear", "factor": 2.0}, tie_word_embeddings=False,
        )  # fmt: skip
        return LlamaConfig(**(common | llama | overrides))
    if arch in ("qwen2", "qwen3"):  # GQA 4:1 like Qwen 2.5 (14 or 12 : 2), untied head
        qwen = dict(
            num_hidden_layers=2, num_key_value_heads=1, rope_theta=1e6, rms_norm_eps=1e-6,
            tie_word_embeddings=False,
        )  # fmt: skip
        if arch == "qwen3":
            qwen["head_dim"] = 32  # Qwen 3 sets head_dim apart from hidden_size / heads (16)
        config_class = Qwen2Config if arch == "qwen2" else Qwen3Config
        return config_class(**(common | qwen | overrides))
    layer_types = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
    gemma = dict(
        num_hidden_layers=4, num_key_value_heads=1, head_dim=32, sliding_window=8,
        layer_types=layer_types, query_pre_attn_scalar=24, rope_theta=10000.0,
        rope_local_base_freq=100.0, rope_scaling={"rope_type": "linear", "factor": 4.0},
        final_logit_softcapping=3.0, attn_logit_softcapping=5.0,
    )  # fmt: skip
    return Gemma3TextConfig(**(common | gemma | overrides))


@pytest.fixture(scope="session")
def tiny_config() -> Any:
    """`tiny_hf_config`: small random-model configs for both architectures."""
    return tiny_hf_config


class IdsOnlyTokenizer:
    """The engine decodes text at the end of a request; random models have no vocabulary."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return ""

    def get_vocab(self) -> dict[str, int]:
        return {}


def tiny_random_models(hf_config: Any, device: str = "cpu") -> tuple[Any, Any]:
    """(transformers model, tolk LoadedModel) with the same random float32 weights, drawn
    wider than the init's 0.02 (std 0.2) so that greedy logits have fewer near-ties."""
    from transformers import AutoModelForCausalLM

    from workers.engine.config import ModelConfig
    from workers.engine.loader import LoadedModel, model_from_hf_state_dict

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    for p in hf.parameters():
        p.data.normal_(0, 0.2)
    config = ModelConfig.from_hf(hf_config)
    ours = model_from_hf_state_dict(hf.state_dict(), config, torch.float32, device)
    loaded = LoadedModel(ours, config, IdsOnlyTokenizer(), config.arch, "random")
    return hf.eval().to(device), loaded


@pytest.fixture(scope="session")
def tiny_models() -> Any:
    """`tiny_random_models`: a transformers model and tolk's, on the same random weights."""
    return tiny_random_models
