"""Converters of the official releases (in each dataset module, helpers in qkov_lib.data.convert) and the derived fields computed by
our code: hand-worked cases, bad input, and -- where the real data folder is there -- the
converters run on the real originals and compared with the curated files row by row."""

import gzip
import hashlib
import io
import json
import pickle
import tarfile
from collections import defaultdict

import pytest

from qkov_lib.data import hatexplain, sources, squad, sva

REAL, WHY = sources.find_data_dir()
needs_real = pytest.mark.skipif(REAL is None, reason=WHY)


def _gunzip(path) -> bytes:
    return gzip.decompress(path.read_bytes())


# --- Marvin & Linzen: the safe unpickler and the subject rule -----------------------------------
CALLS: list[str] = []


def _record(x):
    CALLS.append(x)
    return x


class _Evil:
    def __reduce__(self):
        return (_record, ("code ran",))


def test_unpickler_refuses_every_global_and_runs_no_code():
    data = pickle.dumps({"sing_MS_MV": [_Evil()]}, protocol=3)
    assert pickle.loads(data) == {"sing_MS_MV": ["code ran"]} and CALLS == ["code ran"]   # a bare load runs it
    CALLS.clear()
    with pytest.raises(pickle.UnpicklingError, match="refused to load the global .*_record"):
        sva.load_templates(data, "simple_agrmt")
    assert CALLS == []
    with pytest.raises(pickle.UnpicklingError, match="refused.*collections.OrderedDict"):
        sva.load_templates(pickle.dumps(__import__("collections").OrderedDict(a=[])), "x")


def test_templates_must_be_dicts_of_sentence_pairs():
    assert sva.load_templates(pickle.dumps({"k": [("a b", "a c")]}), "c") == {"k": [("a b", "a c")]}
    for bad in ({"k": [("only one",)]}, {"k": "a b"}, [("a", "b")], {"k": [("a", 3)]}):
        with pytest.raises(ValueError, match="not a dict of lists of"):
            sva.load_templates(pickle.dumps(bad), "c")


@pytest.mark.parametrize("sentence, condition, index", [
    ("the author laughs", "simple_agrmt", 1),
    ("the author next to the guards laughs", "prep_anim", 1),
    ("the author that the guards like laughs", "obj_rel_across_anim", 1),    # main verb: the first noun
    ("the author that the guards like laughs", "obj_rel_within_anim", 4),    # embedded verb: the second
    ("the author the guards like laughs", "obj_rel_no_comp_within_anim", 3),
    ("the mechanic said the author laughs", "sent_comp", 4),
    ("the taxi drivers laugh", "simple_agrmt", 2),                          # the head of "taxi drivers"
    ("the author said the taxi driver laughs", "sent_comp", 5),
])
def test_subject_index_hand_worked(sentence, condition, index):
    assert sva.subject_index(sentence.split(), condition) == index


def test_minimal_pair_rows_and_their_checks():
    row = sva.minimal_pair_row("prep_anim", "plur_MS_MV_sing_ES", 7, "the authors next to the guard laugh",
                                   "the authors next to the guard laughs")
    assert row == {"condition": "prep_anim", "key": "plur_MS_MV_sing_ES", "pair_index": 7,
                   "sentence_good": "the authors next to the guard laugh", "sentence_bad": "the authors next to the guard laughs",
                   "target_number": "plur", "verb_index": 6, "verb_good": "laugh", "verb_bad": "laughs",
                   "subject_index": 1, "subject": "authors"}
    with pytest.raises(ValueError, match="exactly one token"):
        sva.minimal_pair_row("c", "sing_x", 0, "the a b", "the c d")
    with pytest.raises(ValueError, match="sing_ or plur_"):
        sva.minimal_pair_row("c", "dual_x", 0, "the a b", "the a c")
    with pytest.raises(ValueError, match="no first 'the'"):
        sva.minimal_pair_row("c", "sing_x", 0, "a dog runs", "a dog run")
    with pytest.raises(ValueError, match="both numbers"):
        sva.marvin_linzen_rows({"c": {"sing_x": [("the sheep runs", "the sheep run")],
                                          "plur_x": [("the sheep run", "the sheep runs")]}})


@needs_real
def test_marvin_linzen_converter_reproduces_the_curated_file():
    """The 15 real pickles of raw/marvin_linzen2018 -> exactly the rows of the curated file."""
    raw = {f"marvin_linzen2018/{p.name.removesuffix('.gz')}": _gunzip(p)
           for p in sorted((REAL / "raw" / "marvin_linzen2018").glob("*.pickle.gz"))}
    for did, data in raw.items():   # the real pickles are the manifest's downloads
        assert hashlib.sha256(data).hexdigest() == sources.downloads()[did]["sha256"], did
    built = sva.convert_marvin_linzen2018(raw)[sva.ML_FILE]
    ours = [json.loads(line) for line in built.splitlines()]
    theirs = [json.loads(line) for line in _gunzip(REAL / sva.ML_FILE).splitlines()]
    differences = sum(a != b for a, b in zip(ours, theirs)) + abs(len(ours) - len(theirs))
    print(f"Marvin & Linzen converter: {len(raw)} pickles, {len(ours)} rows built, {len(theirs)} curated rows "
          f"compared, {differences} differences")
    assert len(raw) == 15 and len(ours) == len(theirs) == 121_220 and differences == 0
    assert hashlib.sha256(built).hexdigest() == sources.manifest()[sva.ML_FILE]["content_sha256"]   # byte for byte


