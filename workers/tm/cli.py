"""`tolk tm`: translation memories, a typer sub-app mounted by `workers/cli.py`.

    tolk tm import FILE... [--format tmx|tsv|jsonl] [--pair en-de]   add pairs to the TM
    tolk tm build [--pairs en-de,de-en] [--index auto|ivfpq|flat]     (re)build phrase indexes
    tolk tm query TEXT --from en --to de [-k 4]                       the nearest TM pairs
    tolk tm status                                                    pairs and indexes

Every command works on one TM directory, `--tm-dir` (`$TOLK_TM_DIR`, default `tm`; the
layout is in `workers/tm/store.py`). `import` reads each file with `workers.tm.formats`,
prints every skipped row as `file:line: reason` on stderr and a summary as JSON on stdout; a
file with problems still imports its good rows (exit 0), a file that cannot be read at all or
has an unknown extension exits 2. `build` embeds each language pair's sources with
all-MiniLM-L6-v2 (offline, from the wheel) and writes the index; `query` opens the indexes
memory-mapped, as a worker would, and is also the check that they fit this embedder (a
mismatched index exits 2 with the reason). Heavy imports (faiss, torch) happen inside the
commands so `tolk --help` stays instant.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Literal, cast

import typer

app = typer.Typer(
    help="Translation memories: import TMX/TSV/JSONL, build and query the phrase index.",
    no_args_is_help=True,
)

TMDirOpt = Annotated[Path, typer.Option("--tm-dir", envvar="TOLK_TM_DIR", help="The TM directory.")]
DEFAULT_TM_DIR = Path("tm")


def _lang_pair(value: str) -> tuple[str, str]:
    src, sep, tgt = value.strip().partition("-")
    if not (sep and src and tgt):
        raise typer.BadParameter(f"{value!r}: a language pair is written src-tgt, e.g. en-de")
    return src.lower(), tgt.lower()


@app.command("import")
def import_(
    files: Annotated[list[Path], typer.Argument(help="TMX, TSV/TAB or replay JSONL files.")],
    fmt: Annotated[
        str | None, typer.Option("--format", help="tmx | tsv | jsonl (default: the extension).")
    ] = None,
    pair: Annotated[
        str | None, typer.Option(help="src-tgt of a two-column TSV (source, target).")
    ] = None,
    tm_dir: TMDirOpt = DEFAULT_TM_DIR,
) -> None:
    """Add the pairs of FILE... to the TM (duplicates skipped; bad rows reported)."""
    from workers.tm.formats import TM_FORMATS, TMPair, format_of, read_tm
    from workers.tm.store import TranslationMemoryDir

    if fmt is not None and fmt not in TM_FORMATS:
        raise typer.BadParameter(f"--format {fmt!r}: one of {', '.join(TM_FORMATS)}")
    langs = _lang_pair(pair) if pair else None
    tm = TranslationMemoryDir(tm_dir)
    summary: dict[str, dict[str, object]] = {}
    for path in files:
        if not path.is_file():
            typer.echo(f"{path}: no such file", err=True)
            raise typer.Exit(2)
        try:
            file_fmt = fmt or format_of(path)
        except ValueError as exc:
            typer.echo(str(exc), err=True)
            raise typer.Exit(2) from exc
        problems = 0
        pairs: list[TMPair] = []
        for item in read_tm(path, file_fmt, pair=langs):  # type: ignore[arg-type]
            if isinstance(item, TMPair):
                pairs.append(item)
            else:
                problems += 1
                typer.echo(f"{path.parent / item.row}: {item.reason}", err=True)
        counts = tm.add(pairs)
        summary[str(path)] = {
            "format": file_fmt,
            "pairs": len(pairs),
            "added": counts.added,
            "duplicates": counts.total_duplicates,
            "problems": problems,
        }
    typer.echo(json.dumps({"tm_dir": str(tm_dir), "files": summary}, ensure_ascii=False))


@app.command()
def build(
    pairs: Annotated[
        str | None, typer.Option(help="Language pairs to build, e.g. en-de,de-en (default all).")
    ] = None,
    index: Annotated[
        str, typer.Option(help="auto (IVF-PQ from 10,000 pairs, else exact) | ivfpq | flat.")
    ] = "auto",
    tm_dir: TMDirOpt = DEFAULT_TM_DIR,
) -> None:
    """Embed each language pair's sources and write its phrase index."""
    from workers.tm.embed import MiniLMEmbedder
    from workers.tm.phrase_index import PhraseIndex, choose_params
    from workers.tm.store import TranslationMemoryDir

    if index not in ("auto", "ivfpq", "flat"):
        raise typer.BadParameter(f"--index {index!r}: auto, ivfpq or flat")
    tm = TranslationMemoryDir(tm_dir)
    wanted = [_lang_pair(p) for p in pairs.split(",")] if pairs else tm.language_pairs()
    if not wanted:
        typer.echo(f"{tm_dir}: no imported pairs (run `tolk tm import FILE...` first)", err=True)
        raise typer.Exit(2)
    embedder = MiniLMEmbedder()
    report = {}
    for langs in wanted:
        tm_pairs = tm.load_pairs(*langs)
        if not tm_pairs:
            typer.echo(f"{langs[0]}-{langs[1]}: no imported pairs", err=True)
            raise typer.Exit(2)
        try:
            kind = None if index == "auto" else cast(Literal["ivfpq", "flat"], index)
            params = choose_params(len(tm_pairs), embedder.dimension, kind=kind)
        except ValueError as exc:
            typer.echo(f"{langs[0]}-{langs[1]}: {exc}", err=True)
            raise typer.Exit(2) from exc
        built = PhraseIndex.build(tm.index_dir(*langs), tm_pairs, embedder, params=params)
        report[f"{langs[0]}-{langs[1]}"] = {
            "pairs": built.manifest.count,
            "kind": built.manifest.kind,
            "nlist": params.nlist,
            "m": params.m,
            "nbits": params.nbits,
            "nprobe": params.nprobe,
            "seconds": built.manifest.build_seconds,
            "bytes": (tm.index_dir(*langs) / "index.faiss").stat().st_size,
        }
        print(f"built {langs[0]}-{langs[1]}: {report[f'{langs[0]}-{langs[1]}']}", file=sys.stderr)
    typer.echo(json.dumps({"tm_dir": str(tm_dir), "indexes": report}))


