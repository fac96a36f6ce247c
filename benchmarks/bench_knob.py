"""Cost of the knob's split: forward + backward + AdamW step of a GPT-NeoX-style causal LM,
split by ``qkov_lib.knob`` against the same model unsplit, in one process.

    .venv/bin/python benchmarks/bench_knob.py              # tiny and small configs
    .venv/bin/python benchmarks/bench_knob.py --reps 30 --threads 2

The two models of a config get the same weights and data; their steps alternate (unsplit,
split, unsplit, ...) so that a change of machine load hits both. The time of a model is the
median over ``--reps`` steps after ``--warmup`` steps. The last line is the overhead per config,
``split median / unsplit median - 1``. Nothing is asserted: the numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from qkov_lib.studies.pythia import pythia_config
from qkov_lib.knob import knob_optimizer

CONFIGS = {  # name: (d_model, layers, heads, sequence length, batch size)
    "tiny": (64, 2, 4, 64, 8),
    "small": (256, 4, 8, 128, 8),
}


def build(d: int, layers: int, heads: int, T: int):
    from transformers import GPTNeoXForCausalLM

    torch.manual_seed(0)
    return GPTNeoXForCausalLM(pythia_config(vocab_size=512, d_model=d, n_layers=layers, n_heads=heads, max_len=T,
                                            pad_id=0))


def step_time(model, opt, ids) -> float:
    t = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    return time.perf_counter() - t


def measure(name: str, reps: int, warmup: int) -> dict:
    d, layers, heads, T, B = CONFIGS[name]
    plain = build(d, layers, heads, T)
    split = copy.deepcopy(plain)
    opt_plain = torch.optim.AdamW(plain.parameters(), lr=1e-4)
    opt_split, report = knob_optimizer(split, torch.optim.AdamW, lr=1e-4, qk_ratio=10.0)
    ids = torch.randint(1, 512, (B, T), generator=torch.Generator().manual_seed(1))
    times = {"unsplit": [], "split": []}
    for i in range(warmup + reps):
        for key, m, o in (("unsplit", plain, opt_plain), ("split", split, opt_split)):
            t = step_time(m, o, ids)
            if i >= warmup:
                times[key].append(t)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"config": name, "params_unsplit": sum(1 for _ in plain.parameters()),
            "params_split": sum(1 for _ in split.parameters()), "unsplit_ms": 1e3 * med["unsplit"],
            "split_ms": 1e3 * med["split"], "overhead": med["split"] / med["unsplit"] - 1}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    rows = [measure(c, a.reps, a.warmup) for c in a.configs]
    for r in rows:
        print(f"{r['config']:>6}: {r['params_unsplit']} -> {r['params_split']} parameter tensors; step "
              f"{r['unsplit_ms']:.1f} ms unsplit, {r['split_ms']:.1f} ms split")
    print("overhead " + ", ".join(f"{r['config']} {100 * r['overhead']:+.1f}%" for r in rows))


if __name__ == "__main__":
    main()
