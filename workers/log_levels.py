"""`--log-level` of the tolk commands: one parser for every spelling a user may give.

`tolk worker`, `tolk guard` and the other commands take a level name on the command line and
hand it to two consumers that disagree on spellings: Python's `logging` knows `DEBUG`, `INFO`,
`WARNING` (and the alias `WARN`), `ERROR`, `CRITICAL` (and `FATAL`), but not `crit`; faust's
worker (`mode.utils.logging.level_number`) upper-cases what it gets and asks `logging`, so it
takes the same names and turns an unknown one into the string "Level X" instead of failing.
Rewriting the text piecewise (`WARN` -> `WARNING`) breaks names that already contain the
shorter one (`WARNING` -> `WARNINGING`), so a level is looked up whole: `parse_log_level`
maps every accepted spelling (any case, the short forms `warn`, `crit`, `fatal`, and a level
number such as `30`) to its canonical name, which both consumers accept, and refuses anything
else with the list of names.
"""

from __future__ import annotations

import logging

__all__ = ["LOG_LEVELS", "parse_log_level"]

# canonical name -> the other spellings accepted for it (compared in lower case)
LOG_LEVELS: dict[str, tuple[str, ...]] = {
    "DEBUG": ("debug",),
    "INFO": ("info",),
    "WARNING": ("warning", "warn"),
    "ERROR": ("error", "err"),
    "CRITICAL": ("critical", "crit", "fatal"),
}
_BY_SPELLING = {alias: name for name, aliases in LOG_LEVELS.items() for alias in aliases}
_BY_NUMBER = {logging.getLevelName(name): name for name in LOG_LEVELS}


def parse_log_level(text: str) -> str:
    """The canonical level name (`"WARNING"`) of `text` (`"warning"`, `"WARN"`, `"30"`...);
    ValueError naming the accepted spellings for anything else."""
    key = text.strip().lower()
    if key in _BY_SPELLING:
        return _BY_SPELLING[key]
    if key.isdigit() and int(key) in _BY_NUMBER:
        return _BY_NUMBER[int(key)]
    accepted = ", ".join(alias for aliases in LOG_LEVELS.values() for alias in aliases)
    raise ValueError(f"unknown log level {text!r} (one of {accepted}, any case)")
