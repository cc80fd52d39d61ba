"""The one check for a closed-set config value, so every `key=value` refusal reads the same.

Used by each component's config validator (ParallelConfig, the trainer sections) and by the
modules that take the same value as a plain argument; it raises ValueError, which the config
loader turns into its one-line ConfigError.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence


def check_choice(key: str, value: object, allowed: Sequence[str]) -> None:
    """Raise ValueError naming `key`, the allowed values and the closest one, if any."""
    if value in allowed:
        return
    close = difflib.get_close_matches(str(value), list(allowed), n=1)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    raise ValueError(f"{key}={value!r} is not allowed; choose one of {', '.join(allowed)}{hint}")
