"""Benchmark: the stacked trainer against the one-at-a-time loop on a real-data chapter grid.

The grid is the chapter's own (``ratios x seeds`` of ``--task`` in ``--profile``; 40 models in
the ``cpu`` profile). Every model is trained for ``--steps`` steps (default: the profile's, 2000
in ``cpu``) twice, in this one process, with the same data, configs, logging (training-set
subsample and the test probe) and seeds:

* **loop**: one model after the other with :func:`qkov_lib.training.train`;
* **stacked**: all models at once with :func:`qkov_lib.experiments.realdata.train_models`
  (:func:`qkov_lib.stacked.train_stacked`).

    QKOV_DATA_DIR=../shared/data .venv/bin/python benchmarks/bench_realdata.py             # SVA, cpu grid
    QKOV_DATA_DIR=../shared/data .venv/bin/python benchmarks/bench_realdata.py --task hatexplain --steps 200

The last line printed is ``speedup <ratio> x`` (stacked model-steps per second over the
loop's). Results, with the load average before and after, also go to ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from pathlib import Path

import torch

from qkov_lib.experiments import realdata
from qkov_lib.profiles import PROFILES, resolve
from qkov_lib.runtime import pick_device, torch_threads, versions
from qkov_lib.training import train


def uptime() -> str:
    """The ``uptime`` line (load averages), or the load averages alone where it is missing."""
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "load average: " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def write_json(path: Path, result: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--task", default="sva", choices=sorted(realdata.PROFILES), help="real-data chapter grid")
    ap.add_argument("--profile", default="cpu", choices=PROFILES, help="profile whose grid and data sizes are used")
    ap.add_argument("--steps", type=int, default=None, help="training steps per model (default: the profile's)")
    ap.add_argument("--loop-models", type=int, default=None,
                    help="time the loop on this many evenly spread grid cells (default: all, i.e. the same work)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the loop (default 1, its fastest)")
    ap.add_argument("--stack-threads", type=int, default=None, help="torch threads of the stacked run (default: --threads)")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    ap.add_argument("--data-dir", default=None, help="data folder (default: $QKOV_DATA_DIR)")
    ap.add_argument("--json", default="runs/bench_realdata.json", help="where to write the results ('' = nowhere)")
    args = ap.parse_args(argv)
    if args.steps is not None and args.steps < 1:
        ap.error("--steps must be >= 1")
    stack_threads = args.stack_threads or args.threads
    device = pick_device(args.device)
    cfg = resolve(realdata.PROFILES[args.task], args.profile)
    args.steps = args.steps or cfg["steps"]
    ds = realdata.load(cfg, args.data_dir)
    grid = [(float(r), s) for r in cfg["ratios"] for s in cfg["seeds"]]
    sub = grid if not args.loop_models else grid[:: max(1, len(grid) // args.loop_models)][: args.loop_models]
    result: dict = {"task": args.task, "profile": args.profile, "steps": args.steps, "device": str(device),
                    "cpu_count": os.cpu_count(), "uptime_before": uptime(), "n_models": len(grid),
                    "n_loop": len(sub), "train_instances": len(ds.train), "loop_threads": args.threads,
                    "stack_threads": stack_threads}
    print(f"{args.task} ({args.profile} grid): {len(grid)} models x {args.steps} steps on {device}; "
          f"{len(ds.train)} training instances, vocabulary {ds.vocab_size}, T = {ds.max_len}")
    print(f"  before: {result['uptime_before']}")

    with torch_threads(args.threads):
        loop_models = []
        t0 = time.perf_counter()
        for ratio, seed in sub:
            model = realdata.make_model(ds, cfg, seed).to(device)
            train(model, ds.train, realdata.train_config(cfg, ratio, seed, args.steps), probe=realdata.test_probe(ds))
            loop_models.append(model)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t_loop = time.perf_counter() - t0
    with torch_threads(stack_threads):
        t0 = time.perf_counter()
        models, _ = realdata.train_models(ds, cfg, grid, device, steps=args.steps)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t_stacked = time.perf_counter() - t0
    with torch.no_grad():
        diff = max(float((a - b).abs().max()) for m, cell in zip(loop_models, sub)
                   for a, b in zip(m.parameters(), models[grid.index(cell)].parameters()))
    loop_rate, stacked_rate = len(sub) * args.steps / t_loop, len(grid) * args.steps / t_stacked
    result.update(loop_s=t_loop, stacked_s=t_stacked, loop_model_steps_per_s=loop_rate,
                  stacked_model_steps_per_s=stacked_rate, speedup=stacked_rate / loop_rate, max_param_diff=diff,
                  uptime_after=uptime(), versions=versions())
    for name, what, rate, secs in (("loop", f"training.train, {len(sub)} models, {args.threads} thread(s)", loop_rate, t_loop),
                                   ("stacked", f"train_stacked, {len(grid)} models, {stack_threads} thread(s)",
                                    stacked_rate, t_stacked)):
        print(f"  {name:8s}({what}): {rate:8.0f} model-steps/s ({secs:.1f} s)")
    print(f"  largest parameter difference loop vs stacked: {diff:.1e}")
    print(f"  after: {result['uptime_after']}")
    if args.json:
        write_json(Path(args.json), result)
    print(f"speedup {stacked_rate / loop_rate:.1f} x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
