"""A chapter opened and run the way a reader does it in JupyterLab (``make lab``).

Starts a headless Jupyter server from this environment (127.0.0.1, a random port, a token,
``QKOV_PROFILE=test`` in its environment), opens ``book/01_synthetic.md`` through the contents
API as a notebook (jupytext's contents manager, as JupyterLab does), checks that the
``parameters`` cell came through intact, then creates a session (the kernel starts in ``book/``
like Lab's) and executes every code cell over the kernel's websocket. Checks: no cell errors,
the results file says profile ``test``, and ``tqdm.auto`` displays widget progress bars
(``ipywidgets`` is installed, so no "IProgress not found").
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHAPTER = "book/01_synthetic.md"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
START_TIMEOUT_S = 60
RUN_TIMEOUT_S = 300  # a guard against a hung kernel, not a speed check


class Server:
    """The running server: its base URL and token, and a small JSON client for its REST API."""

    def __init__(self, url: str, token: str, log: Path):
        self.url, self.token, self.log = url.rstrip("/"), token, log

    def api(self, method: str, path: str, body: dict | None = None) -> dict:
        req = urllib.request.Request(f"{self.url}{path}", method=method,
                                     data=None if body is None else json.dumps(body).encode(),
                                     headers={"Authorization": f"token {self.token}",
                                              "Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            raw = resp.read()
        return json.loads(raw) if raw else {}

    def log_tail(self, n: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else "(no log)"


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Server:
    tmp = tmp_path_factory.mktemp("jupyter")
    runtime, log = tmp / "runtime", tmp / "server.log"
    token = secrets.token_hex(16)
    env = {**os.environ,
           "QKOV_PROFILE": "test",                     # the kernels inherit it
           "QKOV_RESULTS_DIR": str(tmp / "results"),   # keep _build/results untouched
           "JUPYTER_TOKEN": token,
           "JUPYTER_RUNTIME_DIR": str(runtime),        # jpserver-<pid>.json tells us the port
           "JUPYTER_CONFIG_DIR": str(tmp / "config"),  # no user config (sys-prefix config still applies)
           "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "jupyter_server", "--ServerApp.ip=127.0.0.1", "--ServerApp.port=0",
           f"--ServerApp.root_dir={ROOT}", "--ServerApp.open_browser=False"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-root")  # CI runs as root
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        info_file = runtime / f"jpserver-{proc.pid}.json"
        end = time.monotonic() + START_TIMEOUT_S
        while not info_file.exists():
            if proc.poll() is not None or time.monotonic() > end:
                pytest.fail(f"jupyter server did not start (exit {proc.poll()}): {log.read_text()[-3000:]}")
            time.sleep(0.2)
        time.sleep(0.2)  # the file is written in one go, but give the writer a moment
        info = json.loads(info_file.read_text())
        srv = Server(info["url"], token, log)
        srv.results = tmp / "results"  # type: ignore[attr-defined]
        yield srv
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@pytest.fixture(scope="module")
def notebook(server) -> dict:
    model = server.api("GET", f"/api/contents/{CHAPTER}?type=notebook&content=1")
    assert model["type"] == "notebook" and model["format"] == "json", \
        f"{CHAPTER} did not open as a notebook (jupytext contents manager missing?): {model.get('type')}"
    return model["content"]


def test_chapter_opens_as_notebook_with_its_parameters_cell(notebook):
    import jupytext

    assert notebook["metadata"]["kernelspec"]["name"] == "python3"
    assert notebook["metadata"]["jupytext"]["text_representation"]["format_name"] == "myst"
    tagged = [c for c in notebook["cells"] if "parameters" in c["metadata"].get("tags", [])]
    assert len(tagged) == 1, f"expected one cell tagged 'parameters', found {len(tagged)}"
    # the server's notebook is exactly what jupytext reads from the file: same cells, same sources
    ref = jupytext.read(ROOT / CHAPTER)
    assert [(c["cell_type"], c["source"]) for c in notebook["cells"]] == \
           [(c.cell_type, c.source) for c in ref.cells]
    src = tagged[0]["source"]
    for line in ("profile = None", "results_path = None"):
        assert line in src, f"parameters cell lost {line!r}: {src!r}"


def _message(session: str, code: str) -> dict:
    return {"header": {"msg_id": uuid.uuid4().hex, "username": "qkov-test", "session": session,
                       "msg_type": "execute_request", "version": "5.3"},
            "parent_header": {}, "metadata": {}, "channel": "shell", "buffers": [],
            "content": {"code": code, "silent": False, "store_history": True, "user_expressions": {},
                        "allow_stdin": False, "stop_on_error": True}}


def _run_cell(ws, session: str, code: str, deadline: float) -> dict:
    """Execute ``code``; collect its iopub messages until the kernel is idle again and the
    execute_reply has come. Returns {"reply": content, "errors": [...], "streams": str, "widgets": int}."""
    import websocket

    msg = _message(session, code)
    ws.send(json.dumps(msg))
    out = {"reply": None, "errors": [], "streams": "", "widgets": 0}
    idle = False
    while out["reply"] is None or not idle:
        ws.settimeout(max(deadline - time.monotonic(), 0.1))
        try:
            raw = ws.recv()
        except websocket.WebSocketTimeoutException:
            raise TimeoutError(f"cell did not finish within the {RUN_TIMEOUT_S} s guard:\n{code[:300]}") from None
        reply = json.loads(raw)
        if reply.get("parent_header", {}).get("msg_id") != msg["header"]["msg_id"]:
            continue
        kind, content = reply["msg_type"], reply["content"]
        if kind == "execute_reply":
            out["reply"] = content
        elif kind == "status" and content.get("execution_state") == "idle":
            idle = True
        elif kind == "error":
            out["errors"].append(f"{content['ename']}: {content['evalue']}")
        elif kind == "stream":
            out["streams"] += content["text"]
        elif kind in ("display_data", "update_display_data") and WIDGET_VIEW in content.get("data", {}):
            out["widgets"] += 1
    return out


def test_chapter_runs_in_the_servers_kernel_with_the_test_profile(server, notebook):
    import websocket

    session = server.api("POST", "/api/sessions", {"path": CHAPTER, "type": "notebook", "name": "",
                                                   "kernel": {"name": "python3"}})
    kernel = session["kernel"]["id"]
    ws_url = server.url.replace("http://", "ws://", 1) + f"/api/kernels/{kernel}/channels?session_id={session['id']}"
    ws = websocket.create_connection(ws_url, header=[f"Authorization: token {server.token}"], timeout=60)
    cells = [c for c in notebook["cells"] if c["cell_type"] == "code"]
    runs, started = [], time.monotonic()
    try:
        deadline = started + RUN_TIMEOUT_S
        for i, cell in enumerate(cells):
            res = _run_cell(ws, session["id"], cell["source"], deadline)
            runs.append(res)
            assert res["reply"]["status"] == "ok" and not res["errors"], \
                f"code cell {i} failed: {res['errors'] or res['reply']}\n{cell['source'][:400]}\n" \
                f"server log:\n{server.log_tail()}"
        elapsed = time.monotonic() - started
    finally:
        ws.close()
        server.api("DELETE", f"/api/sessions/{session['id']}")
    streams = "".join(r["streams"] for r in runs)
    print(f"\n{CHAPTER}: {len(cells)} code cells executed in the server's kernel in {elapsed:.1f} s "
          f"(profile test, {sum(r['widgets'] for r in runs)} widget outputs)")
    assert "profile test" in streams, f"the kernel did not pick up QKOV_PROFILE=test: {streams[:500]}"
    assert "IProgress not found" not in streams, "tqdm.auto fell back to text: ipywidgets missing in the kernel"
    assert sum(r["widgets"] for r in runs) >= 1, "no widget progress bar was displayed"
    results = json.loads((server.results / "synthetic.json").read_text())
    assert results["params"]["profile"] == "test"
