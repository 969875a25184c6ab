"""The probed float32 projections (workers/engine/linear_backends.py): every backend the probe may
pick computes F.linear up to float32 rounding, the probe drops a wrong backend, keeps a packed
copy only when it is measurably faster, and routes each row count to its bucket's choice."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from workers.engine import linear_backends as lb

ROWS = (1, 3, 4, 9, 16, 40, 64, 130)


def close_to_linear(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> bool:
    scale = float(F.linear(x.abs(), w.abs()).max())
    return bool(torch.allclose(y, F.linear(x, w), rtol=0.0, atol=1e-5 * scale))


@pytest.mark.parametrize("backend", lb.available_backends())
@pytest.mark.parametrize("rows", ROWS)
def test_every_backend_computes_f_linear(backend: str, rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(200, 96, generator=gen)
    x = torch.randn(rows, 96, generator=gen)
    y = lb.make_kernel(backend, w)(x)
    assert y.shape == (rows, 200)
    assert close_to_linear(y, x, w)


def test_unknown_backend_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown linear backend 'cublas'"):
        lb.make_kernel("cublas", torch.zeros(2, 2))


def test_bucket_of_each_row_count() -> None:
    choice = lb.ShapeChoice((8, 8), ("a", "b", "c", "d"), {})
    got = {m: choice.backend_for(m) for m in (1, 3, 4, 15, 16, 63, 64, 1000)}
    assert got == {1: "a", 3: "a", 4: "b", 15: "b", 16: "c", 63: "c", 64: "d", 1000: "d"}


def test_probe_picks_the_fastest_only_when_it_clearly_wins(monkeypatch) -> None:
    def fake_time(kernels, k, gen):  # per bucket: onednn wins clearly, barely, loses, wins
        times = {
            "aten": (100.0, 100.0, 100.0, 100.0),
            "mkl-packed": (90.0, 99.0, 150.0, 80.0),
            "onednn-packed": (50.0, 97.0, 120.0, 60.0),
        }
        return {name: times[name] for name in kernels}

    monkeypatch.setattr(lb, "_time", fake_time)
    backends = tuple(b for b in lb.BACKENDS if b in lb.available_backends())
    choice = lb.probe_shape(24, 16, backends=backends)
    expected = {
        ("aten", "mkl-packed", "onednn-packed"): ("onednn-packed", "aten", "aten", "onednn-packed"),
        ("aten", "onednn-packed"): ("onednn-packed", "aten", "aten", "onednn-packed"),
        ("aten", "mkl-packed"): ("mkl-packed", "aten", "aten", "mkl-packed"),
        ("aten",): ("aten", "aten", "aten", "aten"),
    }[backends]
    assert choice.picks == expected


def test_probe_drops_a_backend_that_is_wrong(monkeypatch) -> None:
    if "onednn-packed" not in lb.available_backends():
        pytest.skip("this torch build has no oneDNN linear")
    real = lb.make_kernel

    def make(backend, weight):
        kernel = real(backend, weight)
        if backend == "onednn-packed":  # 0.1% off: far beyond float32 rounding
            return lambda x: kernel(x) * 1.001
        return kernel

    monkeypatch.setattr(lb, "make_kernel", make)
    choice = lb.probe_shape(64, 32, backends=("aten", "onednn-packed"))
    assert "onednn-packed" not in choice.micros
    assert set(choice.picks) == {"aten"}


def test_probe_is_cached_per_shape() -> None:
    first = lb.probe_shape(48, 40)
    assert lb.probe_shape(48, 40) is first
    assert "48x40" in lb.choices()
    assert set(lb.choices()["48x40"]["picks"].values()) <= set(lb.BACKENDS)


def test_probed_linear_matches_f_linear_at_every_bucket() -> None:
    gen = torch.Generator().manual_seed(3)
    linear = nn.Linear(80, 120, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(120, 80, generator=gen))
    picks = tuple(lb.available_backends()[i % len(lb.available_backends())] for i in range(4))
    probed = lb.ProbedLinear(linear, lb.ShapeChoice((120, 80), picks, {}))
    assert set(probed._kernels) == set(picks)  # only the packed copies its choices use
    for rows in ROWS:
        x = torch.randn(2, rows, 80, generator=gen)  # leading dims are kept
        y = probed(x)
        assert y.shape == (2, rows, 120)
        assert close_to_linear(y.reshape(-1, 120), x.reshape(-1, 80), linear.weight.detach())
