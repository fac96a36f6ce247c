"""Benchmark: one vs two torch threads for the stacked models of a real-data protocol map.

For each dataset, the map model of ``qkov_lib.experiments.realmap.PROFILES[<dataset>]["cpu"]``
is built ``--models`` times and trained for ``--steps`` AdamW steps as one stack
(:func:`qkov_lib.stacked.train_stacked`), once with one torch thread and once with two, in this
one process, with the same models, data and seeds. It prints milliseconds per stacked step for
both and their ratio (``threads 1 / threads 2``: above 1 means two threads are faster).

    QKOV_DATA_DIR=../shared/data .venv/bin/python benchmarks/bench_map_threads.py
    QKOV_DATA_DIR=../shared/data .venv/bin/python benchmarks/bench_map_threads.py --dataset squad --models 20
"""

from __future__ import annotations

import argparse
import os
import time

from qkov_lib import profiles
from qkov_lib.experiments import protocol, realmap
from qkov_lib.stacked import train_stacked


def ms_per_step(ds, cfg, n_models: int, steps: int, threads: int) -> float:
    """Wall milliseconds per step of ``n_models`` stacked map models trained ``steps`` steps."""
    cells = [protocol.Cell("adamw", 1e-3, 1.0, s) for s in range(n_models)]
    models = [realmap.make_model(ds, cfg, c.seed) for c in cells]
    cfgs = [realmap.cell_config({**cfg, "adamw_steps": steps, "patience": None}, c) for c in cells]
    t0 = time.perf_counter()
    train_stacked(models, ds.train, cfgs, progress=False, threads=threads)
    return 1000 * (time.perf_counter() - t0) / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", nargs="+", default=list(realmap.DATASETS))
    p.add_argument("--models", type=int, default=40)
    p.add_argument("--steps", type=int, default=50)
    a = p.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    for name in a.dataset:
        cfg = profiles.resolve(realmap.PROFILES[name], "cpu")
        ds, _ = realmap.load_splits(name, cfg)
        one, two = (ms_per_step(ds, cfg, a.models, a.steps, t) for t in (1, 2))
        print(f"{name}: {a.models} models, {one:.1f} ms/step with 1 thread, {two:.1f} with 2: ratio {one / two:.2f}")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
