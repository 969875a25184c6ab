"""Ops with a torch reference and, where it pays, a fast device version of the same signature.

`get_op(name, device)` picks the implementation for a device type through a lazy registry: the
entries are "module:function" strings imported on first use, so a CPU-only install never imports
Triton, CuPy or CUDA code. A device type without its own entry gets the torch reference, which
runs anywhere torch does.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

# (op name, device type) -> "module:function"; "cpu" entries are the references.
_REGISTRY: dict[tuple[str, str], str] = {
    ("paged_attention", "cpu"): "kernels.attention:paged_attention",
    ("write_kv", "cpu"): "kernels.attention:write_kv",
}
_LOADED: dict[str, Callable[..., Any]] = {}


def register(name: str, device_type: str, target: str) -> None:
    """Declare `target` ("module:function") as the `name` op for `device_type`."""
    _REGISTRY[(name, device_type)] = target


def get_op(name: str, device: Any) -> Callable[..., Any]:
    """The implementation of op `name` for `device` (a torch.device or a string like "cuda:0")."""
    device_type = getattr(device, "type", None) or str(device).split(":")[0]
    target = _REGISTRY.get((name, device_type)) or _REGISTRY.get((name, "cpu"))
    if target is None:
        raise KeyError(f"no op named {name!r}; known: {sorted({n for n, _ in _REGISTRY})}")
    if target not in _LOADED:
        module_name, _, attr = target.partition(":")
        _LOADED[target] = getattr(importlib.import_module(module_name), attr)
    return _LOADED[target]


__all__ = ["get_op", "register"]
