"""The fetch path, offline: a local HTTP server (127.0.0.1, random port) serves small files in
each official format -- a few SQuAD paragraphs, a few HateXplain posts with the split file, a
few Linzen lines in an rnn_agr_simple.tar.gz, one Marvin & Linzen template pickle -- and a
manifest written by the test points at it ($QKOV_DATA_MANIFEST). Checked: fetch -> verify ->
load; a checksum mismatch refused before anything is written; an interrupted download never
used, then resumed; the one message when the servers cannot be reached; the preflight; the
provenance record of a built file without a published checksum, the refusal of such a file
without one (and its use only with QKOV_ALLOW_UNVERIFIED=1, marked in used_files) and the
record counts checked on read."""

import gzip
import hashlib
import json
import pickle
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from qkov_lib.data import fetch as fetchmod
from qkov_lib.data import hatexplain, sources, squad, sva
from qkov_lib.data.registry import load_text_dataset
from test_convert import linzen_tar


def sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


# --- a small HTTP server with faults on demand ----------------------------------------------------
class Server:
    """Serves ``files`` (path -> bytes) with Range support. ``cut_once``: paths whose next GET
    sends the full Content-Length but only half the body, then closes. ``ignore_range``: answer
    every request with the whole file. ``log``: (method, path, Range header). ``on_get``: called
    with (path, Range header) before each GET is answered."""

    def __init__(self):
        self.files: dict[str, bytes] = {}
        self.cut_once: set[str] = set()
        self.ignore_range = False
        self.log: list[tuple[str, str, str | None]] = []
        self.on_get = None
        state = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_HEAD(self):
                self.answer(body=False)

            def do_GET(self):
                self.answer(body=True)

            def answer(self, body: bool):
                rng = self.headers.get("Range")
                state.log.append((self.command, self.path, rng))
                if body and state.on_get:
                    state.on_get(self.path, rng)
                data = state.files.get(self.path)
                if data is None:
                    self.send_error(404)
                    return
                start = 0
                if rng and not state.ignore_range:
                    start = int(rng.removeprefix("bytes=").split("-")[0])
                    if start >= len(data):
                        self.send_response(416)
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                        return
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                else:
                    self.send_response(200)
                chunk = data[start:]
                self.send_header("Content-Length", str(len(chunk)))
                self.end_headers()
                if not body:
                    return
                if self.path in state.cut_once:       # the connection breaks mid-body
                    state.cut_once.discard(self.path)
                    chunk = chunk[: len(chunk) // 2]
                self.wfile.write(chunk)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def gets(self, path: str) -> list[str | None]:
        """The Range headers of the GET requests for ``path``."""
        return [r for m, p, r in self.log if m == "GET" and p == path]

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    s = Server()
    yield s
    s.close()


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


# --- small files in each official format ----------------------------------------------------------
CTX = "The Broncos won in 2016. Denver beat Carolina 24 to 10 at Levi's Stadium."


def squad_doc(qas) -> bytes:
    return json.dumps({"version": "1.1", "data": [{"title": "Super_Bowl", "paragraphs": [
        {"context": CTX, "qas": [{"id": i, "question": q, "answers": [{"text": t, "answer_start": CTX.index(t)}]}
                                 for i, q, t in qas]}]}]}).encode()


SQUAD_TRAIN = squad_doc([("t1", "When did the Broncos win?", "2016"), ("t2", "Who did Denver beat?", "Carolina"),
                         ("t3", "Which word?", "in")])           # "in" occurs twice: not an exact span
SQUAD_DEV = squad_doc([("d1", "How many points did Denver score?", "24"), ("d2", "Where?", "Levi's Stadium")])


def hx_post(pid, labels, tokens, rationales=()):
    return {"post_id": pid, "annotators": [{"label": lab, "annotator_id": i, "target": ["None"]}
                                           for i, lab in enumerate(labels)],
            "rationales": [list(r) for r in rationales], "post_tokens": tokens}


HX_POSTS = {
    "a_twitter": hx_post("a_twitter", ["normal"] * 3, ["hello", "friends"]),
    "b_gab": hx_post("b_gab", ["hatespeech", "hatespeech", "offensive"], ["you", "vermin"], [[0, 1], [1, 1]]),
    "c_gab": hx_post("c_gab", ["offensive", "offensive", "normal"], ["what", "a", "jerk"], [[0, 0, 1], [0, 1, 1]]),
    "d_twitter": hx_post("d_twitter", ["normal", "normal", "offensive"], ["nice", "day"]),
    "e_gab": hx_post("e_gab", ["normal", "offensive", "hatespeech"], ["no", "majority"]),   # in no split
}
HX_DATASET = json.dumps(HX_POSTS).encode()
HX_DIVISIONS = json.dumps({"train": ["b_gab", "a_twitter"], "val": ["d_twitter"], "test": ["c_gab", "a_twitter"]}).encode()

LINZEN_FILES = {"numpred.val": b"VBZ\tthe dog\nVBP\tthe dogs\nVBZ\tthe cat near the dogs\n",
                "numpred.test.1": b"VBZ\tthe dog of the cats\nVBP\tthe dogs of the cat\n",
                "numpred.test.2": b"VBP\tthe dogs near the cat and man\n", "numpred.test.3": b"",
                "numpred.test.4": b"", "numpred.test.5": b"VBZ\tthe dog a b c d e\n"}
LINZEN_TAR = linzen_tar(LINZEN_FILES)
# the converted files, written out by hand
LINZEN_TEST_OUT = (b"label\tprefix\tn_attractors\nVBZ\tthe dog of the cats\t1\nVBP\tthe dogs of the cat\t1\n"
                   b"VBP\tthe dogs near the cat and man\t2\nVBZ\tthe dog a b c d e\t5\n")

TEMPLATES = {"sing_MS_MV": [("the author laughs", "the author laugh"), ("the taxi driver swims", "the taxi driver swim")],
             "plur_MS_MV": [("the authors laugh", "the authors laughs")]}
PICKLE = pickle.dumps(TEMPLATES, protocol=3)
ML_OUT = "".join(json.dumps(r) + "\n" for r in [
    {"condition": "simple_agrmt", "key": "sing_MS_MV", "pair_index": 0, "sentence_good": "the author laughs",
     "sentence_bad": "the author laugh", "target_number": "sing", "verb_index": 2, "verb_good": "laughs",
     "verb_bad": "laugh", "subject_index": 1, "subject": "author"},
    {"condition": "simple_agrmt", "key": "sing_MS_MV", "pair_index": 1, "sentence_good": "the taxi driver swims",
     "sentence_bad": "the taxi driver swim", "target_number": "sing", "verb_index": 3, "verb_good": "swims",
     "verb_bad": "swim", "subject_index": 2, "subject": "driver"},
    {"condition": "simple_agrmt", "key": "plur_MS_MV", "pair_index": 0, "sentence_good": "the authors laugh",
     "sentence_bad": "the authors laughs", "target_number": "plur", "verb_index": 2, "verb_good": "laugh",
     "verb_bad": "laughs", "subject_index": 1, "subject": "authors"}]).encode()

SERVED = {"/squad/train-v1.1.json": SQUAD_TRAIN, "/squad/dev-v1.1.json": SQUAD_DEV,
          "/hx/dataset.json": HX_DATASET, "/hx/post_id_divisions.json": HX_DIVISIONS,
          "/linzen/rnn_agr_simple.tar.gz": LINZEN_TAR, "/ml/simple_agrmt.pickle": PICKLE}


def write_manifest(path: Path, base: str, **override) -> Path:
    """A manifest laid out like the packaged one, pointing at ``base``. ``override``: download id
    or file path -> dict of fields to replace."""
    def dl(did, url, data, store, local, sha_known=True):
        return did, {"dataset": "t", "url": base + url, "sha256": sha(data) if sha_known else None, "path": local,
                     "store": store, "license": "test"}
    downloads = dict([
        dl("squad/train-v1.1.json", "/squad/train-v1.1.json", SQUAD_TRAIN, "gzip", squad.TRAIN_FILES[0]),
        dl("squad/dev-v1.1.json", "/squad/dev-v1.1.json", SQUAD_DEV, "gzip", squad.DEV_FILE),
        dl("hatexplain/dataset.json", "/hx/dataset.json", HX_DATASET, "gzip", "raw/hatexplain/dataset.json.gz"),
        dl("hatexplain/post_id_divisions.json", "/hx/post_id_divisions.json", HX_DIVISIONS, "copy", hatexplain.DIVISIONS),
        dl("linzen2016/rnn_agr_simple.tar.gz", "/linzen/rnn_agr_simple.tar.gz", LINZEN_TAR, "copy",
           "raw/linzen2016/rnn_agr_simple.tar.gz", sha_known=False),
        dl("marvin_linzen2018/simple_agrmt.pickle", "/ml/simple_agrmt.pickle", PICKLE, "gzip",
           "raw/marvin_linzen2018/simple_agrmt.pickle.gz"),
    ])
    hx = {"convert": "hatexplain", "inputs": ["hatexplain/dataset.json", "hatexplain/post_id_divisions.json"]}
    lz = {"convert": "linzen2016", "inputs": ["linzen2016/rnn_agr_simple.tar.gz"]}

    def f(dataset, build, content=None, lines=None, **kw):
        return {"dataset": dataset, "license": "test", "source": "test", "build": build, "sha256": None,
                "content_sha256": content and sha(content), "lines": lines, **kw}
    files = {
        squad.DEV_FILE: f("squad", {"download": "squad/dev-v1.1.json"}, SQUAD_DEV),
        squad.TRAIN_FILES[0]: f("squad", {"download": "squad/train-v1.1.json"}, SQUAD_TRAIN, group="squad-train"),
        squad.TRAIN_FILES[1]: f("squad", None, group="squad-train"),
        hatexplain.DIVISIONS: f("hatexplain", {"download": "hatexplain/post_id_divisions.json"}, HX_DIVISIONS),
        hatexplain.TRAIN_JSONL: f("hatexplain", hx, lines=2, group="hatexplain-train"),
        hatexplain.TRAIN_CSV: f("hatexplain", None, group="hatexplain-train"),
        hatexplain.SPLIT_FILES["val"]: f("hatexplain", hx, lines=1),
        hatexplain.SPLIT_FILES["test"]: f("hatexplain", hx, lines=2),
        sva.LINZEN_TRAIN_FILE: f("sva_linzen", lz, LINZEN_FILES["numpred.val"]),
        sva.LINZEN_TEST_FILE: f("sva_linzen", lz, LINZEN_TEST_OUT),
        sva.ML_FILE: f("sva", {"convert": "marvin_linzen2018", "inputs": ["marvin_linzen2018/simple_agrmt.pickle"]}, ML_OUT),
        "sva/blimp_subject_verb_agreement.jsonl.gz": f("sva", None, optional=True),
    }
    for key, fields in override.items():
        (downloads if key in downloads else files)[key].update(fields)
    path.write_text(json.dumps({"about": "test", "downloads": downloads, "files": files}))
    return path


@pytest.fixture
def site(server, tmp_path, monkeypatch):
    """The server with the official-format files, the manifest pointing at it, an empty data folder."""
    server.files.update(SERVED)
    monkeypatch.setenv(sources.MANIFEST_ENV, str(write_manifest(tmp_path / "manifest.json", server.url)))
    monkeypatch.setenv(sources.CACHE_ENV, str(tmp_path / "hf-cache"))
    monkeypatch.delenv(sources.DATA_ENV, raising=False)
    return server, tmp_path / "data"


def fetch(dest, **kw):
    return fetchmod.fetch(dest, progress=False, backoff=0, **kw)


def data_files(root: Path) -> set[str]:
    """Every file in the data folder, relative (part and temporary files included)."""
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()} if root.exists() else set()


