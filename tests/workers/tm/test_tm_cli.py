"""`tolk tm import` / `build` / `query` / `status` on small files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from workers.cli import app
from workers.tm.store import TranslationMemoryDir

TSV = (
    "source_lang\ttarget_lang\tsource\ttarget\n"
    "en\tde\tWhere is my order?\tWo ist meine Bestellung?\n"
    "en\tde\tI want to cancel my order.\tIch möchte meine Bestellung stornieren.\n"
    "en\tde\tThe parcel arrived damaged.\tDas Paket kam beschädigt an.\n"
    "en\tde\tbroken row\n"
    "en\tde\tCan I pay by card?\tKann ich mit Karte zahlen?\n"
    "de\ten\tVielen Dank!\tThank you very much!\n"
)


def _import(tmp_path: Path, *files: Path) -> dict[str, object]:
    result = CliRunner().invoke(
        app, ["tm", "import", *map(str, files), "--tm-dir", str(tmp_path / "tm")]
    )
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_import_reports_bad_rows_with_lines_and_skips_duplicates(tmp_path: Path) -> None:
    tsv = tmp_path / "support.tsv"
    tsv.write_text(TSV, encoding="utf-8")
    result = CliRunner().invoke(app, ["tm", "import", str(tsv), "--tm-dir", str(tmp_path / "tm")])
    assert result.exit_code == 0, result.output
    assert f"{tsv}:5: 3 columns, expected 4" in result.stderr
    summary = json.loads(result.stdout.strip().splitlines()[-1])["files"][str(tsv)]
    assert summary["added"] == {"en-de": 4, "de-en": 1}
    assert summary["problems"] == 1
    again = _import(tmp_path, tsv)["files"][str(tsv)]  # type: ignore[index]
    assert again["added"] == {"en-de": 0, "de-en": 0} and again["duplicates"] == 5
    tm = TranslationMemoryDir(tmp_path / "tm")
    assert tm.language_pairs() == [("de", "en"), ("en", "de")]
    assert [p.origin for p in tm.load_pairs("en", "de")] == [
        "support.tsv:2",
        "support.tsv:3",
        "support.tsv:4",
        "support.tsv:6",
    ]


def test_import_of_an_unknown_format_or_missing_file_exits_2(tmp_path: Path) -> None:
    csv_file = tmp_path / "tm.csv"
    csv_file.write_text("a,b\n")
    runner = CliRunner()
    for path in (csv_file, tmp_path / "missing.tsv"):
        result = runner.invoke(app, ["tm", "import", str(path), "--tm-dir", str(tmp_path)])
        assert result.exit_code == 2
    assert (
        "unknown TM format"
        in runner.invoke(app, ["tm", "import", str(csv_file), "--tm-dir", str(tmp_path)]).stderr
    )


@pytest.mark.slow
def test_import_build_query_status_with_minilm(tmp_path: Path) -> None:
    tsv = tmp_path / "support.tsv"
    tsv.write_text(TSV, encoding="utf-8")
    _import(tmp_path, tsv)
    runner = CliRunner()
    tm_dir = str(tmp_path / "tm")
    built = runner.invoke(app, ["tm", "build", "--tm-dir", tm_dir])
    assert built.exit_code == 0, built.output
    indexes = json.loads(built.stdout.strip().splitlines()[-1])["indexes"]
    assert indexes["en-de"]["pairs"] == 4 and indexes["en-de"]["kind"] == "flat"
    query = runner.invoke(
        app,
        [
            "tm",
            "query",
            "My package came broken",
            "--from",
            "en",
            "--to",
            "de",
            "-k",
            "2",
            "--tm-dir",
            tm_dir,
        ],
    )
    assert query.exit_code == 0, query.output
    hits = [json.loads(line) for line in query.stdout.strip().splitlines()]
    assert len(hits) == 2
    assert hits[0]["target"] == "Das Paket kam beschädigt an."
    assert hits[0]["similarity"] >= hits[1]["similarity"]
    status = json.loads(runner.invoke(app, ["tm", "status", "--tm-dir", tm_dir]).stdout)
    assert status["pairs"]["en-de"] == {
        "imported": 4,
        "indexed": 4,
        "kind": "flat",
        "model": "sentence-transformers/all-MiniLM-L6-v2",
        "stale": False,
    }
    # an index built by another embedding model stops `query` (as it would a worker's start)
    manifest = tmp_path / "tm" / "index" / "en-de" / "manifest.json"
    raw = json.loads(manifest.read_text())
    manifest.write_text(
        json.dumps({**raw, "embedding_model": "intfloat/e5-small", "dimension": 384})
    )
    refused = runner.invoke(
        app, ["tm", "query", "hi", "--from", "en", "--to", "de", "--tm-dir", tm_dir]
    )
    assert refused.exit_code == 2
    assert "built with embedding model 'intfloat/e5-small'" in refused.stderr