# --- SQuAD: the exact-span filter counts occurrences in the context ------------------------------
def test_answer_occurrences_hand_worked():
    ctx = "The Broncos won in 2016. Denver beat Carolina 24 to 10."
    assert squad.answer_occurrences(ctx, "2016") == 1
    assert squad.answer_occurrences(ctx, "in") == 2          # "won in" and "Carol-in-a"
    assert squad.answer_occurrences(ctx, "Seattle") == 0
    assert squad.answer_occurrences("aaa", "aa") == 2        # overlapping starts count
    assert squad.answer_occurrences(ctx, "") == 0


@needs_real
def test_exact_span_subset_from_contexts_equals_the_curated_flag():
    doc = json.loads(_gunzip(REAL / "squad/train-v1.1-from-explorer.json.gz"))
    ours, flag = [], []
    for a in doc["data"]:
        for p in a["paragraphs"]:
            for qa in p["qas"]:
                ours.append(squad.answer_occurrences(p["context"], qa["answers"][0]["text"]) == 1)
                flag.append(qa["answer_occurrences_in_context"] == 1)   # read here only to compare
    disagree = sum(a != b for a, b in zip(ours, flag))
    print(f"SQuAD exact-span subset: {len(ours)} questions, {sum(ours)} exact from contexts, {sum(flag)} by the "
          f"curated flag, {disagree} disagreements")
    assert len(ours) == 87_599 and sum(ours) == 78_161 and disagree == 0


def test_squad_loader_ignores_a_wrong_occurrence_field(tmp_path):
    ctx = "The Broncos won in 2016. Denver beat Carolina 24 to 10."
    qas = [{"id": "a", "question": "When?", "answers": [{"text": "2016", "answer_start": ctx.index("2016")}],
            "answer_occurrences_in_context": 2},                           # wrong: it occurs once
           {"id": "b", "question": "What?", "answers": [{"text": "in", "answer_start": ctx.index(" in") + 1}],
            "answer_occurrences_in_context": 1}]                           # wrong: it occurs twice
    doc = json.dumps({"version": "1.1", "data": [{"title": "t", "paragraphs": [{"context": ctx, "qas": qas}]}]})
    for rel in (squad.TRAIN_FILES[0], squad.DEV_FILE):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(gzip.compress(doc.encode()))
    ds = squad.load(tmp_path, max_len=40, min_freq=1, verify=False)
    assert ds.report["train_skipped_ambiguous_span"] == 1 and ds.train_info["id"] == ["a"]
    assert len(ds.test) == 2                                             # the dev set is not filtered


# --- HateXplain -----------------------------------------------------------------------------------
def _post(pid, labels, tokens, rationales=()):
    return {"post_id": pid, "annotators": [{"label": lab, "annotator_id": i + 1, "target": ["None"] if lab == "normal"
                                            else ["Other"]} for i, lab in enumerate(labels)],
            "rationales": [list(r) for r in rationales], "post_tokens": tokens}


def test_hatexplain_converter_hand_worked():
    posts = {"p1": _post("p1", ["normal", "normal", "offensive"], ["hi", "all"]),
             "p2": _post("p2", ["hatespeech", "hatespeech", "normal"], ["go", "away"], [[0, 1], [1, 1]]),
             "p3": _post("p3", ["offensive"] * 3, ["x"], [[1]]),
             "p4": _post("p4", ["normal"] * 3, ["in", "no", "split"])}
    div = {"train": ["p2", "p1"], "val": ["p3"], "test": []}
    out = hatexplain.convert({"hatexplain/dataset.json": json.dumps(posts).encode(),
                              "hatexplain/post_id_divisions.json": json.dumps(div).encode()})
    assert set(out) == {hatexplain.TRAIN_JSONL, *hatexplain.SPLIT_FILES.values()}
    train = [json.loads(line) for line in out[hatexplain.TRAIN_JSONL].splitlines()]
    assert [r["id"] for r in train] == ["p2", "p1"]                         # split-file order
    assert train[0] == {"id": "p2", "annotators": {"label": [0, 0, 1], "annotator_id": [1, 2, 3],
                                                   "target": [["Other"], ["Other"], ["None"]]},
                        "rationales": [[0, 1], [1, 1]], "post_tokens": ["go", "away"]}
    assert out[hatexplain.SPLIT_FILES["test"]] == b""
    with pytest.raises(ValueError, match="1 post ids of the val split are not in dataset.json"):
        hatexplain.convert({"a/dataset.json": json.dumps(posts).encode(),
                            "a/post_id_divisions.json": json.dumps({**div, "val": ["nope"]}).encode()})
    posts["p3"]["annotators"][0]["label"] = "rude"
    with pytest.raises(ValueError, match="post p3: label not in"):
        hatexplain.convert({"a/dataset.json": json.dumps(posts).encode(),
                            "a/post_id_divisions.json": json.dumps(div).encode()})


