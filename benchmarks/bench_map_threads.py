"""Benchmark: one torch thread, two threads, or two one-thread processes for the stacked models
of a real-data protocol map.

For each dataset, the map model of ``qkov_lib.studies.realmap.MAPS[<dataset>].profiles["cpu"]``
is built ``--models`` times and trained for ``--steps`` AdamW steps (:func:`qkov_lib.train.loop.
train_stacked`): as one stack with one torch thread, as one stack with two, and as two stacks of
half the models in two spawned one-thread processes at once (what a map with one process per
optimizer would do), with the same models, data and seeds. It prints wall milliseconds per step
of all the models for each, and the ratios to one thread (above 1: faster than one thread).

    QKOV_DATA_DIR=../shared/data .venv/bin/python benchmarks/bench_map_threads.py
    QKOV_DATA_DIR=../shared/data .venv/bin/python benchmarks/bench_map_threads.py --dataset squad --models 20
"""

from __future__ import annotations

import argparse
import os
import time

from qkov_lib import profiles, protocol
from qkov_lib.studies import realmap
from qkov_lib.train import train_stacked


def ms_per_step(ds, cfg, n_models: int, steps: int, threads: int, barrier=None, out=None) -> float:
    """Wall milliseconds per step of ``n_models`` stacked map models trained ``steps`` steps
    (the clock starts after the models are built, and after ``barrier`` when one is given; the
    result also goes to the queue ``out`` when one is given)."""
    cells = [protocol.Cell("adamw", 1e-3, 1.0, s) for s in range(n_models)]
    models = [realmap.make_model(ds, cfg, c.seed) for c in cells]
    cfgs = [realmap.cell_config({**cfg, "adamw_steps": steps, "patience": None}, c) for c in cells]
    if barrier is not None:
        barrier.wait()
    t0 = time.perf_counter()
    train_stacked(models, ds.train, cfgs, progress=False, threads=threads)
    ms = 1000 * (time.perf_counter() - t0) / steps
    if out is not None:
        out.put(ms)
    return ms


def ms_per_step_two_processes(ds, cfg, n_models: int, steps: int) -> float:
    """Wall milliseconds per step of all ``n_models`` models when two spawned one-thread
    processes each train half of them at the same time: the slower child's time, both clocks
    started together after a barrier. Spawn, not fork: a process forked after torch ran with two
    threads can hang in the OpenMP pool."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(2), ctx.Queue()
    half = n_models // 2
    procs = [ctx.Process(target=ms_per_step, args=(ds, cfg, k, steps, 1, barrier, out))
             for k in (half, n_models - half)]
    for q in procs:
        q.start()
    times = [out.get() for _ in procs]
    for q in procs:
        q.join()
        if q.exitcode:
            raise RuntimeError(f"a benchmark process failed with exit code {q.exitcode}")
    return max(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", nargs="+", default=list(realmap.DATASETS))
    p.add_argument("--models", type=int, default=40)
    p.add_argument("--steps", type=int, default=50)
    a = p.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    for name in a.dataset:
        cfg = profiles.resolve(realmap.MAPS[name].profiles, "cpu")
        ds, _ = realmap.load_splits(name, cfg)
        one, two = (ms_per_step(ds, cfg, a.models, a.steps, t) for t in (1, 2))
        procs = ms_per_step_two_processes(ds, cfg, a.models, a.steps)
        print(f"{name}: {a.models} models, ms/step: {one:.1f} with 1 thread, {two:.1f} with 2 threads, {procs:.1f} "
              f"with 2 one-thread processes; speed-up over 1 thread {one / two:.2f} and {one / procs:.2f}")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
