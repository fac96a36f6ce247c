"""Benchmark: the stacked trainer against the one-model-at-a-time loop on the real-data maps,
and what one validation evaluation costs in training steps.

For each dataset, the map model of ``qkov_lib.studies.realmap.MAPS[<dataset>].profiles[<profile>]``
(``cpu`` by default) is built ``--models`` times (cells spread over the profile's ratios, seeds
0, 1, ...; AdamW at the profile's first AdamW base rate) and trained for ``--steps`` steps on
``--threads`` torch threads, with no validation and no early stopping:

* **stack**: all models at once, one :func:`qkov_lib.train.loop.train_stacked` call;
* **loop**: the same freshly built models one at a time, ``train_stacked([model], ...)`` each
  (what a per-run loop does);
* **evaluation**: one ``ModelStack(models).predict(val)`` of all the models on the validation
  split, against one stacked training step of all of them.

It prints, per dataset, wall milliseconds per model-step for the loop and the stack, their ratio
(loop / stack, above 1: the stack is faster), and the evaluation's cost in stacked training steps.
Clocks include the set-up inside each call (stacking the parameters, the optimizer), not the
building of the models. Before timing, a two-model stack runs one step (not timed) so that the
first call's one-off costs land outside the clocks.

    QKOV_DATA_DIR=../shared/data .venv/bin/python benchmarks/bench_map_engine.py
    QKOV_DATA_DIR=../shared/data .venv/bin/python benchmarks/bench_map_engine.py --datasets sva --models 8 --steps 5
    QKOV_DATA_DIR=../shared/data .venv/bin/python benchmarks/bench_map_engine.py --datasets sva --models 18 --steps 150 --set d_model 64
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import time

from qkov_lib import protocol, runtime
from qkov_lib.studies import realmap
from qkov_lib.train import TrainConfig, train_stacked
from qkov_lib.train.loop import ModelStack


def cells(cfg: dict, n_models: int) -> list[protocol.Cell]:
    """``n_models`` AdamW cells at the first AdamW base rate of ``cfg``: the ratios of ``cfg``
    in turn, each with the next seed (0, 1, ...)."""
    ratios = itertools.cycle(float(r) for r in cfg["ratios"])
    return [protocol.Cell("adamw", float(cfg["adamw_rates"][0]), next(ratios), s) for s in range(n_models)]


def bench_config(cfg: dict, cell: protocol.Cell, steps: int) -> TrainConfig:
    """The map's config of ``cell`` cut to ``steps`` steps, with no logging between the ends, no
    validation and no early stopping."""
    return dataclasses.replace(realmap.cell_config(cfg, cell), steps=steps, log_every=10**6, patience=None)


def timed(fn) -> float:
    """Wall seconds of ``fn()``."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_dataset(name: str, profile: str, n_models: int, steps: int, threads: int, data_dir=None,
                  overrides: dict | None = None) -> dict:
    """The three timings of one dataset (module docstring): milliseconds per model-step of the
    stack and of the loop, their ratio, and one evaluation of all the models in milliseconds and
    in stacked training steps. ``overrides``: map settings replacing the profile's (e.g. ``d_model``)."""
    cfg = realmap.map_config(name, profile, **(overrides or {}))
    ds, val = realmap.load_splits(name, cfg, data_dir)
    grid = cells(cfg, n_models)
    cfgs = [bench_config(cfg, c, steps) for c in grid]

    def fresh():
        return [realmap.make_model(ds, cfg, c.seed) for c in grid]

    warm = fresh()[:2]
    train_stacked(warm, ds.train, [dataclasses.replace(c, steps=1) for c in cfgs[:2]], progress=False, threads=threads)

    models = fresh()
    stack_s = timed(lambda: train_stacked(models, ds.train, cfgs, progress=False, threads=threads))
    alone = fresh()
    loop_s = timed(lambda: [train_stacked([m], ds.train, [c], progress=False, threads=threads)
                            for m, c in zip(alone, cfgs)])
    with runtime.torch_threads(threads):
        eval_s = timed(lambda: ModelStack(models).predict(val))

    stack_ms, loop_ms = 1000 * stack_s / (n_models * steps), 1000 * loop_s / (n_models * steps)
    step_ms = 1000 * stack_s / steps  # one stacked step of all the models
    return {"dataset": name, "profile": profile, "overrides": dict(overrides or {}), "models": n_models, "steps": steps, "threads": threads,
            "n_train": len(ds.train), "n_val": len(val), "seq_len": int(ds.train.tokens.shape[1]),
            "batch_size": cfgs[0].batch_size, "stack_ms_per_model_step": stack_ms,
            "loop_ms_per_model_step": loop_ms, "loop_over_stack": loop_ms / stack_ms,
            "stack_ms_per_step": step_ms, "eval_ms": 1000 * eval_s, "eval_in_steps": 1000 * eval_s / step_ms}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--datasets", nargs="+", default=list(realmap.DATASETS), choices=list(realmap.DATASETS))
    p.add_argument("--profile", default="cpu", help="map profile whose model and data are timed")
    p.add_argument("--models", type=int, default=36, help="models per dataset")
    p.add_argument("--steps", type=int, default=20, help="training steps per model")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--set", nargs=2, action="append", default=[], metavar=("NAME", "VALUE"),
                   help="map setting replacing the profile's, VALUE as JSON (e.g. --set d_model 64); repeatable")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    a = p.parse_args(argv)
    try:
        overrides = {k: json.loads(v) for k, v in a.set}
    except json.JSONDecodeError as e:
        p.error(f"--set VALUE must be JSON: {e}")
    if a.models < 1 or a.steps < 1 or a.threads < 1:
        p.error("--models, --steps and --threads must be positive")
    out = {"load_average_before": list(os.getloadavg()), "results": []}
    for name in a.datasets:
        r = bench_dataset(name, a.profile, a.models, a.steps, a.threads, overrides=overrides)  # data: $QKOV_DATA_DIR
        out["results"].append(r)
        print(f"{name}{''.join(f' {k}={v}' for k, v in overrides.items())}: {r['models']} models x {r['steps']} steps, {r['threads']} thread(s), batch {r['batch_size']}, "
              f"length {r['seq_len']}; ms per model-step: loop {r['loop_ms_per_model_step']:.2f}, "
              f"stack {r['stack_ms_per_model_step']:.2f} (loop/stack {r['loop_over_stack']:.2f}x); "
              f"one evaluation of all models on {r['n_val']:,} validation rows: {r['eval_ms']:.0f} ms "
              f"= {r['eval_in_steps']:.1f} stacked training steps", flush=True)
    out.update(load_average_after=list(os.getloadavg()), versions=runtime.versions())
    print(f"load average before {out['load_average_before'][0]:.2f}, after {out['load_average_after'][0]:.2f}")
    if a.json:
        path = runtime.write_json(a.json, out)
        print(f"results: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