@needs_real
def test_hatexplain_converter_gives_the_curated_val_and_test_bytes():
    """The curated val/test files, turned back into the authors' dataset.json layout and
    converted again, come out byte for byte (so a fetched dataset.json gives the same files)."""
    names = hatexplain.CLASS_NAMES
    posts, div = {}, json.loads((REAL / hatexplain.DIVISIONS).read_text())
    for split in ("val", "test"):
        for line in _gunzip(REAL / hatexplain.SPLIT_FILES[split]).splitlines():
            r = json.loads(line)
            a = r["annotators"]
            posts[r["id"]] = {"post_id": r["id"], "rationales": r["rationales"], "post_tokens": r["post_tokens"],
                              "annotators": [{"label": names[lab], "annotator_id": i, "target": t}
                                             for lab, i, t in zip(a["label"], a["annotator_id"], a["target"])]}
    div["train"] = []
    out = hatexplain.convert({"h/dataset.json": json.dumps(posts).encode(),
                              "h/post_id_divisions.json": json.dumps(div).encode()})
    for split in ("val", "test"):
        rel = hatexplain.SPLIT_FILES[split]
        assert out[rel] == _gunzip(REAL / rel), rel
        assert hashlib.sha256(out[rel]).hexdigest() == sources.manifest()[rel]["content_sha256"]


# --- Linzen et al. 2016 -------------------------------------------------------------------------
def linzen_tar(files: dict[str, bytes], junk: bool = True) -> bytes:
    """A tar.gz laid out like rnn_agr_simple.tar.gz (with the macOS stubs and README it carries)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        extra = {"rnn_agr_simple/._numpred.val": b"\x00\x05junk", "rnn_agr_simple/README.txt": b"readme"} if junk else {}
        for name, data in {**extra, **{f"rnn_agr_simple/{k}": v for k, v in files.items()}}.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_linzen_converter_hand_worked():
    files = {"numpred.val": b"VBZ\tthe dog\nVBP\tthe dogs\n", "numpred.test.1": b"VBZ\tthe dog of the cats\n",
             "numpred.test.2": b"VBP\tthe dogs near the cat and man\n", "numpred.test.3": b"",
             "numpred.test.4": b"", "numpred.test.5": b"VBZ\ta b c d e f\n"}
    out = sva.convert_linzen2016({"x/rnn_agr_simple.tar.gz": linzen_tar(files)})
    assert out[sva.LINZEN_TRAIN_FILE] == files["numpred.val"]
    assert out[sva.LINZEN_TEST_FILE] == (b"label\tprefix\tn_attractors\nVBZ\tthe dog of the cats\t1\n"
                                         b"VBP\tthe dogs near the cat and man\t2\nVBZ\ta b c d e f\t5\n")
    with pytest.raises(KeyError, match="no numpred.test.5"):
        sva.convert_linzen2016({"x/rnn_agr_simple.tar.gz": linzen_tar({k: v for k, v in files.items() if k != "numpred.test.5"})})
    with pytest.raises(ValueError, match="label<TAB>prefix"):
        sva.convert_linzen2016({"x/rnn_agr_simple.tar.gz": linzen_tar({**files, "numpred.test.3": b"VBZ no tab\n"})})


@needs_real
def test_linzen_converter_gives_the_curated_bytes():
    """numpred.val and numpred.test.k cut back out of the curated files and packed like the
    authors' archive convert to the curated files byte for byte."""
    parts = defaultdict(list)
    for line in _gunzip(REAL / sva.LINZEN_TEST_FILE).splitlines()[1:]:
        row, k = line.rsplit(b"\t", 1)
        parts[f"numpred.test.{int(k)}"].append(row + b"\n")
    files = {"numpred.val": _gunzip(REAL / sva.LINZEN_TRAIN_FILE), **{k: b"".join(v) for k, v in parts.items()}}
    out = sva.convert_linzen2016({"l/rnn_agr_simple.tar.gz": linzen_tar(files)})
    for rel in (sva.LINZEN_TRAIN_FILE, sva.LINZEN_TEST_FILE):
        assert hashlib.sha256(out[rel]).hexdigest() == sources.manifest()[rel]["content_sha256"], rel
