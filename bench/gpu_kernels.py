"""The Triton kernels on a GPU: each checked against its torch reference on random inputs, then
timed against it, with achieved bandwidth against the device's measured copy bandwidth.

    python -m bench.gpu_kernels --out bench/out/gpu/kernels.json            # CUDA
    TRITON_INTERPRET=1 python -m bench.gpu_kernels --device cpu --quick     # CPU dry run

Cases (block size 16, pools with random K/V at every position a sequence holds):

- `decode`: SmolLM2 (9:3 heads, D 64) and Gemma 3 270M (4:1, D 256, its 512-token window) at
  batch 1 / 8 / 32 / 64, context 2048 (batch 64 x 2048: issue #17's bandwidth target), against
  `kernels.attention.paged_attention` (gather + SDPA);
- `cascade`: SmolLM2, 32 rows sharing a 448-token prefix + 64 own tokens, against
  `paged_attention` (its own cascade);
- `varlen`: SmolLM2, 8 prompts of 200-500 tokens in one prefill step, against `paged_attention`
  (one SDPA call per sequence);
- `add_rms_norm`: 4096 rows x 576 (Llama `w`) and x 640 (Gemma `1 + w`, sandwich), against the
  model's ops; `rope_write_kv`: 4096 tokens, SmolLM2 heads, against RoPE + `write_kv`.

Checks: outputs finite (NaN never passes) and `assert_close` with per-dtype tolerances
(`TOLERANCES`); the reference runs on the same device and dtype. Timings: CUDA events, median
of `--repeats` after warm-up. Bandwidth: bytes the op must move at least (decode: every
visible K/V element once, plus q and out) over its time, and as a share of the copy bandwidth
(`dst.copy_(src)` of 1 GiB: read + write). On the CPU (`--device cpu`, under
`TRITON_INTERPRET=1`) the sizes shrink (`--quick`) and timings mean nothing: it shows the
script starts and the checks pass. Exit status 1 if any check fails.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

TOLERANCES = {"float32": (2e-5, 1e-4), "bfloat16": (2e-2, 2e-2)}  # (atol, rtol)
BLOCK_SIZE = 16
# (name, heads, kv heads, head dim, sliding window of the layer kind measured)
MODELS = [("smollm2", 9, 3, 64, None), ("gemma3", 4, 1, 256, 512)]


def timed(fn: Callable[[], Any], device: str, repeats: int) -> float:
    """Median microseconds per call (CUDA events on a GPU)."""
    import torch

    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def copy_bandwidth_gbs(device: str, mib: int) -> float:
    import torch

    src = torch.empty(mib << 20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    us = timed(lambda: dst.copy_(src), device, 10)
    return 2 * src.numel() / (us * 1e-6) / 1e9


def paged_pool(lens: Sequence[int], kvh: int, d: int, dtype: Any, device: str, seed: int = 0):
    """Pools with random K/V, one shuffled block table per sequence (int32, null-padded)."""
    import torch

    gen = torch.Generator(device="cpu").manual_seed(seed)
    need = [-(-s // BLOCK_SIZE) for s in lens]
    num_blocks = sum(need) + 1
    k = torch.randn(num_blocks, BLOCK_SIZE, kvh, d, generator=gen).to(device=device, dtype=dtype)
    v = torch.randn(num_blocks, BLOCK_SIZE, kvh, d, generator=gen).to(device=device, dtype=dtype)
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables, at = [], 0
    for n in need:
        tables.append(ids[at : at + n])
        at += n
    return k, v, tables


def check(out: Any, ref: Any, dtype_name: str) -> tuple[bool, float, str]:
    import torch

    err = float((out.float() - ref.float()).abs().max())
    if not torch.isfinite(out).all():
        return False, err, "non-finite output"
    atol, rtol = TOLERANCES[dtype_name]
    try:
        torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)
    except AssertionError as exc:
        return False, err, str(exc).splitlines()[0]
    return True, err, ""


def record(rows: list[dict], name: str, dtype: str, shape: dict, ok: tuple[bool, float, str],
           t_kernel: float, t_ref: float, nbytes: int | None, copy_gbs: float) -> None:  # fmt: skip
    row = {
        "case": name, "dtype": dtype, **shape,
        "passed": ok[0], "max_abs_err": ok[1], "error": ok[2],
        "triton_us": round(t_kernel, 2), "reference_us": round(t_ref, 2),
        "speedup": round(t_ref / t_kernel, 2) if t_kernel else None,
    }  # fmt: skip
    if nbytes is not None:
        gbs = nbytes / (t_kernel * 1e-6) / 1e9
        row["gb_s"] = round(gbs, 1)
        row["pct_of_copy"] = round(100 * gbs / copy_gbs, 1) if copy_gbs else None
    rows.append(row)
    status = "ok  " if ok[0] else "FAIL"
    extra = f" {row['gb_s']} GB/s ({row['pct_of_copy']}% of copy)" if nbytes is not None else ""
    print(f"bench.gpu_kernels {status} {name} {dtype} {shape} triton {row['triton_us']} us "
          f"ref {row['reference_us']} us x{row['speedup']}{extra} err {ok[1]:.2e} {ok[2]}",
          flush=True)  # fmt: skip


def run(args: argparse.Namespace) -> dict:
    import torch

    from kernels import triton_attention as ta
    from kernels import triton_norm_rope as nr
    from kernels.attention import AttentionMetadata, paged_attention

    device = args.device
    quick = args.quick
    copy_gbs = copy_bandwidth_gbs(device, 1 if quick else 1024)
    print(f"bench.gpu_kernels copy bandwidth {copy_gbs:.0f} GB/s", flush=True)
    rows: list[dict] = []
    batches = [1, 3] if quick else args.batches
    context = 40 if quick else args.context
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        elt = torch.empty(0, dtype=dtype).element_size()
        for name, h, kvh, d, window in MODELS:
            if quick and d > 64:
                d = 32
            for b in batches:
                lens = [context - (i * 7) % 13 for i in range(b)]  # ragged, partial blocks
                k, v, tables = paged_pool(lens, kvh, d, dtype, device, seed=b)
                meta = AttentionMetadata.build([1] * b, lens, tables, BLOCK_SIZE, device)
                q = torch.randn(b, h, d, device=device).to(dtype)
                w = min(window, context // 2) if (window and quick) else window
                splits = ta.default_num_splits(b, kvh, max(lens), torch.device(device))
                out = ta.paged_decode_attention(q, k, v, meta.block_tables, meta.seq_lens,
                                                d**-0.5, w, None, splits)  # fmt: skip
                ref = paged_attention(q, k, v, meta, d**-0.5, w)
                ok = check(out, ref, dtype_name)
                t_k = timed(
                    partial(
                        ta.paged_decode_attention,
                        q,
                        k,
                        v,
                        meta.block_tables,
                        meta.seq_lens,
                        d**-0.5,
                        w,
                        None,
                        splits,
                    ),
                    device,
                    args.repeats,
                )
                t_r = timed(partial(paged_attention, q, k, v, meta, d**-0.5, w), device,
                            args.repeats)  # fmt: skip
                seen = sum(min(s, w) if w else s for s in lens)
                nbytes = 2 * seen * kvh * d * elt + 2 * q.numel() * elt
                record(rows, f"decode-{name}", dtype_name,
                       {"batch": b, "context": context, "window": w, "splits": splits},
                       ok, t_k, t_r, nbytes, copy_gbs)  # fmt: skip

        # cascade: 32 rows share a prefix (SmolLM2 heads)
        _, h, kvh, d, _ = MODELS[0]
        rows_n, prefix, own = (5, 32, 5) if quick else (32, 448, 64)
        lens = [prefix + own + i % 5 for i in range(rows_n)]
        k, v, tables = paged_pool(lens, kvh, d, dtype, device, seed=3)
        shared_blocks = prefix // BLOCK_SIZE
        for t in tables[1:]:  # every row's table starts with row 0's prefix blocks
            t[:shared_blocks] = tables[0][:shared_blocks]
        meta = AttentionMetadata.build([1] * rows_n, lens, tables, BLOCK_SIZE, device)
        q = torch.randn(rows_n, h, d, device=device).to(dtype)
        out = ta.triton_paged_attention(q, k, v, meta, d**-0.5, None)
        ok = check(out, paged_attention(q, k, v, meta, d**-0.5, None), dtype_name)
        t_k = timed(partial(ta.triton_paged_attention, q, k, v, meta, d**-0.5, None), device,
                    args.repeats)  # fmt: skip
        t_r = timed(partial(paged_attention, q, k, v, meta, d**-0.5, None), device, args.repeats)
        record(rows, "cascade-smollm2", dtype_name,
               {"rows": rows_n, "prefix": prefix, "own": own},
               ok, t_k, t_r, None, copy_gbs)  # fmt: skip

        # varlen prefill: 8 prompts of 200-500 tokens (quick: 3 of 20-40)
        q_lens = [20, 33, 40] if quick else [200, 260, 310, 350, 400, 430, 470, 500]
        k, v, tables = paged_pool(q_lens, kvh, d, dtype, device, seed=5)
        meta = AttentionMetadata.build(q_lens, q_lens, tables, BLOCK_SIZE, device)
        q = torch.randn(sum(q_lens), h, d, device=device).to(dtype)
        out = ta.triton_paged_attention(q, k, v, meta, d**-0.5, None)
        ok = check(out, paged_attention(q, k, v, meta, d**-0.5, None), dtype_name)
        t_k = timed(partial(ta.triton_paged_attention, q, k, v, meta, d**-0.5, None), device,
                    args.repeats)  # fmt: skip
        t_r = timed(partial(paged_attention, q, k, v, meta, d**-0.5, None), device, args.repeats)
        flops = sum(2 * 2 * n * (n + 1) / 2 * h * d for n in q_lens)  # causal QK^T + PV
        record(rows, "varlen-smollm2", dtype_name,
               {"prompts": len(q_lens), "tokens": sum(q_lens),
                "tflops": round(flops / (t_k * 1e-6) / 1e12, 2)},
               ok, t_k, t_r, None, copy_gbs)  # fmt: skip

        # add_rms_norm: Llama (no pre-norm) and Gemma (1 + w, sandwich pre-norm)
        t_rows = 64 if quick else 4096
        for width, one_plus in ((576, False), (640, True)):
            x = torch.randn(t_rows, width, device=device).to(dtype)
            res = torch.randn(t_rows, width, device=device).to(dtype)
            wt = (torch.randn(width, device=device) * 0.1 + (0 if one_plus else 1)).to(dtype)
            pre = wt.flip(0) if one_plus else None
            out, s = nr.add_rms_norm(x, res, wt, 1e-6, one_plus, pre)
            ref, ref_s = nr.add_rms_norm_reference(x, res, wt, 1e-6, one_plus, pre)
            ok_s = check(s, ref_s, dtype_name)
            ok = check(out, ref, dtype_name)
            ok = (ok[0] and ok_s[0], max(ok[1], ok_s[1]), ok[2] or ok_s[2])
            t_k = timed(partial(nr.add_rms_norm, x, res, wt, 1e-6, one_plus, pre), device,
                        args.repeats)  # fmt: skip
            t_r = timed(partial(nr.add_rms_norm_reference, x, res, wt, 1e-6, one_plus, pre),
                        device, args.repeats)  # fmt: skip
            record(rows, "add_rms_norm", dtype_name,
                   {"rows": t_rows, "width": width, "one_plus": one_plus},
                   ok, t_k, t_r, 4 * x.numel() * elt, copy_gbs)  # fmt: skip

        # rope + KV write, SmolLM2 heads
        t_tok = 64 if quick else 4096
        q = torch.randn(t_tok, h, d, device=device).to(dtype)
        kk = torch.randn(t_tok, kvh, d, device=device).to(dtype)
        vv = torch.randn(t_tok, kvh, d, device=device).to(dtype)
        emb = torch.randn(t_tok, d, device=device)
        cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
        blocks = -(-t_tok // BLOCK_SIZE) + 1
        kc = torch.zeros(blocks, BLOCK_SIZE, kvh, d, device=device, dtype=dtype)
        vc = torch.zeros_like(kc)
        kc2, vc2 = kc.clone(), vc.clone()
        slots = torch.randperm((blocks - 1) * BLOCK_SIZE, device=device)[:t_tok] + BLOCK_SIZE
        qo, ko = nr.rope_write_kv(q, kk, vv, cos, sin, kc, vc, slots)
        qr, kr = nr.rope_write_kv_reference(q, kk, vv, cos, sin, kc2, vc2, slots)
        parts = [check(a, b_, dtype_name) for a, b_ in ((qo, qr), (ko, kr), (kc, kc2), (vc, vc2))]
        ok = (all(p[0] for p in parts), max(p[1] for p in parts),
              "; ".join(p[2] for p in parts if p[2]))  # fmt: skip
        t_k = timed(partial(nr.rope_write_kv, q, kk, vv, cos, sin, kc, vc, slots), device,
                    args.repeats)  # fmt: skip
        t_r = timed(partial(nr.rope_write_kv_reference, q, kk, vv, cos, sin, kc2, vc2, slots),
                    device, args.repeats)  # fmt: skip
        moved = (2 * q.numel() + 3 * kk.numel() + vv.numel() * 2 + 2 * cos.numel()) * elt
        record(rows, "rope_write_kv", dtype_name, {"tokens": t_tok, "heads": h, "kv_heads": kvh},
               ok, t_k, t_r, moved, copy_gbs)  # fmt: skip

    info: dict[str, Any] = {"torch": torch.__version__}
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    return {"bench": "gpu_kernels", "device": device, "machine": info, "copy_gb_s": copy_gbs,
            "passed": all(r["passed"] for r in rows), "results": rows}  # fmt: skip


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", default="cuda", help="cuda, or cpu under TRITON_INTERPRET=1")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--batches", default="1,8,32,64")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--quick", action="store_true", help="tiny sizes (the CPU dry run)")
    p.add_argument("--out", default="bench/out/gpu/kernels.json")
    args = p.parse_args(argv)
    args.dtypes = [s for s in args.dtypes.split(",") if s]
    args.batches = [int(s) for s in args.batches.split(",") if s]
    if args.quick:
        args.repeats = min(args.repeats, 2)
    result = run(args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"bench.gpu_kernels passed={result['passed']} -> {args.out}", flush=True)
    sys.exit(0 if result["passed"] else 1)


if __name__ == "__main__":
    main()
