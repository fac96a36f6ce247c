"""Chapter profiles (``test``/``cpu``/``full``) and validated chapter parameters.

Every chapter's ``parameters`` cell holds plain literals (``profile = None``, overrides set to
``None``); :func:`resolve` turns them into a validated settings dict from the chapter's
profile table, so a papermill parameter of the wrong type fails with a clear message.

Values are checked twice, both before anything trains: :func:`check_value` knows the shared
parameter names by their meaning (a parameterization is one of FAFO/CAFO/FACO/CACO, a rate or a
ratio is a finite number > 0, a seed an integer >= 0, a step or size count an integer >= 1, a
fraction lies in (0, 1), ``force`` and ``dry_run`` are booleans, a path a string, a profile one of
:data:`PROFILES` as spelt there) and needs no profile table, so ``qkov run`` and ``qkov sweep`` apply it
to ``-p``/``-g`` values before a kernel starts; :func:`resolve` applies it to every resolved
setting, and checks the type of each override against the profile's value.

A dry run (:func:`set_dry_run`, :func:`cap_steps`) keeps a profile's models, training data and grids
but caps every step count, evaluates each run at its start and its end only, on
:data:`DRY_RUN_EVAL_ROWS` rows of each evaluation split, so the ``full`` profile's shapes and code
paths run on a CPU in minutes.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from typing import Any

PROFILES = ("test", "cpu", "full")
PROFILE_ENV = "QKOV_PROFILE"
DRY_RUN_ENV = "QKOV_DRY_RUN"
#: step budget of every run in a dry run
DRY_RUN_STEPS = 20
#: evaluation interval (a key ending in ``every``) of a dry run, in step caps: longer than any capped
#: run (a map's slower base rates get at most twice the cap, ``max_step_scale``), so every run
#: evaluates at its start and at its end only. At half the cap, SQuAD's 200 runs evaluated their
#: validation rows every 10 steps: 5 stacked evaluations a run where 2 show the same shapes
DRY_RUN_EVERY_CAPS = 2
# step counts (steps, adamw_steps, full_steps, warmup_steps...) and evaluation intervals by name
_STEP_KEY = re.compile(r"(^|_)steps$")
_EVERY_KEY = re.compile(r"(^|_)every$")
#: instances scored one by one after each run (ERASER's per-instance deletions) in a dry run: the
#: score's code path and shapes, not its precision; the splits themselves keep their size
DRY_RUN_SAMPLES = 64
_SAMPLE_KEY = re.compile(r"^n_eraser$")
#: logged points of a run that logs on a log-spaced grid (``n_logs``) in a dry run: 0, two between, the end
#: (a 20-step run with the full multi-layer profile's 20 points evaluated its monitor after 14 of them)
DRY_RUN_LOGS = 4
_LOGS_KEY = re.compile(r"^n_logs$")
#: rows of each evaluation split (validation, test) in a dry run, evenly spaced
#: (:func:`qkov_lib.data.text.dry_run_split`): evaluating every run of a full grid on SQuAD's 4,910
#: validation questions every few steps costs most of a dry run and shows no shape the sample does not
#: (stacked evaluation runs in chunks of fewer rows); the training splits keep their size
DRY_RUN_EVAL_ROWS = 512
_dry_run: bool = False  # set by set_dry_run: every later resolve() caps its steps

#: Allowed values of the categorical parameters the chapters share (a list-valued parameter of
#: the same meaning, e.g. ``parameterizations``, takes a non-empty list of them).
CHOICES: dict[str, tuple[str, ...]] = {
    "parameterization": ("FAFO", "CAFO", "FACO", "CACO"),
    "parameterizations": ("FAFO", "CAFO", "FACO", "CACO"),
    "optimizer": ("gd", "sgd", "adamw"),
    "optimizers": ("adamw", "sgd"),
    "embedding": ("onehot", "gaussian"),
    "dataset": ("sva", "hatexplain", "squad"),
    "datasets": ("sva", "hatexplain", "squad"),
}
#: Parameters that are True or False (a JSON boolean on the command line: ``-p force true``).
BOOLEANS = ("force", "dry_run")
#: Parameters that name a file or folder: a string (a path), or None for the chapter's default.
PATHS = ("results_path", "results_dir", "data_dir")
#: Numeric parameters that take a list of values (``ratios``, ``map_seeds``, ``s2_losses``...); the
#: others (``steps``, ``n_heads``, ``processes``...) take one, whatever their name ends with.
_LIST_KEY = re.compile(r"(^|_)(ratios|rates|seeds|losses|scales|ladder|etas_convergence)$")
# Numeric parameters by name (each element of a list is checked): (pattern, test, what it must be).
_NUMERIC: tuple[tuple[re.Pattern, Any, str], ...] = tuple((re.compile(p), f, w) for p, f, w in (
    (r"(^|_)(ratios?|rates|etas_convergence)$|^eta_|_eta_ov$|^matched_loss$|^loss_ladder$|^t_max$|^init_scale$|^q0|^w0$",
     lambda v: math.isfinite(v) and v > 0, "a finite number > 0"),
    (r"(^|_)seeds?$", lambda v: float(v).is_integer() and v >= 0, "an integer >= 0"),
    (r"(^|_)steps$|^n_(?!val$)|^d_|^dim_|^max_len|_max_len$|^batch_size$|^eval_every$|^log_every$|^patience$"
     r"|^kernel$|^window$|^min_freq$|^threads$|^processes$|^layers$|^oov_buckets$|^check_points$|^log_subsample$|^monitor_rows$",
     lambda v: float(v).is_integer() and v >= 1, "an integer >= 1"),
    (r"_frac$", lambda v: 0 < v < 1, "a number in (0, 1)"),
    (r"^weight_decay$|^dropout$", lambda v: math.isfinite(v) and v >= 0, "a finite number >= 0"),
))


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def check_value(name: str, value: Any) -> None:
    """Raise ValueError when ``value`` is not an allowed value of parameter ``name`` by its
    meaning (:data:`CHOICES` and the numeric rules above); None and names without a rule pass.
    Types against a profile's defaults are :func:`resolve`'s job."""
    if value is None:
        return
    if name == "profile":
        try:
            profile_name(value)
        except ValueError as e:
            raise ValueError(f"parameter 'profile': {e}") from None
        return
    if name in BOOLEANS or name in PATHS:
        ok = isinstance(value, bool) if name in BOOLEANS else isinstance(value, (str, os.PathLike)) and str(value)
        if not ok:
            what = ("true or false (a JSON boolean: -p " + name + " true)" if name in BOOLEANS
                    else "a path: a non-empty string (-p " + name + " '\"/some/path\"')")
            raise ValueError(f"parameter {name!r} must be {what}, got {type(value).__name__} {value!r}")
        return
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    if name in CHOICES:
        allowed = CHOICES[name]
        bad = [v for v in items if not isinstance(v, str) or v.upper() not in {a.upper() for a in allowed}]
        if bad or not items:
            raise ValueError(f"parameter {name!r}: {', '.join(map(repr, bad)) or 'an empty list'} "
                             f"{'is' if len(bad) <= 1 else 'are'} not allowed; expected "
                             f"{'a non-empty list of ' if name.endswith('s') else 'one of '}{', '.join(allowed)}")
        return
    for pattern, ok, what in _NUMERIC:
        if pattern.search(name):
            for v in items:
                # a list parameter is named as such; a scalar one ("steps", "n_heads") given a string is
                # told it takes a number, whatever its name ends with
                listed = isinstance(value, (list, tuple)) or bool(_LIST_KEY.search(name))
                each = "each value of " if isinstance(value, (list, tuple)) else ""
                if v is not None and not _number(v):
                    shape = f"a non-empty list of values, each {what}" if listed and not each else what
                    example = "'[1, 10]'" if listed else "10"
                    raise ValueError(f"parameter {name!r}: {v!r} is not a number; {each}{name!r} must be {shape}"
                                     + (f" (numbers take no quotes on the command line: -p {name} {example})"
                                        if isinstance(v, str) else ""))
                if v is not None and not ok(v):
                    raise ValueError(f"parameter {name!r}: {v!r} is not allowed; {each}{name!r} must be {what}")
            return


def check_values(values: Mapping[str, Any]) -> None:
    """:func:`check_value` for every item of ``values`` (e.g. the ``-p`` overrides of a run)."""
    for name, value in values.items():
        check_value(name, value)


def env_dry_run() -> bool:
    """``$QKOV_DRY_RUN`` as a bool (unset or empty: False); ValueError on anything but
    1/0, true/false, yes/no, on/off."""
    raw = os.environ.get(DRY_RUN_ENV, "").strip().lower()
    if raw in ("", "0", "false", "no", "off"):
        return False
    if raw in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"${DRY_RUN_ENV}={raw!r}: expected 1 or 0 (true/false, yes/no, on/off)")


def set_dry_run(on: bool) -> None:
    """Make every later :func:`resolve` in this process cap its step counts (:func:`cap_steps`)
    when ``on``; what a chapter resolved before its dry run started is capped by the caller."""
    global _dry_run
    if not isinstance(on, bool):
        raise TypeError(f"dry_run must be True or False, got {type(on).__name__} {on!r}")
    _dry_run = on


def dry_run_active() -> bool:
    """Whether :func:`set_dry_run` turned the dry run on in this process."""
    return _dry_run


def cap_steps(cfg: Mapping[str, Any], cap: int = DRY_RUN_STEPS) -> dict[str, Any]:
    """A copy of the settings ``cfg`` with every step count (a key ending in ``steps``) at most
    ``cap``, every interval (a key ending in ``every``: evaluation, logging) :data:`DRY_RUN_EVERY_CAPS`
    times ``cap``, so a capped run evaluates at its start and its end only, the log-spaced points of
    a run (``n_logs``) at most :data:`DRY_RUN_LOGS`, and the instances scored one by one after each
    run (``n_eraser``) at most :data:`DRY_RUN_SAMPLES`. Everything else (models, data sizes, grids)
    is kept."""
    if isinstance(cap, bool) or not isinstance(cap, int) or cap < 2:
        raise ValueError(f"the dry-run step cap must be an integer >= 2, got {cap!r}")
    out = dict(cfg)
    for key, value in cfg.items():
        if not _number(value):
            continue
        if _STEP_KEY.search(key):
            out[key] = min(int(value), cap)
        elif _EVERY_KEY.search(key):
            out[key] = DRY_RUN_EVERY_CAPS * cap
        elif _SAMPLE_KEY.search(key):
            out[key] = min(int(value), DRY_RUN_SAMPLES)
        elif _LOGS_KEY.search(key):
            out[key] = min(int(value), DRY_RUN_LOGS)
    return out


def profile_table(base: Mapping[str, Any], test: Mapping[str, Any], cpu: Mapping[str, Any],
                  full: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """A chapter's profile table: the settings ``base`` shared by every profile, updated by each
    profile's own ``test``/``cpu``/``full`` settings."""
    return {"test": {**base, **test}, "cpu": {**base, **cpu}, "full": {**base, **full}}


