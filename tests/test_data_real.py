"""Real-data loaders (qkov_lib.data.{sources,text,sva,hatexplain,squad}): small fixtures written
by the tests (including every kind of bad input), checksums, the manifest, the hub fallback, and
the split counts of the real files against the official numbers in ../shared/data/README.md.
The real files are found the way the library finds them ($QKOV_DATA_DIR, else the default
beside the checkout); without them those tests skip and say so. Fetching: tests/test_fetch.py."""

import gzip
import hashlib
import json
from pathlib import Path

import pytest
import torch

from qkov_lib.data import fetch, hatexplain, sources, squad, sva, text
from qkov_lib.data.text import PAD_ID, QUERY_ID, UNK_ID, Vocabulary, truncate
from qkov_lib.data.registry import load_text_dataset

REAL, WHY = sources.find_data_dir()
needs_real = pytest.mark.skipif(REAL is None, reason=WHY)


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    # the datasets library's cache goes to a temporary folder, never the repository
    monkeypatch.setenv(sources.CACHE_ENV, str(tmp_path_factory.getbasetemp() / "hf-cache"))


def _gz(path: Path, text_: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.write(text_)
    return path


def _jsonl(rows) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


# --- fixtures ---------------------------------------------------------------------------------
def ml_row(sentence, verb_index, subject_index, number, condition="simple_agrmt"):
    words = sentence.split()
    return {"condition": condition, "key": "k", "pair_index": 0, "sentence_good": sentence, "sentence_bad": sentence,
            "target_number": number, "verb_index": verb_index, "verb_good": words[verb_index],
            "verb_bad": words[verb_index], "subject_index": subject_index, "subject": words[subject_index]}


def write_sva(root: Path) -> Path:
    rows = [
        ml_row("the author laughs", 2, 1, "sing"),
        ml_row("the author swims", 2, 1, "sing"),                        # same prefix: duplicate
        ml_row("the authors laugh", 2, 1, "plur"),
        ml_row("the pilot next to the guards smiles", 6, 1, "sing", "prep_anim"),
        ml_row("the pilots next to the guard smile", 6, 1, "plur", "prep_anim"),
        ml_row("the farmer that the chefs like is tall", 5, 4, "plur", "obj_rel_within_anim"),
        ml_row("the farmers that the chef likes are tall", 5, 4, "sing", "obj_rel_within_anim"),
        ml_row("a b c d e f g h the pilot is", 10, 9, "sing"),            # long, subject kept near the verb
        ml_row("the pilot a b c d e f g h is", 10, 1, "sing"),            # long, subject cut by the cap
        dict(ml_row("the ghost laughs", 2, 1, "sing"), target_number="dual"),   # bad label
        dict(ml_row("the cat laughs", 2, 1, "sing"), subject="dog"),             # bad subject index
    ]
    return _gz(root / sva.ML_FILE, _jsonl(rows))


def post(pid, labels, tokens, rationales=()):
    return {"id": pid, "annotators": {"label": labels, "annotator_id": [1, 2, 3], "target": [["None"]] * 3},
            "rationales": [list(r) for r in rationales], "post_tokens": tokens}


def write_hatexplain(root: Path) -> None:
    test_rows = [
        post("n1", [1, 1, 2], ["hello", "friends", "<user>"]),                                   # normal
        post("h1", [0, 0, 1], ["you", "are", "vermin", "go"], [[0, 0, 1, 0], [0, 1, 1, 0]]),     # rationale {1, 2}
        post("o1", [2, 2, 2], ["what", "a", "jerk"], []),                                       # empty rationale
        post("x1", [0, 1, 2], ["no", "majority"]),                                              # dropped
        post("m1", [0, 0, 0], ["bad", "length"], [[1, 0, 0]]),                                  # length mismatch
        post("l1", [0, 0, 2], ["a", "b", "c", "d", "e", "f", "vermin"], [[0, 0, 0, 0, 0, 0, 1]]),  # cut by cap
    ]
    _gz(root / hatexplain.SPLIT_FILES["test"], _jsonl(test_rows))
    _gz(root / hatexplain.SPLIT_FILES["val"], _jsonl(test_rows[:2]))
    csv = ("text,majority_label,severity,labels,annotator_ids,targets\n"
           "you are vermin,0,High,\"0, 0, 2\",\"1, 2, 3\",Other\n"
           "hello friends,1,Low,\"1, 1, 1\",\"1, 2, 3\",None\n"
           "what a jerk,2,Low,\"2, 2, 1\",\"1, 2, 3\",None\n"
           "no majority here,1,Low,\"0, 1, 2\",\"1, 2, 3\",None\n"
           "hello vermin,2,Low,\"0, 0, 1\",\"1, 2, 3\",None\n")      # majority_label disagrees with the labels
    _gz(root / hatexplain.TRAIN_CSV, csv)


def qa(qid, question, text_, start):
    return {"id": qid, "question": question, "answers": [{"text": text_, "answer_start": start}]}


CTX = "The Broncos won in 2016. Denver beat Carolina 24 to 10 at Levi's Stadium."


def write_squad(root: Path) -> None:
    train = {"version": "1.1", "data": [{"title": "t", "paragraphs": [{"context": CTX, "qas": [
        qa("a", "When did the Broncos win?", "2016", CTX.index("2016")),
        qa("b", "Who did Denver beat?", "Carolina", 3),                        # wrong offset, text present
        qa("c", "Who lost?", "Seattle", 0),                                    # answer not in the context
        qa("d", "What was it?", "in", CTX.index(" in") + 1),                   # "in" twice: ambiguous (train only)
        qa("e", "Where was the game?", "Levi's Stadium", CTX.index("Levi")),  # beyond a small cap
    ]}]}]}
    dev = {"version": "1.1", "data": [{"title": "t", "paragraphs": [{"context": CTX, "qas": [
        qa("x", "How many points did Denver score?", "24", CTX.index("24")),
        qa("y", "Who did Denver beat ?", "Carolina", CTX.index("Carolina")),
    ]}]}]}
    _gz(root / squad.TRAIN_FILES[0], json.dumps(train))
    _gz(root / squad.DEV_FILE, json.dumps(dev))


@pytest.fixture
def fixture_dir(tmp_path):
    root = tmp_path / "data"
    write_sva(root)
    write_hatexplain(root)
    write_squad(root)
    return root


# --- text utilities -----------------------------------------------------------------------------
def test_vocabulary_min_freq_unk_and_specials():
    v = Vocabulary.build([["b", "a", "b", "c"], ["a", "b", "d", "d"]], min_freq=2, specials=["<sep>"])
    assert v.itos == ["<pad>", "<unk>", "<query>", "<sep>", "b", "a", "d"]  # by frequency, ties alphabetical
    assert (PAD_ID, UNK_ID, QUERY_ID) == (0, 1, 2)
    assert v.encode(["a", "c", "zzz"]) == [5, UNK_ID, UNK_ID]
    with pytest.raises(ValueError, match="min_freq"):
        Vocabulary.build([["a"]], min_freq=0)


def test_truncate_counts_cut_relevant_tokens():
    t = truncate(list("abcdef"), [0, 4], 3, side="right")
    assert t.tokens == list("abc") and t.relevant == [0] and (t.n_cut, t.n_relevant_cut) == (3, 1)
    t = truncate(list("abcdef"), [0, 4], 3, side="left")
    assert t.tokens == list("def") and t.relevant == [1] and (t.n_cut, t.n_relevant_cut) == (3, 1)
    assert truncate(list("ab"), [1], 5).n_cut == 0
    with pytest.raises(ValueError, match="out of range"):
        truncate(list("ab"), [2], 5)


def test_tokenize_spans_point_into_the_text():
    s = "Levi's Stadium, 2016!"
    spans = text.tokenize_spans(s)
    assert [t for t, _, _ in spans] == ["levi", "'", "s", "stadium", ",", "2016", "!"]
    assert all(s[a:b].lower() == t for t, a, b in spans)


# --- SVA ----------------------------------------------------------------------------------------
def test_sva_fixture_split_masks_and_report(fixture_dir):
    ds = load_text_dataset("sva", fixture_dir, max_len=8, min_freq=1, test_frac=0.3, verify=False)
    r = ds.report
    assert r["all_read"] == 11 and r["all_duplicate_prefix"] == 1
    assert r["all_skipped_bad_label"] == 1 and r["all_skipped_bad_subject_index"] == 1
    assert r["all_skipped_prefix_over_cap_subject_cut"] == 1 and r["all_truncated_prefix_over_cap"] == 1
    assert r["train_used"] + r["test_used"] == 7 == r["all_distinct_prefixes"] - 1
    # no prefix is in both splits
    train = {tuple(ds.decode("train", i)) for i in range(len(ds.train))}
    test = {tuple(ds.decode("test", i)) for i in range(len(ds.test))}
    assert not train & test
    for b in (ds.train, ds.test):
        assert (b.tokens[:, -1] == QUERY_ID).all()                   # query last
        assert not b.key_mask[:, -1].any()                          # the query is not a key
        assert (b.key_mask == (b.tokens != PAD_ID)).logical_or(b.tokens == QUERY_ID).all()
        assert (b.relevant.sum(1) == 1).all()                       # exactly the subject
        assert (b.relevant <= b.key_mask).all()
    # the subject (from the template's index) and the label of every example
    expected = {("simple_agrmt", "author"): 0, ("simple_agrmt", "authors"): 1, ("prep_anim", "pilot"): 0,
                ("prep_anim", "pilots"): 1, ("obj_rel_within_anim", "chefs"): 1, ("obj_rel_within_anim", "chef"): 0,
                ("simple_agrmt", "pilot"): 0}
    seen = set()
    for split in ("train", "test"):
        b, info = getattr(ds, split), getattr(ds, f"{split}_info")
        for i in range(len(b)):
            key = (info["condition"][i], info["subject"][i])
            assert int(b.y[i]) == expected[key]
            assert ds.vocab[int(b.tokens[i][b.relevant[i]][0])] in (key[1], "<unk>")
            seen.add(key)
    assert seen == set(expected)


def test_sva_split_is_reproducible_and_depends_on_the_seed(fixture_dir):
    a = load_text_dataset("sva", fixture_dir, max_len=8, min_freq=1, test_frac=0.3, verify=False, seed=0)
    b = load_text_dataset("sva", fixture_dir, max_len=8, min_freq=1, test_frac=0.3, verify=False, seed=0)
    assert torch.equal(a.train.tokens, b.train.tokens) and a.vocab == b.vocab
    splits = {tuple(sorted(" ".join(load_text_dataset("sva", fixture_dir, max_len=8, min_freq=1, test_frac=0.3,
                                                       verify=False, seed=s).decode("test", i))
                           for i in range(2))) for s in range(6)}
    assert len(splits) > 1


def test_sva_linzen_fixture(tmp_path):
    root = tmp_path / "d"
    _gz(root / sva.LINZEN_TRAIN_FILE, "VBZ\tthe dog\nVBP\tthe dogs\nVBZ\t\nXYZ\tthe cat\nVBP\ta b c d e f the cats\n")
    _gz(root / sva.LINZEN_TEST_FILE, "label\tprefix\tn_attractors\nVBZ\tthe dog of the cats\t1\n"
                                      "VBP\tthe dogs a b c d the cats\t2\n")
    ds = load_text_dataset("sva_linzen", root, max_len=5, min_freq=1, verify=False)
    r = ds.report
    assert r["train_read"] == 5 and r["train_skipped_empty_prefix"] == 1 and r["train_skipped_bad_label"] == 1
    assert r["train_truncated_prefix_over_cap"] == 1 and r["test_truncated_prefix_over_cap"] == 2
    assert ds.train.y.tolist() == [0, 1, 1] and ds.test.y.tolist() == [0, 1]
    assert ds.test_info["n_attractors"] == [1, 2]
    assert not ds.test.relevant.any()                     # no subject index, none derived
    assert ds.decode("test", 1)[-3:] == ["the", "cats", "<query>"] and len(ds.decode("test", 1)) == 5  # start cut


# --- HateXplain ---------------------------------------------------------------------------------
def test_hatexplain_fixture_labels_rationales_and_skips(fixture_dir):
    ds = load_text_dataset("hatexplain", fixture_dir, max_len=5, min_freq=1, verify=False)
    r = ds.report
    assert r["test_read"] == 6 and r["test_skipped_no_majority"] == 1
    assert r["test_skipped_rationale_length_mismatch"] == 1 and r["test_empty_rationale"] == 1
    assert r["test_truncated_post_over_cap"] == 1 and r["test_posts_rationale_cut"] == 1
    assert r["test_rationale_tokens_cut"] == 1
    assert r["train_read"] == 5 and r["train_skipped_no_majority"] == 1 and r["train_majority_label_disagrees"] == 1
    assert ds.class_names == ["hatespeech", "normal", "offensive"]
    assert ds.test_info["id"] == ["n1", "h1", "o1", "l1"]
    assert ds.test.y.tolist() == [1, 0, 2, 0]
    assert ds.train.y.tolist() == [0, 1, 2, 0]            # "hello vermin": majority of "0, 0, 1" is 0
    rel = ds.test.relevant
    assert rel[0].sum() == 0 and rel[2].sum() == 0 and rel[3].sum() == 0   # normal; empty; cut by the cap
    words = ds.decode("test", 1)
    assert [w for w, k in zip(words, rel[1][-len(words):]) if k] == ["are", "vermin"]   # union of annotators


def test_hatexplain_train_on_val(fixture_dir):
    ds = load_text_dataset("hatexplain", fixture_dir, max_len=10, min_freq=1, verify=False, train_split="val")
    assert len(ds.train) == 2 and not ds.train.relevant.any()


# --- SQuAD --------------------------------------------------------------------------------------
def test_squad_fixture_copy_task_and_skips(fixture_dir):
    ds = load_text_dataset("squad", fixture_dir, max_len=20, min_freq=1, verify=False)
    r = ds.report
    assert r["train_read"] == 5 and r["train_skipped_ambiguous_span"] == 1
    assert r["train_skipped_answer_not_found"] == 1 and r["train_answer_start_corrected"] == 1
    assert r["train_skipped_answer_beyond_cap"] == 1
    assert r["test_read"] == 2 and len(ds.test) == 2
    T = ds.max_len
    for split in ("train", "test"):
        b = getattr(ds, split)
        for i in range(len(b)):
            words = ds.decode(split, i)
            first = int(b.relevant[i].nonzero()[0])
            assert T - 1 - int(b.y[i]) == first                  # class = distance back from the query
            assert words[-1].startswith("<q:")                   # the wh-type query
            assert "<sep>" in words and words.index("<sep>") < len(words) - (T - first)
    answers = [ds.vocab[int(ds.test.tokens[i, T - 1 - int(ds.test.y[i])])] for i in range(2)]
    assert answers == ["24", "carolina"]
    assert ds.decode("test", 0)[-1] == "<q:how_many>"
    assert ds.n_classes == 20


def test_squad_question_type():
    assert squad.question_type(["how", "many", "points"]) == "how_many"
    assert squad.question_type(["in", "which", "year"]) == "which"
    assert squad.question_type(["name", "it"]) == "other"


# --- bad input ----------------------------------------------------------------------------------
def test_corrupt_json_line_is_a_clear_error(tmp_path):
    root = tmp_path / "d"
    good = _jsonl([ml_row("the author laughs", 2, 1, "sing")] * 3)
    _gz(root / sva.ML_FILE, good + '{"condition": "x", "sentence_good": \n' + good)
    with pytest.raises(ValueError, match=r"corrupt JSON on line 4 of .*marvin_linzen2018_agreement"):
        load_text_dataset("sva", root, verify=False)


def test_corrupt_json_document_is_a_clear_error(tmp_path):
    root = tmp_path / "d"
    write_squad(root)
    _gz(root / squad.DEV_FILE, '{"version": "1.1", "data": [\n{"title": "t",,}]}')
    with pytest.raises(ValueError, match=r"corrupt JSON on line 2 of .*dev-v1.1"):
        load_text_dataset("squad", root, verify=False)


def test_missing_data_dir_names_the_environment_variable(tmp_path, monkeypatch):
    monkeypatch.setenv(sources.DATA_ENV, str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="QKOV_DATA_DIR"):
        load_text_dataset("sva")
    with pytest.raises(FileNotFoundError, match="does not exist.*QKOV_DATA_DIR.*fetch"):
        sources.resolve_data_dir()


def test_missing_file_names_the_file(tmp_path):
    (tmp_path / "d").mkdir()
    with pytest.raises(FileNotFoundError, match=r"marvin_linzen2018_agreement.jsonl.gz.*QKOV_DATA_DIR"):
        load_text_dataset("sva", tmp_path / "d")
    with pytest.raises(FileNotFoundError, match="no SQuAD train file"):
        load_text_dataset("squad", tmp_path / "d")


def test_relative_data_dir_is_resolved_against_the_repository(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    assert sources.resolve_data_dir("qkov_lib/data") == sources.REPO_ROOT / "qkov_lib" / "data"


def test_bad_arguments(fixture_dir):
    with pytest.raises(ValueError, match="unknown dataset 'imdb'"):
        load_text_dataset("imdb", fixture_dir)
    with pytest.raises(ValueError, match="max_len"):
        load_text_dataset("sva", fixture_dir, max_len=1)
    with pytest.raises(TypeError, match="unexpected keyword"):
        load_text_dataset("sva", fixture_dir, verify=False, colour="red")
    with pytest.raises(ValueError, match="query must be"):
        load_text_dataset("squad", fixture_dir, verify=False, query="bag")


# --- checksums, the manifest, the record of used files ----------------------------------------
def test_checksum_mismatch_is_detected(fixture_dir):
    # the fixture file sits at the manifest's path but is not the manifest's file
    with pytest.raises(sources.ChecksumError, match="checksum mismatch.*marvin_linzen2018_agreement"):
        load_text_dataset("sva", fixture_dir, verify=True)


def test_check_sha256_accepts_a_recompressed_copy(tmp_path):
    content = b'{"train": [], "val": [], "test": []}'
    p = tmp_path / "f.json.gz"
    p.write_bytes(gzip.compress(content, mtime=0))
    assert sources.check_sha256(p, "x", "0" * 64, hashlib.sha256(content).hexdigest()) == "content_sha256"
    assert sources.check_sha256(p, "x", hashlib.sha256(p.read_bytes()).hexdigest(), None) == "sha256"
    assert sources.check_sha256(p, "x", None, None) == "no checksum"
    p.write_bytes(gzip.compress(content + b" ", mtime=0))
    with pytest.raises(sources.ChecksumError, match="checksum mismatch for .*f.json.gz"):
        sources.check_sha256(p, "x", "0" * 64, hashlib.sha256(content).hexdigest())
    p.write_bytes(b"not gzip")
    with pytest.raises(sources.ChecksumError, match="not a readable gzip file"):
        sources.check_sha256(p, "x", "0" * 64, "1" * 64)


def test_data_file_records_the_sha256_of_what_was_used(fixture_dir):
    sources.clear_used()
    load_text_dataset("sva", fixture_dir, max_len=8, min_freq=1, test_frac=0.3, verify=False)
    path = fixture_dir / sva.ML_FILE
    assert sources.used_files() == {sva.ML_FILE: hashlib.sha256(path.read_bytes()).hexdigest()}
    sources.clear_used()
    assert sources.used_files() == {}


def test_manifest_is_complete():
    from qkov_lib.data.registry import CONVERTERS

    files, dls = sources.manifest(), sources.downloads()
    for rel, e in files.items():
        assert {"dataset", "license", "source", "build", "sha256", "content_sha256"} <= set(e), rel
        b = e["build"]
        if b:
            ids = [b["download"]] if "download" in b else b["inputs"]
            assert set(ids) <= set(dls) and (b.get("convert") in CONVERTERS or "download" in b), rel
            if "download" in b:
                assert dls[b["download"]]["path"] == rel
            # a built file is checked against a content checksum, else its line count
            assert e["content_sha256"] or e.get("lines"), rel
        elif not e.get("optional"):
            assert any(files[r]["build"] for r in sources.group_members(rel)), f"{rel}: no fetchable alternative"
    for did, d in dls.items():
        assert d["url"].startswith(("https://", "http://")) and d["store"] in ("gzip", "copy"), did
        assert d["sha256"] is None or len(d["sha256"]) == 64, did
        assert d["sha256_from"], did                    # where the checksum comes from, or why there is none
    unverified = [did for did, d in dls.items() if d["sha256"] is None]
    assert unverified == ["linzen2016/rnn_agr_simple.tar.gz"]
    for mod_file in (sva.ML_FILE, sva.LINZEN_TRAIN_FILE, sva.LINZEN_TEST_FILE, hatexplain.TRAIN_CSV, hatexplain.TRAIN_JSONL,
                     hatexplain.DIVISIONS, *hatexplain.SPLIT_FILES.values(), squad.DEV_FILE, *squad.TRAIN_FILES):
        assert mod_file in files


@needs_real
def test_local_files_match_the_manifest():
    status = sources.verify_all(REAL)
    assert status["squad/train-v1.1.json.gz"] == status[hatexplain.TRAIN_JSONL] == "missing (alternative present)"
    present = {k: v for k, v in status.items() if not v.startswith("missing") and not k.startswith("raw/")}
    assert len(present) == 11 and set(present.values()) == {"sha256"}
    raw = {k: v for k, v in status.items() if k.startswith("raw/")}
    assert len(raw) == 15 and set(raw.values()) == {"content_sha256"}      # the template pickles
    assert sources.missing_files(REAL) == []


# --- the Hugging Face hub fallback (QKOV_DATA_SOURCE=hub), offline -------------------------------
class _Split(list):
    _fingerprint = "fp"

    def to_list(self):
        return list(self)


def _fake_hub(calls):
    def load_dataset(name, **kw):
        calls.append(name)
        if name == "rajpurkar/squad":
            row = lambda i, t: {"id": i, "title": "t", "context": CTX, "question": f"Which {t}?",
                                "answers": {"text": [t], "answer_start": [CTX.index(t)]}}
            return {"train": _Split([row("a", "2016"), row("b", "in")]), "validation": _Split([row("c", "24")])}
        if name == "Hate-speech-CNERG/hatexplain":
            p = post("h1", [0, 0, 1], ["you", "vermin"], [[0, 1]])
            return {"train": _Split([p]), "validation": _Split([p]), "test": _Split([p, post("n1", [1, 1, 1], ["hi"])])}
        raise AssertionError(name)
    return load_dataset


def test_hub_fallback_reads_the_hub_names(monkeypatch):
    import datasets

    calls = []
    monkeypatch.setattr(datasets, "load_dataset", _fake_hub(calls))
    monkeypatch.setenv(sources.SOURCE_ENV, "hub")
    monkeypatch.setenv(sources.DATA_ENV, "/nonexistent/never/read")
    sources.clear_used()
    sq = load_text_dataset("squad", max_len=30, min_freq=1)
    assert calls == ["rajpurkar/squad"]
    assert sq.report["train_skipped_ambiguous_span"] == 1 and sq.train_info["id"] == ["a"]   # same filter on hub data
    hx = load_text_dataset("hatexplain", max_len=10, min_freq=1)
    assert calls == ["rajpurkar/squad", "Hate-speech-CNERG/hatexplain"]
    assert hx.test.y.tolist() == [0, 1] and hx.report["test_with_rationale"] == 1
    assert set(sources.used_files()) == {"hub:rajpurkar/squad", "hub:Hate-speech-CNERG/hatexplain"}
    with pytest.raises(FileNotFoundError, match="data directory '/nonexistent/never/read'"):
        load_text_dataset("sva")                         # no hub copy: the local files are needed
    monkeypatch.setenv(sources.SOURCE_ENV, "cloud")
    with pytest.raises(ValueError, match="source must be 'local' or 'hub'"):
        load_text_dataset("squad")


def test_hub_failure_says_what_to_do(monkeypatch):
    import datasets

    def offline(name, **kw):
        raise ConnectionError("no network")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(RuntimeError, match="could not load the hub copy 'rajpurkar/squad'.*QKOV_DATA_DIR"):
        sources.load_hub("squad")


# --- official numbers (data README) ---------------------------------------------------------
@needs_real
def test_squad_counts_match_the_readme():
    train = list(squad.flatten(sources.load_rows("json", REAL / sources.first_present(squad.TRAIN_FILES, REAL), field="data")))
    dev = list(squad.flatten(sources.load_rows("json", REAL / squad.DEV_FILE, field="data")))
    assert len(train) == 87_599 and len(dev) == 10_570
    assert sum(squad.answer_occurrences(q["context"], q["text"]) == 1 for q in train) == 78_161   # exact spans
    report: dict = {}
    kept = [e for q in dev if (e := squad.question_example(q, 10_000, 64, "wh", report, "test", False))]
    assert report["test_read"] == 10_570 and report.get("test_skipped_answer_not_found", 0) == 0
    assert len(kept) == 10_570 - sum(v for k, v in report.items() if "_skipped_" in k)


@needs_real
def test_hatexplain_counts_match_the_readme():
    assert hatexplain.official_split_sizes(REAL) == {"train": 15_383, "val": 1_922, "test": 1_924}
    ds = load_text_dataset("hatexplain", REAL, max_len=400)
    r = ds.report
    assert r["train_read"] == r["train_used"] == 15_383 and r["test_read"] == r["test_used"] == 1_924
    assert r["test_with_rationale"] == 1_142 and r.get("test_empty_rationale", 0) == 0
    assert torch.bincount(ds.train.y).tolist() == [4_748, 6_251, 4_384]   # hatespeech, normal, offensive
    assert r.get("train_majority_label_disagrees", 0) == 0


@needs_real
def test_sva_counts_match_the_readme():
    ml = load_text_dataset("sva", REAL)
    assert ml.report["all_read"] == 121_220
    assert ml.report["train_split"] + ml.report["test_split"] == ml.report["all_distinct_prefixes"] - \
        sum(v for k, v in ml.report.items() if k.startswith("all_skipped_"))
    lz = load_text_dataset("sva_linzen", REAL, max_len=200)
    assert lz.report["train_read"] == len(lz.train) == 15_772
    assert torch.bincount(lz.train.y).tolist() == [10_763, 5_009]               # VBZ, VBP
    k = torch.tensor(lz.test_info["n_attractors"])
    assert torch.bincount(k)[1:].tolist() == [52_599, 9_380, 2_051, 561, 159]


def test_capped_words_counts_empty_and_cut():
    from qkov_lib.data.text import capped_words

    report: dict[str, int] = {}
    assert capped_words("  ", 5, "left", report, "train", "prefix") is None
    assert capped_words("a b c d e f", 5, "left", report, "train", "prefix") == ["c", "d", "e", "f"]
    assert capped_words("a b c d e f", 5, "right", report, "test", "post") == ["a", "b", "c", "d"]
    assert capped_words("a b", 5, "right", report, "test", "post") == ["a", "b"]
    assert report == {"train_skipped_empty_prefix": 1, "train_truncated_prefix_over_cap": 1,
                      "test_truncated_post_over_cap": 1}


# --- integrity of a real data folder: the preflight and verify on broken copies ----------------
@pytest.fixture
def real_copy(tmp_path, monkeypatch):
    """A writable copy of the real data folder (the files the chapters read and the raw pickles)."""
    import shutil

    if REAL is None:
        pytest.skip(WHY)
    monkeypatch.delenv(sources.ALLOW_ENV, raising=False)
    dest = tmp_path / "data"
    shutil.copytree(REAL, dest)
    for p in dest.rglob("*"):
        p.chmod(0o755 if p.is_dir() else 0o644)
    return dest


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_truncated_file_stops_the_preflight_before_any_chapter(real_copy):
    """``make data-check`` as the Makefile runs it, with ``-S`` so that no installed package is
    importable: the standard library alone finds the truncated file and stops, naming it."""
    import subprocess
    import sys

    bad = real_copy / hatexplain.SPLIT_FILES["test"]
    bad.write_bytes(bad.read_bytes()[:1000])
    before = _tree(real_copy)
    script = sources.REPO_ROOT / "qkov_lib" / "data" / "sources.py"
    env = {"PATH": "/usr/bin:/bin", sources.DATA_ENV: str(real_copy)}
    # the probe as `make book` runs it before set-up (a plain script, standard library only), and
    # the check that fetches what is missing (`qkov data check --fetch`, in the environment)
    for cmd in ([sys.executable, "-S", str(script), "check", "--probe"],
                [sys.executable, "-m", "qkov_lib.data.fetch", "check", "--fetch"]):
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120, cwd=sources.REPO_ROOT)
        assert r.returncode == 1, r.stderr
        assert f"  - {bad}: not a readable gzip file" in r.stderr and r.stderr.count("fail their check") == 1
        assert "qkov data fetch" in r.stderr and "QKOV_DATA_DIR" in r.stderr and r.stdout == ""
    assert _tree(real_copy) == before                   # nothing deleted, fetched or rewritten


def test_verify_lists_every_problem_and_fails(real_copy, capsys):
    test_file, val_file = real_copy / hatexplain.SPLIT_FILES["test"], real_copy / hatexplain.SPLIT_FILES["val"]
    test_file.write_bytes(test_file.read_bytes()[:1000])                      # truncated
    val_file.write_bytes(gzip.compress(b'{"id": "x"}\n'))                    # another file
    (real_copy / sva.ML_FILE).unlink()                                        # missing
    (real_copy / "sva" / "blimp_subject_verb_agreement.jsonl.gz").unlink()    # optional: fine
    assert sources.main(["verify", "--data-dir", str(real_copy)]) == 1
    err = capsys.readouterr().err
    assert "3 problem(s)" in err and "blimp" not in err
    assert f"  - {test_file}: not a readable gzip file" in err
    assert f"  - checksum mismatch for {val_file}" in err and f"  - {sva.ML_FILE}: missing" in err
    status = sources.verify_all(real_copy)
    assert status["sva/blimp_subject_verb_agreement.jsonl.gz"] == "missing (optional)"
    assert len(sources.problems(status)) == 3


def test_verify_of_an_empty_folder_fails(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert sources.main(["verify", "--data-dir", str(tmp_path / "empty")]) == 1
    err = capsys.readouterr().err
    groups = sources.required_files()
    assert f"{len(groups)} problem(s)" in err
    assert all(f"  - {g[0]}: missing" in err for g in groups) and "optional" not in err


def test_unchecksummed_train_file_beside_the_csv_is_refused(real_copy, monkeypatch):
    """A 300-post ``hatexplain_train.jsonl.gz`` made from the validation split, beside the
    checksummed train CSV: refused with a message naming it (never preferred to the CSV); with
    the opt-in it is read, and its 300 posts are not the 15,383 of the manifest."""
    val = gzip.decompress((real_copy / hatexplain.SPLIT_FILES["val"]).read_bytes()).splitlines(keepends=True)
    fake = real_copy / hatexplain.TRAIN_JSONL
    fake.write_bytes(gzip.compress(b"".join(val[:300])))
    name = r"hatexplain_train.jsonl.gz has no checksum in the manifest"
    with pytest.raises(sources.UnverifiedError, match=name + r".*loaders read hatexplain/hatexplain_train_no_rationales"):
        load_text_dataset("hatexplain", real_copy)
    with pytest.raises(sources.DataUnavailable, match=name):
        fetch.ensure(real_copy)
    assert sources.main(["verify", "--data-dir", str(real_copy)]) == 1
    monkeypatch.setenv(sources.ALLOW_ENV, "1")
    assert fetch.ensure(real_copy) == {}
    with pytest.raises(sources.RecordCountError, match=r"hatexplain_train.jsonl.gz: 300 posts, expected 15383"):
        load_text_dataset("hatexplain", real_copy)


def test_wrong_record_count_of_a_checksummed_file(real_copy, tmp_path, monkeypatch):
    """The count check on read, for a file that passes its checksum: a manifest expecting one
    prefix fewer (e.g. a mirror's) stops the loader with both counts."""
    doc = json.loads(sources.MANIFEST_PATH.read_text())
    doc["files"][sva.LINZEN_TRAIN_FILE]["records"]["prefixes"] = 15_771
    (tmp_path / "m.json").write_text(json.dumps(doc))
    monkeypatch.setenv(sources.MANIFEST_ENV, str(tmp_path / "m.json"))
    with pytest.raises(sources.RecordCountError, match=r"linzen2016_numpred.val.tsv.gz: 15772 prefixes, expected 15771"):
        load_text_dataset("sva_linzen", real_copy)