# --- fetch -> verify -> load ----------------------------------------------------------------------
def test_fetch_verify_load(site):
    server, dest = site
    status = fetch(dest)
    assert all(not s.startswith("present") for s in status.values())
    assert status[sva.ML_FILE].startswith("built by marvin_linzen2018 (content sha256 verified")
    assert status[hatexplain.TRAIN_JSONL].startswith("built by hatexplain (no published checksum; 2 lines as expected")
    assert status["raw/linzen2016/rnn_agr_simple.tar.gz"].startswith("downloaded (no published checksum; accepted")
    assert not any(p.endswith((".part", ".tmp")) for p in data_files(dest))
    v = sources.verify_all(dest)
    assert v[sva.ML_FILE] == v[squad.DEV_FILE] == v[sva.LINZEN_TEST_FILE] == "content_sha256"
    assert v[hatexplain.TRAIN_CSV] == "missing (alternative present)" and v["sva/blimp_subject_verb_agreement.jsonl.gz"] == "missing (optional)"
    assert gzip.decompress((dest / squad.DEV_FILE).read_bytes()) == SQUAD_DEV   # stored gzipped, content as served

    sources.clear_used()
    ds = load_text_dataset("squad", dest, max_len=40, min_freq=1)
    assert ds.report["train_skipped_ambiguous_span"] == 1 and sorted(ds.train_info["id"]) == ["t1", "t2"]
    assert ds.test_info["id"] == ["d1", "d2"]
    hx = load_text_dataset("hatexplain", dest, max_len=10, min_freq=1)
    assert hx.train.y.tolist() == [0, 1] and hx.test.y.tolist() == [2, 1]        # official train split, HF label ints
    assert hx.report["test_with_rationale"] == 1
    ml = load_text_dataset("sva", dest, max_len=8, min_freq=1, test_frac=0.34)
    subjects = sorted(ml.train_info["subject"] + ml.test_info["subject"])
    assert subjects == ["author", "authors", "driver"]
    lz = load_text_dataset("sva_linzen", dest, max_len=10, min_freq=1)
    assert lz.train.y.tolist() == [0, 1, 0] and lz.test_info["n_attractors"] == [1, 1, 2, 5]
    used = sources.used_files()
    assert set(used) == {squad.TRAIN_FILES[0], squad.DEV_FILE, hatexplain.TRAIN_JSONL, hatexplain.SPLIT_FILES["test"],
                         sva.ML_FILE, sva.LINZEN_TRAIN_FILE, sva.LINZEN_TEST_FILE}
    assert all(used[rel] == sha((dest / rel).read_bytes()) for rel in used)

    before = len(server.log)
    assert set(fetch(dest).values()) == {"present (content_sha256 verified)", "present (provenance verified)"}
    assert len(server.log) == before                      # nothing downloaded again
    assert v[hatexplain.TRAIN_JSONL] == "provenance"     # no checksum in the manifest: its provenance record
    rec = json.loads(sources.provenance_path(dest / hatexplain.TRAIN_JSONL).read_text())
    assert rec["sha256"] == sha((dest / hatexplain.TRAIN_JSONL).read_bytes()) and rec["lines"] == 2
    assert rec["inputs"] == {"hatexplain/dataset.json": sha(HX_DATASET), "hatexplain/post_id_divisions.json": sha(HX_DIVISIONS)}
    assert sources.problems(v) == []


