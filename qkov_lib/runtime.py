"""Where and how a run executes: device, torch threads, subnormal floats, seeds, library versions, git commit,
wall time, and whether a tensor is batched by ``torch.func.vmap``."""

from __future__ import annotations

import contextlib
import functools
import platform
import random
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent


def pick_device(device: str | None = None) -> torch.device:
    """``device`` if given, else CUDA when available, else CPU."""
    if device:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """Run the block with ``n`` torch intra-op threads (None: leave torch's setting), then
    restore. Small synthetic models run best on one thread: their tensors are tiny, so a second
    thread gains little even on an idle machine, while on a shared machine the thread pool's
    spin-waiting made a sweep about eight times slower in CPU time."""
    old = torch.get_num_threads()
    if n is not None:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"threads must be a positive integer or None, got {n!r}")
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if n is not None and torch.get_num_threads() != old:
            torch.set_num_threads(old)


def flushing_denormals() -> bool:
    """Whether this thread's CPU arithmetic flushes subnormal floats to zero: float32's smallest
    normal number divided by 4 comes out as 0."""
    return bool(torch.full((), torch.finfo(torch.float32).tiny).mul(0.25) == 0)


@contextlib.contextmanager
def flush_denormals(on: bool = True) -> Iterator[None]:
    """Run the block with this thread's CPU arithmetic flushing subnormal floats to zero (``on``;
    False: keeping them), then restore the previous mode.

    Subnormals are the numbers below a dtype's smallest normal one (float32: 1.2e-38). A sharpened
    attention row holds softmax weights that small, and on x86 every operation on such a number
    takes a slow microcode path: an SVA map stack trained about 1.5 times slower per step once its
    heads had sharpened (``benchmarks/bench_denormals.py``). Flushed, these weights count as 0, far
    below the resolution of a row that sums to 1. The mode is per thread and CPU only: torch's other
    intra-op threads and GPUs keep theirs; where the CPU has no such mode
    (``torch.set_flush_denormal`` returns False) the block runs unchanged."""
    if not isinstance(on, bool):
        raise ValueError(f"flush_denormals takes True or False, got {on!r}")
    old = flushing_denormals()
    if on != old:
        torch.set_flush_denormal(on)
    try:
        yield
    finally:
        if flushing_denormals() != old:
            torch.set_flush_denormal(old)


def seed_everything(seed: int) -> torch.Generator:
    """Seed Python, NumPy and torch; return a CPU generator seeded with ``seed``."""
    import numpy as np  # here, not at the top: the knob (models -> runtime) needs torch alone

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)


def versions() -> dict[str, str]:
    """Versions of Python and the libraries that shape the numbers."""
    import importlib.metadata as md

    out = {"python": platform.python_version(), "platform": platform.platform()}
    for pkg in ("torch", "numpy", "qkov", "jupyter-book", "papermill", "datasets"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def write_json(path: str | Path, doc: dict) -> Path:
    """Write ``doc`` as indented JSON to ``path`` (parent folders created); returns the path
    (what the benchmark scripts record their measurements with)."""
    import json

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1))
    return path


def git_commit() -> str:
    """The repository's HEAD commit, with ``+dirty`` when the tree has changes; ``unknown``
    outside a checkout."""
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "qkov_lib", "book"], cwd=REPO_ROOT,
                               capture_output=True, text=True).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


class Timer:
    """Wall-clock seconds since construction (``Timer().elapsed``)."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.t0


@functools.cache
def _batched_check() -> Callable[[torch.Tensor], bool] | None:
    """torch's own test for a ``torch.func.vmap`` batched tensor (the private
    ``torch._C._functorch.is_batchedtensor``; torch has no public one), if it exists here and
    tells a plain tensor (False) from one inside ``vmap`` (True); None otherwise."""
    try:
        check = torch._C._functorch.is_batchedtensor
        inside: list[bool] = []
        torch.func.vmap(lambda t: inside.append(bool(check(t))) or t)(torch.zeros(2))
        outside = bool(check(torch.zeros(2)))
    except (AttributeError, TypeError, RuntimeError):
        return None
    return check if inside == [True] and not outside else None


def is_batched(x: torch.Tensor) -> bool | None:
    """Whether ``x`` is a batched tensor inside ``torch.func.vmap`` (a stacked forward): True or
    False, or None when this torch cannot tell (callers then do what is safe both ways, e.g.
    skip a per-row check that vmap cannot run)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"expected a tensor, got {type(x).__name__}")
    check = _batched_check()
    return None if check is None else bool(check(x))


#: the environment variable that moves every chapter's results file (``<dir>/<chapter>.json``)
RESULTS_ENV = "QKOV_RESULTS_DIR"


def results_file(chapter: str) -> Path:
    """``$QKOV_RESULTS_DIR/<chapter>.json``, else ``<repo>/_build/results/<chapter>.json``: where a
    chapter writes its results and where a page that reads another's looks for them."""
    import os

    return Path(os.environ.get(RESULTS_ENV, REPO_ROOT / "_build" / "results")) / f"{chapter}.json"
