"""Benchmark: stacked training with and without length buckets (``TrainConfig.length_buckets``).

For each workload it builds ``--models`` analysed-head models and trains them as one stack for
``--steps`` steps on one torch thread, once per ``--buckets`` value, in one process (the same models,
freshly built, each time), with a validation evaluation at the middle and the end:

* ``natural``: SVA's natural-prefix models (``agreement_roles.NATURAL_PROFILES["cpu"]``; rows
  average 8.5 of 48 tokens), ratios 1 and 10 in turn, seeds 0, 1, ...;
* ``sva``, ``hatexplain``, ``squad``: the map model of ``realmap.MAPS[<dataset>].profiles["cpu"]``
  (AdamW at its first base rate, its ratios in turn).

It prints wall milliseconds per stacked step (evaluations included) and the speed-up over one bucket,
and the last validation loss of the first model under each setting (the same up to float rounding,
which these float32 runs amplify over many steps).

    QKOV_DATA_DIR=../shared/data .venv/bin/python benchmarks/bench_length_buckets.py
    QKOV_DATA_DIR=../shared/data .venv/bin/python benchmarks/bench_length_buckets.py --workloads natural sva --models 4
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from bench_map_engine import bench_config, cells  # the map cells that benchmark times (run from benchmarks/)
from qkov_lib.studies import agreement_roles, realmap
from qkov_lib.train import TrainConfig, train_stacked


def workload(name: str, n_models: int, steps: int, data_dir=None):
    """``(make_models, train, val, configs)`` of one workload (module docstring)."""
    half = max(1, steps // 2)
    if name == "natural":
        cfg = agreement_roles.NATURAL_PROFILES["cpu"]
        ds = agreement_roles.load_natural(cfg, data_dir)
        train, val = agreement_roles.split_validation(ds.train, cfg["val_frac"], cfg["data_seed"])
        runs = [(10.0 if i % 2 else 1.0, i // 2) for i in range(n_models)]  # (ratio, seed)
        cfgs = [dataclasses.replace(agreement_roles.natural_train_config(cfg, r, s), steps=steps, log_every=half,
                                    patience=None) for r, s in runs]
        return (lambda: [agreement_roles.make_natural_model(ds, cfg, s) for _, s in runs]), train, val, cfgs
    cfg = realmap.map_config(name, "cpu")
    ds, val = realmap.load_splits(name, cfg, data_dir)
    grid = cells(cfg, n_models)
    cfgs = [dataclasses.replace(bench_config(cfg, c, steps), log_every=half) for c in grid]
    return (lambda: [realmap.make_model(ds, cfg, c.seed) for c in grid]), ds.train, val, cfgs


def warmed_workload(name: str, n_models: int, steps: int, data_dir=None):
    """:func:`workload`, after one untimed step of two of its models: the first call's one-off costs
    land outside the clocks."""
    make, train, val, cfgs = workload(name, n_models, steps, data_dir)
    train_stacked(make()[:2], train, [dataclasses.replace(c, steps=1, log_every=None) for c in cfgs[:2]],
                  progress=False, threads=1)
    return make, train, val, cfgs


def bench(name: str, n_models: int, steps: int, buckets: list[int]) -> list[dict]:
    """One row per bucket count: ms per stacked step and the first model's last validation loss."""
    make, train, val, cfgs = warmed_workload(name, n_models, steps)
    rows = []
    for k in buckets:
        models, run = make(), [TrainConfig(**{**c.__dict__, "length_buckets": k}) for c in cfgs]
        t0 = time.perf_counter()
        hists = train_stacked(models, train, run, val=val, progress=False, threads=1)
        rows.append({"workload": name, "buckets": k, "ms_per_step": 1e3 * (time.perf_counter() - t0) / steps,
                     "val_loss": hists[0].records[-1]["val_loss"]})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", nargs="+", default=["natural", "sva", "hatexplain"],
                    choices=["natural", "sva", "hatexplain", "squad"])
    ap.add_argument("--models", type=int, default=8)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--buckets", type=int, nargs="+", default=[1, 2, 4])
    a = ap.parse_args()
    for name in a.workloads:
        rows = bench(name, a.models, a.steps, a.buckets)
        base = rows[0]["ms_per_step"]
        for r in rows:
            print(f"{name:10s} buckets {r['buckets']}: {r['ms_per_step']:7.1f} ms/step  "
                  f"speed-up {base / r['ms_per_step']:.2f}x  val loss {r['val_loss']:.6f}")


if __name__ == "__main__":
    main()