def test_fetch_only_one_dataset_and_bad_names(site):
    server, dest = site
    status = fetch(dest, only=["sva"])
    assert set(status) == {sva.ML_FILE, "raw/marvin_linzen2018/simple_agrmt.pickle.gz"}
    assert [p for m, p, r in server.log] == ["/ml/simple_agrmt.pickle"]
    with pytest.raises(ValueError, match="neither a file of the manifest nor a dataset"):
        fetch(dest, only=["imdb"])
    with pytest.raises(ValueError, match="cannot be fetched"):
        fetch(dest, only=[squad.TRAIN_FILES[1]])


# --- a checksum mismatch is refused before anything is written ---------------------------------
def test_checksum_mismatch_writes_nothing(site):
    server, dest = site
    server.files["/squad/dev-v1.1.json"] = SQUAD_DEV.replace(b"Denver", b"Denvor")
    with pytest.raises(sources.ChecksumError, match="dev-v1.1.json has sha256 .* expected .*nothing was written"):
        fetch(dest, only=[squad.DEV_FILE])
    assert data_files(dest) == set()                      # no final file, no part file


def test_unverified_download_is_kept_only_if_its_outputs_match(site, monkeypatch, tmp_path):
    server, dest = site
    wrong = {"content_sha256": sha(b"something else")}
    monkeypatch.setenv(sources.MANIFEST_ENV, str(write_manifest(tmp_path / "m2.json", server.url,
                                                                 **{sva.LINZEN_TEST_FILE: wrong, sva.LINZEN_TRAIN_FILE: wrong})))
    with pytest.raises(sources.ChecksumError, match="converted sva/linzen2016_numpred"):
        fetch(dest, only=["sva_linzen"])
    assert data_files(dest) == set()                      # neither the outputs nor the archive


