"""The names of the conversation-context stage's history layouts (`TOLK_CONTEXT_LAYOUT`,
`tolk worker --context`): checked at the edge with the other settings (workers/settings.py),
applied by the stage (workers/stages/context/rules.py, its notes, "History layout"). A leaf, like
workers/cache_ttl.py: settings may import it without importing a stage.
"""

from __future__ import annotations

__all__ = ["DEFAULT_LAYOUT", "LAYOUTS"]

LAYOUTS = ("direction", "dialogue")  # the same direction's turns only / both speakers' turns
DEFAULT_LAYOUT = "direction"
