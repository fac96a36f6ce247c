"""Benchmark: the stacked training step of the real-data maps against this machine's floor.

It measures, on one torch thread:

* the **matmul peak**: GFLOP/s of a 1024 x 1024 float32 matrix product (CPU time, best of 20);
* the **copy bandwidth**: GB/s (bytes read plus bytes written) of copying a 256 MiB float32 tensor
  (CPU time, best of 10);

then for each map (``realmap.MAPS[<dataset>].profiles["cpu"]``, ``--models`` models, AdamW cells at the
profile's first AdamW base rate, the profile's ratios in turn, seeds 0, 1, ..., its ``length_buckets``):

* **FLOPs per step**: the matrix products and convolutions of one forward and backward pass of the
  whole stack, three times the forward's as counted by ``torch.utils.flop_counter.FlopCounterMode``;
* **the floor**: FLOPs at the matmul peak, plus the traffic no step can avoid at the copy bandwidth:
  the AdamW update reads every parameter, its gradient and its two moments and writes three of them
  back, and the backward pass writes the gradient (8 x 4 bytes per parameter), and every activation of
  (rows x positions x models x width) that the backward pass needs (the embeddings and each convolution's
  output) is written and read once, and so is its gradient (4 x 4 bytes per element);
* **the step time** before, the vmap path (``torch.func.vmap`` of the models' own forward) with one
  length bucket, and now, the explicit-model-dimension path (``HeadModel.stacked_forward``) with the
  profile's ``length_buckets`` (HateXplain: 2), both in this one process, alternating ``--reps`` times:
  CPU milliseconds per step (``time.process_time``, less sensitive to other jobs than wall time), the
  median over the repetitions, and each one's ratio to its floor (with length buckets the step computes
  fewer positions, so its FLOPs and activations, and its floor, are smaller).

It ends with the load average before and after.

    QKOV_DATA_DIR=../shared/data .venv/bin/python benchmarks/bench_map_floor.py
    QKOV_DATA_DIR=../shared/data .venv/bin/python benchmarks/bench_map_floor.py --datasets sva --steps 10 --reps 1
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import statistics
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

from bench_map_engine import bench_config, cells  # the map cells that benchmark times (run from benchmarks/)
from qkov_lib import head_model, runtime
from qkov_lib.studies import realmap
from qkov_lib.train import train_stacked
from qkov_lib.train.loop import ModelStack, bucketed_loss, retain_freed_memory


def matmul_peak(n: int = 1024, reps: int = 20) -> float:
    """GFLOP/s of an (n, n) @ (n, n) float32 product, the best of ``reps``."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    best = float("inf")
    for _ in range(reps):
        t0 = time.process_time()
        a @ b
        best = min(best, time.process_time() - t0)
    return 2 * n**3 / best / 1e9


def copy_bandwidth(mib: int = 256, reps: int = 10) -> float:
    """GB/s of bytes read plus bytes written when copying ``mib`` MiB of float32, the best of ``reps``."""
    src = torch.randn(mib * 2**18)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(reps):
        t0 = time.process_time()
        dst.copy_(src)
        best = min(best, time.process_time() - t0)
    return 2 * src.numel() * 4 / best / 1e9


@contextlib.contextmanager
def vmap_path():
    """Stacks of HeadModels built inside the block use vmap of the models' forward."""
    method = head_model.HeadModel.stacked_forward
    del head_model.HeadModel.stacked_forward
    try:
        yield
    finally:
        head_model.HeadModel.stacked_forward = method


def step_work(models, data, cfg) -> tuple[int, int]:
    """``(FLOPs, positions)`` of one step of the stack on a minibatch of ``cfg.batch_size`` rows per
    model (in ``cfg.length_buckets`` groups cut to their longest row, as the step runs them):
    matmul and convolution FLOPs of the forward and backward pass, three times the forward's (each
    product has two backward products of its size, the gradients of both factors; the counter's own
    count of a convolution's backward takes a grouped convolution's weight gradient once per group),
    and the (row, position) pairs of every model that the step computes."""
    stack = ModelStack(models)
    g = torch.Generator().manual_seed(0)
    idx = torch.stack([torch.randperm(len(data), generator=g)[:cfg.batch_size] for _ in models])
    tokens, key_mask, y = data.tokens[idx], data.key_mask[idx], data.y[idx]
    widths = []
    forward = stack.forward
    stack.forward = lambda t, k, shared: widths.append(t.shape[-2] * t.shape[-1]) or forward(t, k, shared)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        if cfg.length_buckets > 1:
            bucketed_loss(stack, tokens, key_mask, y, None, cfg.length_buckets)
        else:  # as the step: the padded length
            stack.forward(tokens, key_mask, False)
    return 3 * counter.get_total_flops(), sum(widths) * len(models)


