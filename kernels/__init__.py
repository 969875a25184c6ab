"""Ops with a torch reference and, where it pays, a fast version of the same signature.

Each op's module chooses its implementation at the call, by device and dtype: the C++ CPU ops
(`kernels/cpu/*.cpp`, built on first use by `kernels.cpu_ops`) for float32 on the CPU when
they loaded, the torch reference everywhere else; the Triton kernels (`triton_*.py`) are
swapped in on CUDA by `workers/engine/triton_swaps.py`, not chosen here. The package
root imports nothing, so importing one op never loads another op's dependencies.
"""
