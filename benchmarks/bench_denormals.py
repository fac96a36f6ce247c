"""Benchmark: stacked training with and without flushing subnormal floats (``TrainConfig.flush_denormals``).

For each workload of ``bench_length_buckets.py`` (the SVA natural-prefix models or a map model, AdamW
at the profile's first base rate, its ratios in turn) it builds ``--models`` models and trains them as
one stack for ``--steps`` steps on one torch thread, once with the CPU flushing subnormal floats to zero
and once keeping them, in one process (the same models, freshly built, each time), in the order given by
``--order``. A sharpening head's softmax weights fall below float32's smallest normal number (1.2e-38),
and x86 computes on such numbers through a slow path, so the cost of a step grows as the heads sharpen.

It prints wall milliseconds per stacked step over the first and the last ``--window`` steps, the
speed-up of flushing over the last window and the whole run, and for each run the first model's share of
subnormal attention weights on the validation split (predicted without flushing) and its last validation
loss (the two runs differ by float rounding, which these runs amplify).

    QKOV_DATA_DIR=../shared/data .venv/bin/python benchmarks/bench_denormals.py
    QKOV_DATA_DIR=../shared/data .venv/bin/python benchmarks/bench_denormals.py --workloads sva --models 4 --steps 600
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from bench_length_buckets import warmed_workload  # the workloads that benchmark times (run from benchmarks/)
from qkov_lib.train import predict, train_stacked


def subnormal_share(attn: torch.Tensor) -> float:
    """The share of the non-zero entries of ``attn`` whose magnitude lies below float32's smallest normal."""
    a = attn.abs()
    nonzero = a > 0
    return float((nonzero & (a < torch.finfo(torch.float32).tiny)).sum()) / max(1, int(nonzero.sum()))


def bench(name: str, n_models: int, steps: int, window: int, order: list[bool]) -> list[dict]:
    """One row per flush setting: ms per step over the first and last ``window`` steps and the whole run,
    the first model's subnormal attention share and last validation loss."""
    make, train, val, cfgs = warmed_workload(name, n_models, steps)
    rows = []
    for flush in order:
        models = make()
        run = [dataclasses.replace(c, flush_denormals=flush, log_every=steps) for c in cfgs]
        ticks = [time.perf_counter()]
        hists = train_stacked(models, train, run, val=val, progress=False, threads=1,
                              on_step=lambda s: ticks.append(time.perf_counter()))
        w = min(window, steps)
        rows.append({"workload": name, "flush": flush,
                     "first_ms": 1e3 * (ticks[w] - ticks[0]) / w, "last_ms": 1e3 * (ticks[-1] - ticks[-1 - w]) / w,
                     "all_ms": 1e3 * (ticks[-1] - ticks[0]) / steps,
                     "subnormal": subnormal_share(predict(models[0], val)[0]),
                     "val_loss": hists[0].records[-1]["val_loss"]})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", nargs="+", default=["sva", "natural", "hatexplain", "squad"],
                    choices=["natural", "sva", "hatexplain", "squad"])
    ap.add_argument("--models", type=int, default=8)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--window", type=int, default=100)
    ap.add_argument("--order", choices=["keep-first", "flush-first"], default="keep-first")
    a = ap.parse_args()
    order = [False, True] if a.order == "keep-first" else [True, False]
    for name in a.workloads:
        rows = {r["flush"]: r for r in bench(name, a.models, a.steps, a.window, order)}
        keep, flush = rows[False], rows[True]
        for label, r in (("kept", keep), ("flushed", flush)):
            print(f"{name:10s} subnormals {label:7s}: first {a.window} steps {r['first_ms']:7.1f} ms/step, "
                  f"last {r['last_ms']:7.1f}, all {r['all_ms']:7.1f}; subnormal attention "
                  f"{100 * r['subnormal']:.2f} %; val loss {r['val_loss']:.6f}")
        print(f"{name:10s} flushing: {keep['last_ms'] / flush['last_ms']:.2f}x over the last {a.window} steps, "
              f"{keep['all_ms'] / flush['all_ms']:.2f}x over all {a.steps}")


if __name__ == "__main__":
    main()