def test_unverified_download_without_any_checksum_is_refused(site, monkeypatch, tmp_path):
    server, dest = site
    none = {"content_sha256": None}
    monkeypatch.setenv(sources.MANIFEST_ENV, str(write_manifest(tmp_path / "m3.json", server.url,
                                                                 **{sva.LINZEN_TEST_FILE: none, sva.LINZEN_TRAIN_FILE: none})))
    with pytest.raises(sources.ChecksumError, match="no published checksum and no file built from it has one"):
        fetch(dest, only=["sva_linzen"])
    assert data_files(dest) == set()
    assert sva.LINZEN_TEST_FILE in fetch(dest, only=["sva_linzen"], allow_unverified=True)


# --- interrupted downloads ----------------------------------------------------------------------
def test_interrupted_download_is_not_used_and_is_resumed(site):
    server, dest = site
    path, final = "/squad/train-v1.1.json", dest / squad.TRAIN_FILES[0]
    server.cut_once.add(path)
    seen = []
    server.on_get = lambda p, rng: seen.append((rng, final.exists(), fetchmod.part_path(final).stat().st_size
                                                if fetchmod.part_path(final).exists() else 0)) if p == path else None
    fetch(dest, only=[squad.TRAIN_FILES[0]], retries=2)
    half = len(SQUAD_TRAIN) // 2
    assert seen == [(None, False, 0), (f"bytes={half}-", False, half)]   # resumed; no final file meanwhile
    assert gzip.decompress(final.read_bytes()) == SQUAD_TRAIN


