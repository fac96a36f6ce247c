"""Chapter profiles (``test``/``cpu``/``full``) and validated chapter parameters.

Every chapter's ``parameters`` cell holds plain literals (``profile = None``, overrides set to
``None``); :func:`resolve` turns them into a validated settings dict from the chapter's
profile table, so a papermill parameter of the wrong type fails with a clear message.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

PROFILES = ("test", "cpu", "full")
PROFILE_ENV = "QKOV_PROFILE"
def profile_table(base: Mapping[str, Any], test: Mapping[str, Any], cpu: Mapping[str, Any],
                  full: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """A chapter's profile table: the settings ``base`` shared by every profile, updated by each
    profile's own ``test``/``cpu``/``full`` settings."""
    return {"test": {**base, **test}, "cpu": {**base, **cpu}, "full": {**base, **full}}


def profile_name(profile: str | None) -> str:
    """``profile``, or ``$QKOV_PROFILE``, or ``"cpu"``; raises ValueError if unknown."""
    name = profile if profile is not None else os.environ.get(PROFILE_ENV, "cpu")
    if name not in PROFILES:
        raise ValueError(f"unknown profile {name!r}; expected one of {', '.join(PROFILES)}")
    return name


def _type_ok(value: Any, default: Any) -> bool:
    if isinstance(default, bool):
        return isinstance(value, bool)
    if isinstance(default, float):
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(default, int):
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(default, str):
        return isinstance(value, str)
    if isinstance(default, (list, tuple)):
        if not isinstance(value, (list, tuple)) or not value:
            return False
        return all(_type_ok(v, default[0]) for v in value) if default else True
    return True


def _type_name(default: Any) -> str:
    if isinstance(default, (list, tuple)):
        inner = _type_name(default[0]) if default else "value"
        return f"a non-empty list of {inner}s"
    return {bool: "bool", float: "number", int: "integer", str: "string"}.get(type(default), type(default).__name__)


def resolve(table: Mapping[str, Mapping[str, Any]], profile: str | None, **overrides: Any) -> dict[str, Any]:
    """Settings of ``profile`` from a chapter's profile ``table``, updated with the overrides
    that are not None. Each override must have the type of the profile's value (ints pass as
    floats, lists as tuples); a wrong type or unknown name raises TypeError/ValueError."""
    name = profile_name(profile)
    base = dict(table[name])
    for key, value in overrides.items():
        if value is None:
            continue
        if key not in base:
            raise ValueError(f"unknown parameter {key!r}; this chapter takes {', '.join(sorted(base))}")
        if base[key] is not None and not _type_ok(value, base[key]):
            raise TypeError(
                f"parameter {key!r} must be {_type_name(base[key])}, got {type(value).__name__} {value!r}"
                " (with papermill, pass lists as YAML: -y 'ratios: [1, 10]')"
            )
        base[key] = list(value) if isinstance(value, tuple) else value
    return {"profile": name, **base}


def settings_frame(cfg: Mapping[str, Any]):
    """The resolved settings as a two-column table (setting, value) for display."""
    import pandas as pd

    return pd.DataFrame({"setting": list(cfg), "value": [str(v) for v in cfg.values()]}).set_index("setting")
