"""replay.datasets: the one data-directory lookup and the readers over the repository's data/.

The lookup is `$TOLK_DATA_DIR` if set, else the checkout's `data/`; a missing directory or file
raises `DataNotFoundError` naming the path and the variable (tests and benchmarks must fail,
not skip or fall back). The reader cases pin the sizes the data README states.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from replay import datasets
from replay.datasets import (
    DataNotFoundError,
    bcontrast,
    data_dir,
    flores,
    mixed_translation_set,
    tatoeba_pairs,
    xsid_texts,
)

REPO_DATA = Path(__file__).resolve().parents[2] / "data"


def test_default_is_the_checkouts_data_dir(monkeypatch):
    monkeypatch.delenv("TOLK_DATA_DIR", raising=False)
    assert data_dir() == REPO_DATA
    assert (REPO_DATA / "README.md").is_file()


def test_env_var_moves_the_data_dir(monkeypatch, tmp_path):
    shutil.copytree(REPO_DATA / "xsid", tmp_path / "xsid")
    monkeypatch.setenv("TOLK_DATA_DIR", str(tmp_path))
    assert data_dir() == tmp_path
    assert xsid_texts("de") == xsid_texts("de", REPO_DATA)


def test_missing_dir_names_the_variable(monkeypatch, tmp_path):
    monkeypatch.setenv("TOLK_DATA_DIR", str(tmp_path / "nowhere"))
    with pytest.raises(DataNotFoundError, match=r"nowhere.*\$TOLK_DATA_DIR"):
        data_dir()


def test_missing_checkout_data_names_the_variable(monkeypatch, tmp_path):
    monkeypatch.delenv("TOLK_DATA_DIR", raising=False)
    monkeypatch.setattr(datasets, "REPO_DATA_DIR", tmp_path / "data")
    with pytest.raises(DataNotFoundError, match=r"checkout's data/ \(\$TOLK_DATA_DIR is unset\)"):
        data_dir()


def test_missing_file_names_the_file_and_the_variable(monkeypatch, tmp_path):
    monkeypatch.setenv("TOLK_DATA_DIR", str(tmp_path))  # exists, but holds no data set
    with pytest.raises(DataNotFoundError, match=r"tatoeba\.deu-eng\.eng.*TOLK_DATA_DIR"):
        tatoeba_pairs("de")
    assert issubclass(DataNotFoundError, FileNotFoundError)


def test_readers_return_the_documented_sizes():
    pairs = tatoeba_pairs("fr", REPO_DATA)
    assert len(pairs) == 1000 and all(en and fr for en, fr in pairs)
    assert len(flores("it", REPO_DATA)) == 1012
    assert len(xsid_texts("en", REPO_DATA)) == 300
    dev = list(bcontrast("dev", REPO_DATA))
    assert 1800 <= len(dev) <= 2000
    assert {(u.speaker, u.source_lang, u.target_lang) for u in dev} == {
        ("customer", "de", "en"),
        ("agent", "en", "de"),
    }


def test_mixed_set_interleaves_its_sources():
    mix = mixed_translation_set(12, REPO_DATA)
    assert len(mix) == 12
    directions = [(src, tgt) for _, src, tgt in mix[:6]]
    assert directions[:2] == [("en", "de"), ("fr", "en")]
    assert directions[3:] == [("en", "es"), ("it", "fr"), ("en", "it")]