@app.command()
def query(
    text: Annotated[str, typer.Argument(help="The sentence to look up.")],
    source_lang: Annotated[str, typer.Option("--from", help="Its language.")],
    target_lang: Annotated[str, typer.Option("--to", help="The target language.")],
    k: Annotated[int, typer.Option("-k", help="How many pairs.")] = 4,
    tm_dir: TMDirOpt = DEFAULT_TM_DIR,
) -> None:
    """The k TM pairs nearest to TEXT (opens the indexes memory-mapped, as a worker does)."""
    from workers.tm.embed import MiniLMEmbedder
    from workers.tm.phrase_index import IndexMismatchError, PhraseIndexes

    try:
        indexes = PhraseIndexes.open(tm_dir, MiniLMEmbedder())
    except IndexMismatchError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(2) from exc
    if (source_lang, target_lang) not in indexes.indexes:
        typer.echo(
            f"{tm_dir}: no index for {source_lang}-{target_lang} (built: "
            f"{', '.join(f'{s}-{t}' for s, t in indexes.language_pairs) or 'none'})",
            err=True,
        )
        raise typer.Exit(2)
    for n in indexes.nearest(source_lang, target_lang, text, k):
        typer.echo(
            json.dumps(
                {
                    "similarity": round(n.similarity, 4),
                    "source": n.pair.source,
                    "target": n.pair.target,
                    "origin": n.pair.origin,
                },
                ensure_ascii=False,
            )
        )


@app.command()
def status(tm_dir: TMDirOpt = DEFAULT_TM_DIR) -> None:
    """Pairs imported and indexed per language pair (an index older than its pairs is stale)."""
    from workers.tm.phrase_index import IndexMismatchError, Manifest
    from workers.tm.store import TranslationMemoryDir

    tm = TranslationMemoryDir(tm_dir)
    out = {}
    for langs in sorted(set(tm.language_pairs()) | set(tm.indexed_pairs())):
        imported = len(tm.load_pairs(*langs))
        entry: dict[str, object] = {"imported": imported}
        try:
            manifest = Manifest.read(tm.index_dir(*langs) / "manifest.json")
            entry.update(
                indexed=manifest.count,
                kind=manifest.kind,
                model=manifest.embedding_model,
                stale=manifest.count != imported,
            )
        except IndexMismatchError:
            entry.update(indexed=0, stale=True)
        out[f"{langs[0]}-{langs[1]}"] = entry
    typer.echo(json.dumps({"tm_dir": str(tm_dir), "pairs": out}))