def floor_ms(models, cfg, flops: int, positions: int, peak: float, bw: float) -> tuple[float, int, int]:
    """``(floor in ms, parameter bytes, activation bytes)`` of a step (module docstring)."""
    m = models[0]
    params = 8 * 4 * sum(p.numel() for p in m.parameters()) * len(models)
    acts = 4 * 4 * (1 + (len(m.convs) if m.encoder == "conv" else 0)) * positions * m.d_model
    return 1e3 * (flops / (peak * 1e9) + (params + acts) / (bw * 1e9)), params, acts


def time_steps(models, data, cfgs, steps: int, warm: int) -> float:
    """CPU milliseconds per training step, steps ``warm`` to ``steps`` (``on_step`` stamps)."""
    stamps = []
    run = [dataclasses.replace(c, steps=steps) for c in cfgs]
    train_stacked(models, data, run, progress=False, threads=1, on_step=lambda s: stamps.append(time.process_time()))
    return 1e3 * (stamps[-1] - stamps[warm - 1]) / (len(stamps) - warm)


def bench(name: str, n_models: int, steps: int, reps: int, peak: float, bw: float) -> dict:
    """Floors and step times of one map: ``before`` is the vmap path with one length bucket (the
    earlier code and configs), ``now`` the stacked path with the profile's ``length_buckets``."""
    cfg = realmap.map_config(name, "cpu")
    ds, _ = realmap.load_splits(name, cfg)
    grid = cells(cfg, n_models)
    now = [bench_config(cfg, c, steps) for c in grid]
    runs = {"before": [dataclasses.replace(c, length_buckets=1) for c in now], "now": now}
    fresh = lambda: [realmap.make_model(ds, cfg, c.seed) for c in grid]  # noqa: E731
    out = {"dataset": name, "models": n_models, "length_buckets": now[0].length_buckets}
    for k, cfgs in runs.items():
        flops, positions = step_work(fresh(), ds.train, cfgs[0])
        out[f"{k}_gflop"] = flops / 1e9
        out[f"{k}_floor_ms"], out["param_mb"], acts = floor_ms(fresh(), cfgs[0], flops, positions, peak, bw)
        out[f"{k}_act_mb"] = acts / 1e6
    out["param_mb"] /= 1e6
    times = {"before": [], "now": []}
    for _ in range(reps):
        with vmap_path():
            times["before"].append(time_steps(fresh(), ds.train, runs["before"], steps, 3))
        times["now"].append(time_steps(fresh(), ds.train, runs["now"], steps, 3))
    for k, v in times.items():
        out[f"{k}_ms"] = statistics.median(v)
        out[f"{k}_over_floor"] = out[f"{k}_ms"] / out[f"{k}_floor_ms"]
    out["speedup"], out["all_ms"] = out["before_ms"] / out["now_ms"], times
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--datasets", nargs="+", default=["squad", "hatexplain", "sva"], choices=list(realmap.DATASETS))
    ap.add_argument("--models", type=int, default=18)
    ap.add_argument("--steps", type=int, default=23, help="steps per timed run; the first 3 are not timed")
    ap.add_argument("--reps", type=int, default=3, help="timed runs of each path, alternating")
    a = ap.parse_args()
    torch.set_num_threads(1)
    retain_freed_memory()
    load0 = os.getloadavg()
    peak, bw = matmul_peak(), copy_bandwidth()
    print(f"matmul peak {peak:.1f} GFLOP/s (one thread), copy bandwidth {bw:.1f} GB/s", flush=True)
    print("| dataset (models) | GFLOP / step | floor ms: FLOPs + params + activations | before: vmap ms (x floor) | "
          "now: stacked ms (x floor) | speed-up |")
    print("|---|---|---|---|---|---|")
    for name in a.datasets:
        r = bench(name, a.models, a.steps, a.reps, peak, bw)
        cut = r["length_buckets"] > 1
        models = f"{r['models']}, {r['length_buckets']} length buckets now" if cut else f"{r['models']}"
        gflop = f"{r['now_gflop']:.2f}" + (f" (before {r['before_gflop']:.2f})" if cut else "")
        floor = f"{r['now_floor_ms']:.1f}" + (f" (before {r['before_floor_ms']:.1f})" if cut else "")
        print(f"| {name} ({models}) | {gflop} | {floor}: {r['param_mb']:.0f} MB params, {r['now_act_mb']:.0f} MB "
              f"activations | {r['before_ms']:.1f} ({r['before_over_floor']:.2f}x) | {r['now_ms']:.1f} "
              f"({r['now_over_floor']:.2f}x) | {r['speedup']:.2f}x |", flush=True)
    print(f"load average before {load0[0]:.2f}, after {os.getloadavg()[0]:.2f}; torch {runtime.versions().get('torch')}")


if __name__ == "__main__":
    main()
