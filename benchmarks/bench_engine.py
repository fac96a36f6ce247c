"""Benchmark: the batched engine against the one-at-a-time loop, and the sweep chapter's wall time.

Throughput is measured in model-steps per second on the main grid of the sweep chapter's
profile (parameterization x ratio x seed): every grid cell is trained for ``--steps`` steps
once with ``qkov_lib.train.train`` (one model after the other) and once with
``qkov_lib.train.engine.train_batched`` (all at once), in this one process, with the same data,
configs, logging and probe. The chapter is timed end to end with
``python -m qkov_lib run sweep`` in a subprocess.

    .venv/bin/python benchmarks/bench_engine.py                  # cpu profile, chapter included
    .venv/bin/python benchmarks/bench_engine.py --no-chapter     # throughput only (about a minute)

The last line printed is ``speedup <ratio>x``. Results also go to ``--json``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time


from qkov_lib import profiles, runtime
from qkov_lib.studies import synthetic_sweeps


def chapter_wall_time(profile: str, out_dir: str) -> float:
    """Seconds to execute the sweep chapter with ``profile`` through the library's CLI."""
    env = {**os.environ, "QKOV_PROFILE": profile}
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "qkov_lib", "run", "sweep", "--out", out_dir], check=True, env=env,
                   cwd=runtime.REPO_ROOT)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default="cpu", choices=profiles.PROFILES, help="sweep profile whose grid is timed")
    ap.add_argument("--steps", type=int, default=200, help="training steps per model in the throughput test")
    ap.add_argument("--loop-models", type=int, default=None,
                    help="time the loop on this many evenly spread grid cells (default: all, i.e. the same work)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads for both the loop and the engine (default 1, the engine's default; "
                         "0 = torch's own default)")
    ap.add_argument("--no-chapter", action="store_true", help="skip timing the chapter")
    ap.add_argument("--out", default=None, help="folder for the chapter's notebook (default: a temp folder)")
    ap.add_argument("--json", default="runs/bench_engine.json", help="where to write the results")
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error("--steps must be >= 1")
    threads = args.threads or None
    cfg = profiles.resolve(synthetic_sweeps.PROFILES, args.profile)
    result: dict = {"profile": args.profile, "cpu_count": os.cpu_count(),
                    "load_average_before": list(os.getloadavg())}

    if not args.no_chapter:
        out = args.out or tempfile.mkdtemp(prefix="bench_sweep_")
        wall = chapter_wall_time(args.profile, out)
        result["chapter_wall_s"] = wall
        print(f"chapter sweep ({args.profile} profile): {wall:.1f} s wall  [{out}]")

    grid = len(cfg["parameterizations"]) * len(cfg["ratios"]) * len(cfg["seeds"])
    tp = synthetic_sweeps.throughput(cfg, args.steps, args.loop_models, threads=threads)
    print(f"throughput: {grid} models x {args.steps} steps, torch threads {tp['threads']}")
    result.update(throughput=tp, load_average_after=list(os.getloadavg()), versions=runtime.versions())
    print(f"  loop    (training.train, {tp['n_loop']} models): {tp['loop_model_steps_per_s']:8.0f} model-steps/s "
          f"({tp['loop_s']:.1f} s)")
    print(f"  batched (engine, {tp['n_batched']} models):        {tp['batched_model_steps_per_s']:8.0f} model-steps/s "
          f"({tp['batched_s']:.1f} s)")
    print(f"  largest parameter difference loop vs batched: {tp['max_param_diff']:.1e}")
    print(f"  load average (1, 5, 15 min) after: {', '.join(f'{x:.1f}' for x in result['load_average_after'])}")
    if args.json:
        path = runtime.write_json(args.json, result)
        print(f"  results: {path}")
    print(f"speedup {tp['speedup']:.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