def profile_name(profile: str | None) -> str:
    """``profile``, or ``$QKOV_PROFILE``, or ``"cpu"``; raises ValueError if unknown."""
    name = profile if profile is not None else os.environ.get(PROFILE_ENV, "cpu")
    if name not in PROFILES:
        near = next((p for p in PROFILES if isinstance(name, str) and p == name.strip().lower()), None)
        hint = f" (profile names are lower case: did you mean {near!r}?)" if near else ""
        raise ValueError(f"unknown profile {name!r}; expected one of {', '.join(PROFILES)}{hint}")
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
    floats, lists as tuples) and every setting an allowed value (:func:`check_value`); a wrong
    type raises TypeError, an unknown name or a value out of range ValueError. In a dry run
    (:func:`set_dry_run`) the step counts are capped (:func:`cap_steps`)."""
    name = profile_name(profile)
    base = dict(table[name])
    for key, value in overrides.items():
        if value is None:
            continue
        if key not in base:
            raise ValueError(f"unknown parameter {key!r}; this chapter takes {', '.join(sorted(base))}")
        if base[key] is not None and not _type_ok(value, base[key]):
            # the hint fits what is expected: a list's syntax for a list, an integer's for an integer
            hint = (" (a list on the command line: qkov run -p ratios '[1, 10]', papermill -y 'ratios: [1, 10]')"
                    if isinstance(base[key], (list, tuple)) else
                    f" (an integer is written without a point or an exponent: -p {key} {base[key]!r})"
                    if type(base[key]) is int else "")
            raise TypeError(f"parameter {key!r} must be {_type_name(base[key])}, got {type(value).__name__} {value!r}"
                            + hint)
        base[key] = list(value) if isinstance(value, tuple) else value
    check_values(base)
    if _dry_run:
        base = cap_steps(base)
    return {"profile": name, **base}


def settings_frame(cfg: Mapping[str, Any]):
    """The resolved settings as a two-column table (setting, value) for display."""
    import pandas as pd

    return pd.DataFrame({"setting": list(cfg), "value": [str(v) for v in cfg.values()]}).set_index("setting")
