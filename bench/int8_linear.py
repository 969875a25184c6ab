"""The int8 op against float32's BLAS on this CPU, at the shapes of Gemma 3 270M's decode.

    python -m bench.int8_linear --rows 1,4,8,32 --out bench/out/int8_linear.json

`kernels.int8_linear`'s C++ op runs a vector loop of its own where the CPU has one it was
written for (AVX-512, else AVX2 + FMA; `fast_loop_expected()`), else a plain loop the compiler
vectorizes. Whether int8 weights pay off on a machine depends on it: this benchmark times, in
one process and interleaved, the op (`torch.ops.tolk.int8_linear`) and the anchor, float32
`F.linear` on the same weights dequantized (torch's BLAS: MKL / oneDNN), for the LM head
(262144 x 640) and the projections (2048 x 640, 640 x 2048), at each number of activation
rows; the fastest of `--repeats` calls counts. Beside them the op's own float32 loop
(`exact_float32=True`: int8 widened to float32 and FMA, the default loop where the CPU has no
16-bit one), so a change of the default loop is measured against it in the same run. It also
checks the op against `int8_linear_reference` (max abs error). And the int4 op
(`kernels.int4_linear`, the int8 head's screen: kernels/int8_head_screen.py) on the same
weights where K allows it (`int4_ms`, `int8_over_int4`): the screen pays where it reads the
head faster than the int8 op, at every batch the decode serves. One JSON object: the machine
(CPU model and the flags that decide the loop), per shape and row count the milliseconds of
each and the ratios (float32 / int8 and float32 loop / int8: above 1, the default int8 loop is
faster).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

from bench._common import JSON, dump, machine_info, parse_ints, write_json

SHAPES = {"lm_head": (262144, 640), "up_proj": (2048, 640), "down_proj": (640, 2048)}


def best_ms(fn: Callable[[], Any], repeats: int) -> float:
    fn()  # warm: pages touched, pools started
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return round(best * 1e3, 3)


def run(rows: list[int], repeats: int, threads: int) -> JSON:
    import torch
    import torch.nn.functional as F

    from kernels import cpu_ops
    from kernels.int4_linear import quantize_int4, supports
    from kernels.int8_linear import fast_loop_expected, int8_linear_reference, quantize_int8

    if not cpu_ops.load():
        raise SystemExit(f"the C++ ops did not build: {cpu_ops.error()}")
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    out: JSON = {
        "machine": machine_info(threads),
        "vector_loop": fast_loop_expected(),  # machine.cpu_flags: which one
        "shapes": {},
    }
    for name, (n, k) in SHAPES.items():
        q, scales = quantize_int8(torch.randn(n, k))
        w = (q.float() * scales[:, None]).contiguous()  # the same weights, in float32
        q4 = quantize_int4(w, refine=0) if supports(k) else None
        reps = repeats if n * k < 10_000_000 else max(3, repeats // 10)
        per_rows: JSON = {}
        for m in rows:
            x = torch.randn(m, k)
            err = torch.ops.tolk.int8_linear(x, q, scales, False) - int8_linear_reference(
                x, q, scales
            )
            f32 = best_ms(lambda: F.linear(x, w), reps)  # noqa: B023 (called at once)
            i8 = best_ms(lambda: torch.ops.tolk.int8_linear(x, q, scales, False), reps)  # noqa: B023
            loop = best_ms(lambda: torch.ops.tolk.int8_linear(x, q, scales, True), reps)  # noqa: B023
            per_rows[str(m)] = {
                "float32_ms": f32,
                "int8_ms": i8,
                "int8_float32_loop_ms": loop,
                "float32_over_int8": round(f32 / i8, 2),
                "float32_loop_over_int8": round(loop / i8, 2),
                "max_abs_err": float(err.abs().max()),
            }
            if q4 is not None:
                i4 = best_ms(lambda: torch.ops.tolk.int4_linear(x, *q4), reps)  # noqa: B023
                per_rows[str(m)].update(int4_ms=i4, int8_over_int4=round(i8 / i4, 2))
        out["shapes"][f"{name} {n}x{k}"] = per_rows
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="1,4,8,32", help="activation rows (batch), comma list")
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    result = run(parse_ints(args.rows), args.repeats, args.threads)
    print(dump(result))
    write_json(result, args.out)


if __name__ == "__main__":
    main()
