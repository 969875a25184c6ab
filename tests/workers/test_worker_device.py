"""`tolk worker --device` refuses a device it cannot have before the broker and the model
(workers/cli.py, workers/engine/device_select.py): an unknown name, and `cuda` on a machine
without usable CUDA (the message says why and points at `--device auto`)."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from workers.cli import app

UNREACHABLE = "127.0.0.1:1"  # reached only if the device check let the worker through


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_device_cuda_without_cuda_exits_2_saying_why():
    result = CliRunner().invoke(app, ["worker", "--device", "cuda", "--bootstrap", UNREACHABLE])
    assert result.exit_code == 2, result.output
    assert "--device cuda, but CUDA is not usable here" in result.output
    assert "--device auto" in result.output


def test_an_unknown_device_is_a_usage_error():
    result = CliRunner().invoke(app, ["worker", "--device", "tpu", "--bootstrap", UNREACHABLE])
    assert result.exit_code == 2
    assert "--device" in result.output
