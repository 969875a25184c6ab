"""The `xsid` log format: xSID's CoNLL files, intent labels and all (issue #28).

xSID (data/xsid, docs in its SOURCE.md) holds the same 300 voice-assistant commands in several
languages, one `<lang>.valid.conll` file each, in the same order: a block per command of
`# key = value` comment lines (`# text`, `# intent`; the translated files also `# id` and
`# text-en`, the English command they translate) and then one line per token. Replaying it
measures how much of a command's meaning survives translation: the replay report's intent
agreement fits its classifier on the references' real intent labels.

- A translated file (`de.valid.conll`): each command becomes a record `<lang> -> en`, the
  reference its `text-en`, the intent its label.
- The English file: each command becomes one record `en -> <lang>` per translated file beside
  it, the reference that file's command in the same position (its `text-en` must be this
  command, or the pair is a problem). Without a translated file beside it there is nothing to
  translate it into: one problem.

Every command is a conversation of one turn (`xsid-<source>-<target>-<position>`). A block
without `# text` or `# intent` is a problem naming its line, and the reader goes on.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from pathlib import Path

from replay.log_records import KNOWN_LANGUAGES, LogItem, Problem, ReplayRecord, RowChecker

__all__ = ["read_xsid", "xsid_blocks"]

SUFFIX = ".valid.conll"


def xsid_blocks(path: Path) -> Iterator[tuple[int, dict[str, str]]]:
    """(line of the block's first line, its `# key = value` comments) per command."""
    block: dict[str, str] = {}
    first = 0
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if line.startswith("# "):
                key, sep, value = line[2:].partition(" = ")
                if sep:
                    block.setdefault("_", str(number))
                    block[key.strip()] = value.strip()
            elif not line.strip() and block:
                first = int(block.pop("_"))
                yield first, block
                block = {}
    if block:
        first = int(block.pop("_"))
        yield first, block


def _lang_of(path: Path) -> str:
    return path.name.removesuffix(SUFFIX)


def read_xsid(path: Path, known: Collection[str] = KNOWN_LANGUAGES) -> Iterator[LogItem]:
    """The records of one xSID file (see the module docstring)."""
    if not path.name.endswith(SUFFIX):
        yield Problem(str(path), f"not an xSID file (expected <lang>{SUFFIX})")
        return
    lang, checker = _lang_of(path), RowChecker(known)
    try:
        blocks = list(xsid_blocks(path))
    except UnicodeDecodeError as exc:
        yield Problem(str(path), f"bad encoding: {exc}")
        return
    if lang != "en":
        for position, (line, b) in enumerate(blocks):
            row = f"{path.name}:{line}"
            if not b.get("text") or not b.get("intent"):
                yield Problem(row, "malformed command: no `# text` or `# intent`")
                continue
            yield checker.check(
                ReplayRecord(
                    f"xsid-{lang}-en-{position}", 0, lang, "en", b["text"],
                    reference=b.get("text-en"), intent=b["intent"], sender="user", row=row,
                )
            )  # fmt: skip
        return
    translated = sorted(p for p in path.parent.glob(f"*{SUFFIX}") if _lang_of(p) != "en")
    if not translated:
        yield Problem(str(path), f"no translated xSID file (<lang>{SUFFIX}) beside it")
        return
    for other in translated:
        target = _lang_of(other)
        references = [b for _, b in xsid_blocks(other)]
        for position, (line, b) in enumerate(blocks):
            row = f"{path.name}:{line}->{target}"
            ref = references[position] if position < len(references) else {}
            if not b.get("text") or not b.get("intent"):
                yield Problem(row, "malformed command: no `# text` or `# intent`")
            elif ref.get("text-en") != b["text"] or not ref.get("text"):
                yield Problem(row, f"{other.name} has no translation of this command here")
            else:
                yield checker.check(
                    ReplayRecord(
                        f"xsid-en-{target}-{position}", 0, "en", target, b["text"],
                        reference=ref["text"], intent=b["intent"], sender="user", row=row,
                    )
                )  # fmt: skip