def test_interrupted_download_without_retries_leaves_only_a_part_file(site):
    server, dest = site
    server.cut_once.add("/squad/dev-v1.1.json")
    with pytest.raises(fetchmod.DownloadError, match="after 1 attempts .*connection closed after .*next fetch resumes it"):
        fetch(dest, only=[squad.DEV_FILE], retries=0)
    assert data_files(dest) == {squad.DEV_FILE + ".part"}
    with pytest.raises(FileNotFoundError, match="dev-v1.1.json.gz' not found"):
        sources.data_file(squad.DEV_FILE, dest)            # the loaders never see the part file
    fetch(dest, only=[squad.DEV_FILE], retries=0)          # the next fetch resumes it
    assert server.gets("/squad/dev-v1.1.json")[-1] == f"bytes={len(SQUAD_DEV) // 2}-"
    assert data_files(dest) == {squad.DEV_FILE}


def test_server_ignoring_range_restarts_the_file(site):
    server, dest = site
    server.ignore_range = True
    server.cut_once.add("/hx/post_id_divisions.json")
    fetch(dest, only=[hatexplain.DIVISIONS], retries=1)
    assert (dest / hatexplain.DIVISIONS).read_bytes() == HX_DIVISIONS   # not half + whole


def test_stale_part_file_with_wrong_bytes_is_downloaded_again(site):
    server, dest = site
    part = fetchmod.part_path(dest / hatexplain.DIVISIONS)
    part.parent.mkdir(parents=True)
    part.write_bytes(b"x" * 10)                            # a partial file of some other version
    fetch(dest, only=[hatexplain.DIVISIONS])
    assert server.gets("/hx/post_id_divisions.json") == ["bytes=10-", None]
    assert (dest / hatexplain.DIVISIONS).read_bytes() == HX_DIVISIONS


