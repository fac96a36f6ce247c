"""SIGTERM stops ``qkov run`` as Ctrl-C does: ``timeout``, Slurm and ``docker stop`` send it. Each test
runs the synthetic chapter (test profile) through ``timeout -s SIGNAL``, sends the signal to ``timeout``
(which passes it on to the run and its process group) once the kernel runs a cell, and checks what
the run leaves: a failure record, no staging folder, the lock free, the kernel ended, one message and
no traceback."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qkov_lib.tooling import chapters
from qkov_lib.tooling.results import output_lock

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(shutil.which("timeout") is None, reason="needs coreutils timeout")


def children(pid: int) -> list[int]:
    """The child processes of ``pid`` (the run's kernel), from /proc."""
    try:
        tasks = Path(f"/proc/{pid}/task").iterdir()
        return [int(c) for t in tasks for c in (t / "children").read_text().split()]
    except OSError:
        return []


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_stops_the_run_cleanly(tmp_path, signum):
    out = tmp_path / "runs"
    cmd = ["timeout", "-s", signal.Signals(signum).name[3:], "900", sys.executable, "-m", "qkov_lib", "run",
           "synthetic", "-p", "profile", '"test"', "--out", str(out)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    staged = out / ".running" / "synthetic" / "synthetic.ipynb"
    deadline = time.monotonic() + 600
    while not staged.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert proc.poll() is None, proc.communicate()
    time.sleep(3)  # the kernel is running the chapter's cells
    run = children(proc.pid)
    assert len(run) == 1
    kernels = children(run[0])
    proc.send_signal(signum)  # to timeout, which sends it to the run, then to its process group
    stdout, stderr = proc.communicate(timeout=300)

    assert proc.returncode == 128 + signum, stderr
    assert f"01_synthetic.md was stopped by {signal.Signals(signum).name}" in stderr
    for noise in ("Traceback", "ZMQError", "DeadKernelError", "Exception ignored"):
        assert noise not in stderr, stderr
    record = json.loads((out / "synthetic.failed.json").read_text())
    assert record["status"] == "failed" and record["error"] == f"Interrupted: stopped by {signal.Signals(signum).name}"
    assert not (out / ".running").exists() and not (out / "synthetic.json").exists()
    with output_lock(out, "synthetic", lambda pid: AssertionError(f"the lock is still held by {pid}")):
        pass
    time.sleep(2)
    assert kernels and not any(alive(k) for k in kernels)


def test_a_signal_before_a_kernel_runs_stops_at_once(monkeypatch, tmp_path):
    """Before a kernel is running there is nothing to interrupt: the signal raises Interrupted at once."""
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(chapters.Interrupted) as stop, chapters.stopping_on_signals():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
    assert stop.value.signum == signal.SIGTERM and isinstance(stop.value, KeyboardInterrupt)
    assert signal.getsignal(signal.SIGTERM) is before  # the handlers are restored
