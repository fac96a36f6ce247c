"""Parameter values are checked by meaning (names, ranges, types) before anything trains."""

import math
import re

import jupytext
import pytest

from qkov_lib.tooling import cache, chapters

from qkov_lib import profiles
from qkov_lib.studies import realmap
from qkov_lib.studies import synthetic as exp

# Parameters that name a file or folder: free-form strings, checked where they are opened.
PATH_PARAMETERS = {"profile", "results_path", "results_dir", "data_dir"}


@pytest.mark.parametrize("name, value, msg", [
    # a choice: one of the four parameterizations, the optimizers, the embeddings, the datasets
    ("parameterizations", ["FAFO", "CACO", "XYZ"], r"'XYZ' is not allowed; expected a non-empty list of FAFO"),
    ("parameterizations", [], r"an empty list is not allowed"),
    ("parameterization", "FOFA", r"'FOFA' is not allowed; expected one of FAFO, CAFO, FACO, CACO"),
    ("optimizer", "adam", r"'adam' is not allowed; expected one of gd, sgd, adamw"),
    ("optimizers", ["adamw", "lion"], r"'lion' is not allowed"),
    ("embedding", "random", r"'random' is not allowed"),
    ("datasets", ["sva", "imdb"], r"'imdb' is not allowed"),
    # a rate or a ratio: finite and > 0
    ("eta_ov", -1e-3, r"'eta_ov' must be a finite number > 0"),
    ("eta_ov", 0.0, r"'eta_ov' must be a finite number > 0"),
    ("ratios", [1.0, math.inf], r"each value of 'ratios' must be a finite number > 0"),
    ("ratios", [1.0, math.nan], r"each value of 'ratios' must be a finite number > 0"),
    ("adamw_rates", [1e-3, -3e-3], r"each value of 'adamw_rates' must be a finite number > 0"),
    ("sgd_rates", [0.0], r"'sgd_rates' must be a finite number > 0"),
    # not a number where a number is meant
    ("adamw_rates", "fast", r"'fast' is not a number; 'adamw_rates' must be a non-empty list of values"),
    ("eta_ov", True, r"True is not a number"),
    # seeds: integers >= 0; counts: integers >= 1; fractions in (0, 1)
    ("seeds", [0, -1], r"each value of 'seeds' must be an integer >= 0"),
    ("map_seeds", [0.5], r"'map_seeds' must be an integer >= 0"),
    ("steps", 0, r"'steps' must be an integer >= 1"),
    ("adamw_steps", -5, r"'adamw_steps' must be an integer >= 1"),
    ("n_train", 0, r"'n_train' must be an integer >= 1"),
    ("d_model", 2.5, r"'d_model' must be an integer >= 1"),
    ("val_frac", 1.0, r"'val_frac' must be a number in \(0, 1\)"),
    ("weight_decay", -0.1, r"'weight_decay' must be a finite number >= 0"),
])
def test_a_value_out_of_its_range_is_refused_with_its_name(name, value, msg):
    with pytest.raises(ValueError, match=msg):
        profiles.check_value(name, value)


@pytest.mark.parametrize("name, value", [
    ("parameterizations", ["fafo", "CACO"]), ("optimizer", "gd"), ("ratios", [0.1, 1, 100]),
    ("seeds", [0, 1, 2]), ("steps", 1), ("n_train", None), ("val_frac", 0.1), ("weight_decay", 0.0),
    ("variants", [{"name": "x"}]), ("casting", "match+conv"),   # names without a rule pass
])
def test_allowed_values_pass(name, value):
    profiles.check_value(name, value)


def test_resolve_checks_values_as_well_as_types():
    with pytest.raises(ValueError, match="'XYZ' is not allowed"):
        profiles.resolve(exp.PROFILES, "test", parameterizations=["FAFO", "XYZ"])
    with pytest.raises(ValueError, match="'steps' must be an integer >= 1"):
        profiles.resolve(exp.PROFILES, "test", steps=-3)
    with pytest.raises(TypeError, match="'ratios' must be a non-empty list of numbers"):  # the type comes first
        profiles.resolve(exp.PROFILES, "test", ratios="abc")


def test_every_shipped_profile_passes_its_own_checks():
    import importlib
    import pkgutil

    import qkov_lib.studies as E

    n = 0
    for info in pkgutil.iter_modules(E.__path__):
        mod = importlib.import_module(f"qkov_lib.studies.{info.name}")
        for attr in (a for a in dir(mod) if a.endswith("PROFILES")):
            table = getattr(mod, attr)
            tables = [table] if set(table) == set(profiles.PROFILES) else list(table.values())
            for t in tables:
                for p in profiles.PROFILES:
                    profiles.resolve(t, p)
                    n += 1
    assert n >= 30   # every chapter's tables were found


def test_map_settings_are_checked_before_anything_trains(monkeypatch):
    def no_training(*a, **k):
        raise AssertionError("the map started training")

    monkeypatch.setattr(realmap, "run_map", no_training)
    monkeypatch.setattr(realmap, "load_splits", no_training)
    with pytest.raises(TypeError, match="'adamw_rates' must be a non-empty list of numbers, got str 'fast'"):
        realmap.map_config("hatexplain", "test", adamw_rates="fast")
    with pytest.raises(ValueError, match="each value of 'sgd_rates' must be a finite number > 0"):
        realmap.map_config("squad", "test", sgd_rates=[0.3, -1.0])
    with pytest.raises(ValueError, match="each value of 'map_seeds' must be an integer >= 0"):
        realmap.chapter_map("sva", "test", map_seeds=[-1])
    assert realmap.map_config("sva", "test", adamw_rates=[1e-3])["adamw_rates"] == [1e-3]


@pytest.mark.parametrize("src", cache.chapters(chapters.REPO_ROOT), ids=lambda p: p.stem)
def test_each_chapter_resolves_every_parameter_in_its_settings_cell(src):
    """The cell after the parameters cell hands every parameter to a checking resolver, so a bad
    value stops the chapter there, before any cell trains."""
    code = [c for c in jupytext.read(src).cells if c.cell_type == "code"]
    i = next(i for i, c in enumerate(code) if "parameters" in c.metadata.get("tags", []))
    settings = code[i + 1].source if i + 1 < len(code) else ""
    # dry_run and force control the run, not its settings: the cost check, the cell after, takes them
    preflight = code[i + 2].source if i + 2 < len(code) else ""
    unchecked = [p for p in chapters.chapter_parameters(src) if p not in PATH_PARAMETERS
                 and not re.search(rf"\b{p}\s*=\s*{p}\b", preflight if p in ("dry_run", "force") else settings)]
    assert not unchecked, f"{src.name}: parameters not resolved in the settings cell: {unchecked}"
    if any(p not in PATH_PARAMETERS for p in chapters.chapter_parameters(src)):
        assert "resolve(" in settings or "map_config(" in settings