# --- offline: the preflight stops with one message ----------------------------------------------
def test_offline_preflight_stops_with_one_message(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(sources.MANIFEST_ENV, str(write_manifest(tmp_path / "m.json", closed_port_url())))
    dest = tmp_path / "nothing"
    with pytest.raises(sources.DataUnavailable) as err:
        fetchmod.ensure(dest, timeout=2)
    msg = str(err.value)
    for rel in (squad.DEV_FILE, hatexplain.SPLIT_FILES["test"], sva.ML_FILE, sva.LINZEN_TEST_FILE):
        assert f"  - {rel}" in msg
    assert f"  - {squad.TRAIN_FILES[0]}  (or {squad.TRAIN_FILES[1]})" in msg
    assert "blimp" not in msg                               # optional files are not needed
    assert "127.0.0.1:" in msg and "unreachable" in msg
    assert "1. set QKOV_DATA_DIR" in msg and "2. run `qkov data fetch`" in msg
    assert not dest.exists()                                # nothing created
    monkeypatch.setenv(sources.DATA_ENV, str(dest))
    assert fetchmod.main(["check", "--fetch"]) == 1
    out = capsys.readouterr()
    assert out.err.count("Two ways out") == 1 and out.out == ""


def test_fetch_offline_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(fetchmod.time, "sleep", lambda s: None)   # the CLI's backoff, skipped
    monkeypatch.setenv(sources.MANIFEST_ENV, str(write_manifest(tmp_path / "m.json", closed_port_url())))
    with pytest.raises(fetchmod.DownloadError, match=r"could not download http://127.0.0.1:\d+/squad/dev-v1.1.json after 2 attempts"):
        fetch(tmp_path / "d", only=[squad.DEV_FILE], retries=1)
    assert fetchmod.main(["fetch", "--dest", str(tmp_path / "d"), "--only", "squad"]) == 1


def test_preflight_needs_no_network_when_the_files_are_there(site, monkeypatch, tmp_path, capsys):
    server, dest = site
    probed = sources.preflight(dest, probe_network=True)  # reachable: the files would be fetched
    assert len(probed) == 9 and set(probed.values()) == {"missing (reachable: will be fetched)"}
    assert {m for m, p, r in server.log} == {"HEAD"} and not dest.exists()
    fetched = fetchmod.ensure(dest, backoff=0, progress=False)
    assert set(fetched) >= {squad.DEV_FILE, sva.ML_FILE, hatexplain.TRAIN_JSONL}
    monkeypatch.setenv(sources.MANIFEST_ENV, str(write_manifest(tmp_path / "m.json", closed_port_url())))
    assert fetchmod.ensure(dest) == {}        # all there: no download, no probe
    assert sources.main(["check", "--data-dir", str(dest)]) == 0
    assert "every file the chapters need is in" in capsys.readouterr().out


def test_check_without_network_probe_lists_missing_files(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(sources.MANIFEST_ENV, str(write_manifest(tmp_path / "m.json", closed_port_url())))
    assert sources.main(["check", "--data-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert f"  - {sva.ML_FILE}" in err and "unreachable" not in err   # no probe asked for


# --- the real manifest's checksums accept the real originals (served locally) ---------------------
REAL, WHY = sources.find_data_dir()


@pytest.mark.skipif(REAL is None, reason=WHY)
def test_real_manifest_fetches_the_real_originals(server, tmp_path, monkeypatch):
    """The packaged manifest, with only its addresses pointed at the local server, fetches the
    originals we hold (the official SQuAD dev file and split file, the 15 template pickles, a
    Linzen archive packed from numpred.val and numpred.test.k) and builds files whose checksums
    are the manifest's."""
    from collections import defaultdict

    doc = json.loads(sources.MANIFEST_PATH.read_text())
    parts = defaultdict(bytes)
    for line in gzip.decompress((REAL / sva.LINZEN_TEST_FILE).read_bytes()).splitlines()[1:]:
        row, k = line.rsplit(b"\t", 1)
        parts[f"numpred.test.{int(k)}"] += row + b"\n"
    originals = {"squad/dev-v1.1.json": gzip.decompress((REAL / squad.DEV_FILE).read_bytes()),
                 "hatexplain/post_id_divisions.json": (REAL / hatexplain.DIVISIONS).read_bytes(),
                 "linzen2016/rnn_agr_simple.tar.gz": linzen_tar(
                     {"numpred.val": gzip.decompress((REAL / sva.LINZEN_TRAIN_FILE).read_bytes()), **parts}),
                 **{f"marvin_linzen2018/{p.name.removesuffix('.gz')}": gzip.decompress(p.read_bytes())
                    for p in (REAL / "raw/marvin_linzen2018").glob("*.pickle.gz")}}
    for did, d in doc["downloads"].items():
        d["url"] = f"{server.url}/{did}"
        if did in originals:
            server.files[f"/{did}"] = originals[did]
    (tmp_path / "m.json").write_text(json.dumps(doc))
    monkeypatch.setenv(sources.MANIFEST_ENV, str(tmp_path / "m.json"))
    dest = tmp_path / "data"
    wanted = [squad.DEV_FILE, hatexplain.DIVISIONS, sva.ML_FILE, sva.LINZEN_TRAIN_FILE, sva.LINZEN_TEST_FILE]
    status = fetch(dest, only=wanted)
    checked = [s for s in status.values() if s in ("downloaded (sha256 verified)", "downloaded (content_sha256 verified)")]
    assert len(checked) == 15 + 2                          # the pickles, the dev file, the split file
    for rel in wanted:
        assert sources.verify_file(dest / rel, rel) in ("sha256", "content_sha256"), rel
    assert "no published checksum; accepted" in status["raw/linzen2016/rnn_agr_simple.tar.gz"]


# --- files without a published checksum: provenance record, refusal, opt-in, record counts ------
TRAIN_CSV_TEXT = "text,majority_label,severity,labels,annotator_ids,targets\nyou vermin,0,High,\"0, 0, 2\",\"1, 2, 3\",Other\n"


@pytest.fixture
def hx_site(site, tmp_path, monkeypatch):
    """``site`` with the HateXplain files fetched and a checksummed curated train CSV beside them."""
    server, dest = site
    csv = gzip.compress(TRAIN_CSV_TEXT.encode(), mtime=0)
    monkeypatch.setenv(sources.MANIFEST_ENV, str(write_manifest(
        tmp_path / "m-hx.json", server.url, **{hatexplain.TRAIN_CSV: {"sha256": sha(csv)},
                                               hatexplain.TRAIN_JSONL: {"records": {"posts": 2}}})))
    fetch(dest, only=["hatexplain"])
    (dest / hatexplain.TRAIN_CSV).write_bytes(csv)
    monkeypatch.delenv(sources.ALLOW_ENV, raising=False)
    return server, dest


def test_provenance_record_vouches_only_for_the_file_fetch_built(hx_site):
    _, dest = hx_site
    path, rec_path = dest / hatexplain.TRAIN_JSONL, sources.provenance_path(dest / hatexplain.TRAIN_JSONL)
    assert sources.verify_file(path, hatexplain.TRAIN_JSONL) == "provenance"
    rec = json.loads(rec_path.read_text())
    rec_path.write_text(json.dumps({**rec, "inputs": {**rec["inputs"], "hatexplain/dataset.json": "0" * 64}}))
    with pytest.raises(sources.UnverifiedError, match="from hatexplain/dataset.json with sha256 0{64}, not the published"):
        sources.verify_file(path, hatexplain.TRAIN_JSONL)
    rec_path.write_text(json.dumps(rec))
    path.write_bytes(gzip.compress(b'{"id": "x"}\n' * 2))   # changed after fetch built it
    with pytest.raises(sources.UnverifiedError, match="the file changed after `qkov data fetch` built it"):
        sources.verify_file(path, hatexplain.TRAIN_JSONL)
    rec_path.unlink()
    with pytest.raises(sources.UnverifiedError, match="has no provenance record hatexplain_train.jsonl.gz.provenance.json"):
        sources.verify_file(path, hatexplain.TRAIN_JSONL)


def test_unverified_file_is_refused_beside_a_checksummed_one_and_used_only_when_asked(hx_site, monkeypatch, tmp_path, capsys):
    from qkov_lib.tooling import results

    server, dest = hx_site
    other = gzip.compress(b"".join(json.dumps({"id": f"v{i}", "annotators": {"label": [1, 1, 1]}, "rationales": [],
                                               "post_tokens": ["val", "post"]}).encode() + b"\n" for i in range(2)))
    (dest / hatexplain.TRAIN_JSONL).write_bytes(other)      # e.g. made from another split: no record vouches for it
    sources.provenance_path(dest / hatexplain.TRAIN_JSONL).unlink()
    want = (r"hatexplain_train.jsonl.gz has no checksum in the manifest and has no provenance record .*so it is not "
            r"used; once it is deleted the loaders read hatexplain/hatexplain_train_no_rationales.csv.gz")
    with pytest.raises(sources.UnverifiedError, match=want):
        load_text_dataset("hatexplain", dest, max_len=10, min_freq=1)
    with pytest.raises(sources.DataUnavailable, match=want + r"(.|\n)*QKOV_ALLOW_UNVERIFIED=1"):
        fetchmod.ensure(dest)
    before = len(server.log)
    assert fetchmod.main(["check", "--fetch", "--data-dir", str(dest)]) == 1
    assert len(server.log) == before                       # stopped before fetching what is missing (squad, sva)
    err = capsys.readouterr().err
    assert err.count("hatexplain_train.jsonl.gz has no checksum") == 1 and "Nothing was run" in err
    assert sources.main(["verify", "--data-dir", str(dest)]) == 1
    err = capsys.readouterr().err
    assert "hatexplain_train.jsonl.gz has no checksum" in err and f"  - {squad.DEV_FILE}: missing" in err

    monkeypatch.setenv(sources.ALLOW_ENV, "1")              # asked for: used, and the results file says so
    sources.clear_used()
    ds = load_text_dataset("hatexplain", dest, max_len=10, min_freq=1)
    assert ds.report["train_read"] == 2 and ds.train_info["id"] == ["v0", "v1"]
    used = sources.used_files()[hatexplain.TRAIN_JSONL]
    assert used == f"{sha(other)} ({sources.UNVERIFIED_ALLOWED})" and "QKOV_ALLOW_UNVERIFIED=1" in used
    doc = json.loads(results.save_results("x", {}, {}, path=tmp_path / "r.json").read_text())
    assert "unverified" in doc["data_files"][hatexplain.TRAIN_JSONL]
    assert sources.check_needed(dest)[hatexplain.TRAIN_JSONL] == sources.UNVERIFIED_ALLOWED
    with pytest.raises(sources.DataUnavailable, match="are missing") as err:   # only the squad and sva files now
        sources.preflight(dest, probe_network=False)
    assert "hatexplain" not in str(err.value)
    monkeypatch.setenv(sources.ALLOW_ENV, "yes")
    with pytest.raises(ValueError, match="QKOV_ALLOW_UNVERIFIED must be 1"):
        load_text_dataset("hatexplain", dest, max_len=10, min_freq=1)


def test_record_count_is_checked_on_read(hx_site, monkeypatch, tmp_path):
    server, dest = hx_site
    assert len(load_text_dataset("hatexplain", dest, max_len=10, min_freq=1).train) == 2   # 2 posts, as the manifest says
    monkeypatch.setenv(sources.MANIFEST_ENV, str(write_manifest(
        tmp_path / "m-count.json", server.url, **{hatexplain.TRAIN_JSONL: {"records": {"posts": 3}}})))
    with pytest.raises(sources.RecordCountError,
                       match=r"data file hatexplain/hatexplain_train.jsonl.gz: 2 posts, expected 3 \(manifest records\)"):
        load_text_dataset("hatexplain", dest, max_len=10, min_freq=1)
    assert len(load_text_dataset("hatexplain", dest, max_len=10, min_freq=1, verify=False).train) == 2
