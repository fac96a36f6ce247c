"""SVA token roles (qkov_lib.data.sva.prefix_roles, qkov_lib.experiments.sva_roles) and the
natural-prefix model: roles worked out by hand on template sentences of different conditions,
non-overlapping masks that cover exactly the keys, masses and logit-margin shares against direct
sums, the model's shapes, left-padding invariance and determinism, and clear errors."""

import pytest
import torch

from qkov_lib.data import sources, sva
from qkov_lib.data.batch import Batch, left_pad
from qkov_lib.data.text import PAD_ID, load_text_dataset
from qkov_lib.experiments import sva_roles as sr

NOUNS = frozenset("author authors pilot chef chefs parent driver drivers mechanic teacher tennis colleagues "
                  "officer guards".split())
VERBS = frozenset("is are admires admire likes like enjoys enjoy swims swim smiles smile".split())

# (condition, prefix, subject index, roles by hand)
HAND = [
    ("simple_agrmt", "the author", 1, "-S"),
    ("obj_rel_across_anim", "the author that the chef admires", 1, "-S--AV"),        # verb agrees with chef
    ("obj_rel_no_comp_across_anim", "the author the chefs admire", 1, "-S-AV"),
    ("obj_rel_within_anim", "the author that the chefs", 4, "-A--S"),                 # target = embedded verb
    ("subj_rel", "the pilot that admires the taxi driver", 1, "-S-V--A"),             # "taxi" is no noun
    ("prep_anim", "the author to the side of the parent", 1, "-S-----A"),             # "side" is no noun
    ("sent_comp", "the mechanic said the author", 4, "-A--S"),                        # "said" has no number
    ("vp_coord", "the author is tall and", 1, "-SV-L"),
    ("vp_coord", "the pilot swims and", 1, "-SVL"),
    ("long_vp_coord", "the teacher enjoys playing tennis with colleagues and", 1, "-SV-A-AL"),
]


@pytest.mark.parametrize("cond,prefix,s,want", HAND, ids=[h[0] + ":" + h[1] for h in HAND])
def test_prefix_roles_by_hand(cond, prefix, s, want):
    assert sva.prefix_roles(prefix.split(), s, NOUNS, VERBS) == want


def test_prefix_roles_errors():
    with pytest.raises(ValueError, match="non-empty"):
        sva.prefix_roles([], 0, NOUNS, VERBS)
    with pytest.raises(ValueError, match="subject_index 3 is outside"):
        sva.prefix_roles("the author".split(), 3, NOUNS, VERBS)


def _row(sentence, v, s, cond="simple_agrmt"):
    w = sentence.split()
    return {"condition": cond, "sentence_good": sentence, "verb_good": w[v], "verb_bad": w[v] + "x", "subject": w[s]}


def test_template_lexicon_takes_subjects_first_nouns_and_verb_forms():
    rows = [_row("the mechanic said the author smiles", 5, 4, "sent_comp"), _row("the taxi driver is", 3, 2)]
    nouns, verbs = sva.template_lexicon(rows)
    assert {"author", "mechanic", "driver"} <= nouns and "taxi" not in nouns and "the" not in nouns
    assert verbs == {"smiles", "smilesx", "is", "isx"}
    with pytest.raises(ValueError, match="both template nouns and verb forms"):
        sva.template_lexicon([_row("the smiles smiles", 2, 1)])


def _batch(prefixes, T=None, y=None):
    """Left-padded batch of word-id prefixes (ids 3..) with a query column that is no key."""
    seqs = [list(range(3, 3 + n)) + [2] for n in prefixes]
    tokens, real = left_pad(seqs, PAD_ID, T)
    key_mask = real.clone()
    key_mask[:, -1] = False
    y = torch.tensor(y if y is not None else [0] * len(prefixes))
    return Batch(tokens, key_mask, torch.zeros_like(real), y)


def test_role_masks_place_words_left_padded_and_do_not_overlap():
    roles = ["-S--AV", "-S", "-SV-L"]
    b = _batch([len(r) for r in roles])
    m = sr.role_masks(roles, b.key_mask)
    T = b.tokens.shape[1]
    assert set(m) == set(sr.ROLES) and T == 7
    assert m["subject"][0].nonzero().flatten().tolist() == [1]          # "-S--AV" fills columns 0..5
    assert m["verb"][0].nonzero().flatten().tolist() == [5]
    assert m["subject"][1].nonzero().flatten().tolist() == [5]          # "-S" fills columns 4..5
    assert m["last"][2].nonzero().flatten().tolist() == [5] and m["verb"][2].nonzero().flatten().tolist() == [3]
    stacked = torch.stack(list(m.values())).long()
    assert torch.equal(stacked.sum(0), b.key_mask.long())               # a partition of the keys


def test_role_masks_errors():
    b = _batch([2, 3])
    with pytest.raises(ValueError, match="unknown role letters"):
        sr.role_masks(["-S", "-SX"], b.key_mask)
    with pytest.raises(ValueError, match="2 role strings for 3 rows"):
        sr.role_masks(["-S", "-SA"], _batch([2, 3, 1]).key_mask)
    with pytest.raises(ValueError, match="do not cover exactly the keys"):
        sr.role_masks(["-S", "-S"], b.key_mask)
    with pytest.raises(ValueError, match="roles for a row"):
        sr.role_masks(["-S", "-SAAAAAAAA"], b.key_mask)


def test_role_mass_against_hand_sums():
    roles = ["-S-A", "SL"]
    b = _batch([4, 2])                                                   # T = 5
    attn = torch.tensor([[0.1, 0.5, 0.1, 0.3, 0.0], [0.0, 0.0, 0.6, 0.4, 0.0]]) * torch.cat(
        [torch.ones(2, 4), torch.zeros(2, 1)], 1)
    attn = attn / attn.sum(1, keepdim=True)
    out = sr.role_mass(attn, roles, b.key_mask)
    assert out["subject"] == pytest.approx((0.5 + 0.6) / 2)
    assert out["attractor"] == pytest.approx(0.3 / 2)
    assert out["last"] == pytest.approx(0.4 / 2)
    assert out["rest"] == pytest.approx(0.2 / 2)
    assert out[sr.LAST_ANY] == pytest.approx((0.3 + 0.4) / 2)            # column T-2, whatever the role
    assert sum(out[r] for r in sr.ROLES) == pytest.approx(1.0)


def test_role_table_groups_and_accuracy():
    roles = ["-S-A", "SL", "-S"]
    b = _batch([4, 2, 2], y=[0, 1, 1])
    attn = torch.softmax(torch.randn(3, 5, generator=torch.Generator().manual_seed(0)).masked_fill(~b.key_mask, -1e9), 1)
    probs = torch.tensor([[0.9, 0.1], [0.8, 0.2], [0.3, 0.7]])
    t = sr.role_table(attn, probs, b, roles, ["a", "b", "b"]).set_index("condition")
    assert t.loc["all", "n"] == 3 and t.loc["b", "n"] == 2
    assert t.loc["all", "accuracy"] == pytest.approx(2 / 3) and t.loc["b", "accuracy"] == pytest.approx(0.5)
    subj = (attn * sr.role_masks(roles, b.key_mask)["subject"]).sum(1)
    assert t.loc["all", "AC@0.5"] == pytest.approx(float((subj >= 0.5).double().mean()))
    with pytest.raises(ValueError, match="lengths differ"):
        sr.role_table(attn, probs, b, roles, ["a", "b"])


def _model(seed=0, **kw):
    g = torch.Generator().manual_seed(seed)
    return sr.ContextHeadModel(20, 8, 2, 12, kernel=3, layers=2, generator=g, parameterization=kw.pop("p", "FAFO"), **kw)


def test_context_model_shapes_and_left_padding_invariance():
    b6, b11 = _batch([4, 2], T=6), _batch([4, 2], T=11)
    for p in ("FAFO", "CAFO", "FACO", "CACO"):
        m = _model(p=p).requires_grad_(False)
        lo6, a6 = m(b6.tokens, b6.key_mask)
        lo11, a11 = m(b11.tokens, b11.key_mask)
        assert lo6.shape == (2, 2) and a6.shape == (2, 6) and a11.shape == (2, 11)
        torch.testing.assert_close(lo6, lo11, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(a6, a11[:, 5:], rtol=1e-5, atol=1e-6)
        # exact: softmax gives masked keys exp(-inf) = 0
        assert float(a11[:, :5].abs().sum()) == 0.0 and float(a6[:, -1].abs().sum()) == 0.0


def test_context_model_depends_on_neighbours_only_through_the_encoder():
    b = _batch([5], T=7)
    other = b.tokens.clone()
    other[0, 1] = 15                                                    # change the first word
    for enc, changed in (("conv", True), ("none", False)):
        m = _model(encoder=enc)
        x, x2 = m.encode(b.tokens), m.encode(other)
        assert bool((x[0, 3] - x2[0, 3]).abs().max() > 1e-6) is changed  # 2 words away: seen by 2 convs of width 3


def test_context_model_is_deterministic_and_checks_input():
    b = _batch([3, 5])
    # exact: the same seed and the same forward twice
    torch.testing.assert_close(_model(1)(b.tokens, b.key_mask), _model(1)(b.tokens, b.key_mask), rtol=0, atol=0)
    assert not torch.equal(_model(1)(b.tokens, b.key_mask)[0], _model(2)(b.tokens, b.key_mask)[0])
    with pytest.raises(ValueError, match="exceeds the model's max_len"):
        _model()(*(lambda c: (c.tokens, c.key_mask))(_batch([3], T=13)))
    with pytest.raises(ValueError, match="kernel must be a positive odd"):
        sr.ContextHeadModel(20, 8, 2, 12, kernel=4)
    with pytest.raises(ValueError, match="encoder must be"):
        sr.ContextHeadModel(20, 8, 2, 12, encoder="lstm")
    with pytest.raises(ValueError, match="expected tokens and key_mask"):
        _model()(b.tokens, b.key_mask[:, :-1])


def test_margin_by_role_adds_up_to_the_logit_margin():
    roles = ["-SAV-", "-S-L"]
    b = _batch([5, 4], y=[0, 1])
    m = _model(3).requires_grad_(False)
    out = sr.margin_by_role(m, b, roles)
    logits, _ = m(b.tokens, b.key_mask)
    sign = torch.tensor([1.0, -1.0])
    direct = float(((logits[:, 0] - logits[:, 1]) * sign).mean())
    assert out["margin"] == pytest.approx(direct, rel=1e-4, abs=1e-6)
    assert sum(out[r] for r in sr.ROLES) == pytest.approx(out["margin"], rel=1e-4, abs=1e-6)


def test_split_validation_is_disjoint_and_seeded():
    b = _batch([2] * 20, y=list(range(20)))
    tr, va = sr.split_validation(b, 0.25, seed=0)
    assert len(tr) == 15 and len(va) == 5
    assert set(tr.y.tolist()) | set(va.y.tolist()) == set(range(20)) and not set(tr.y.tolist()) & set(va.y.tolist())
    assert torch.equal(sr.split_validation(b, 0.25, seed=0)[1].y, va.y)
    with pytest.raises(ValueError, match="val_frac must lie"):
        sr.split_validation(b, 1.0, 0)


REAL, WHY = sources.find_data_dir()


@pytest.mark.skipif(REAL is None, reason=WHY)
def test_real_marvin_linzen_roles_agree_with_the_subject_index():
    ds = load_text_dataset("sva", n_train=50, n_test=300)
    roles = ds.test_info["roles"]
    m = sr.role_masks(roles, ds.test.key_mask)
    assert torch.equal(m["subject"], ds.test.relevant)                  # the subject letter = the exact index
    by = dict(zip(ds.test_info["condition"], roles))
    assert "V" in by["obj_rel_across_anim"] and "V" not in by["obj_rel_within_anim"]
    assert "V" not in by.get("sent_comp", "") and "A" in by["prep_anim"]


def _tiny_linzen():
    """A learnable toy: the number is the first word's (``dog`` / ``dogs``), attractors after it."""
    from qkov_lib.data.text import Example, finish

    g = torch.Generator().manual_seed(0)
    exs = []
    for i in range(120):
        y = i % 2
        k = 1 + i % 3
        words = ["the", "dogs" if y else "dog", "near", *(["cat" if y else "cats"] * k)]
        exs.append(Example(words, [], y, info={"n_attractors": k}))
    perm = torch.randperm(120, generator=g).tolist()
    return finish("sva_linzen", [exs[i] for i in perm[:80]], [exs[i] for i in perm[80:]], sva.CLASS_NAMES, {}, 1)


def test_natural_grid_runs_and_is_deterministic():
    from qkov_lib.profiles import resolve

    ds = _tiny_linzen()
    cfg = resolve(sr.NATURAL_PROFILES, "test", d_model=16, ratios=[1.0, 10.0], steps=30, patience=2, log_every=5)
    a, b = sr.natural_grid(ds, cfg), sr.natural_grid(ds, cfg)
    assert list(a["n_attractors"].unique()) == ["all", "1", "2", "3"]
    assert a["n"][a["n_attractors"] == "all"].eq(40).all() and set(a["ratio"]) == {1.0, 10.0}
    assert a.equals(b)  # exact: the same code on the same seeds and thread count twice
    with pytest.raises(ValueError, match="has no n_attractors"):
        sr.attractor_accuracy(sr.make_natural_model(ds, cfg, 0), type(ds)(**{**ds.__dict__, "test_info": {}}))


def test_model_role_table_needs_roles_and_a_known_grouping():
    ds = _tiny_linzen()
    m = _model()
    with pytest.raises(ValueError, match="has no token roles"):
        sr.model_role_table(m, ds)
    ds.test_info["roles"] = ["-" * len(ds.decode("test", i)[:-1]) for i in range(len(ds.test))]
    ds.test_info["condition"] = ["c"] * len(ds.test)
    with pytest.raises(ValueError, match="by must be 'condition' or 'target'"):
        sr.model_role_table(m, ds, by="verb")
    t = sr.model_role_table(m, ds, by="target").set_index("condition")
    assert set(t.index) == {"all", "singular", "plural"} and t.loc["all", "rest"] == pytest.approx(1.0)


def test_default_number_table_picks_the_number_with_lower_ac():
    import pandas as pd

    role = {r: 0.0 for r in sr.ROLES}
    bt = pd.DataFrame([
        {"ratio": 1.0, "seed": 0, "condition": "all", "AC@0.5": 0.5, "accuracy": 1.0, **role},
        {"ratio": 1.0, "seed": 0, "condition": "singular", "AC@0.5": 0.2, "accuracy": 0.9, **role, "verb": 0.7},
        {"ratio": 1.0, "seed": 0, "condition": "plural", "AC@0.5": 0.9, "accuracy": 0.8, **role}])
    mg = pd.DataFrame([{"ratio": 1.0, "seed": 0, "target": "singular", "subject": 1.0, "margin": 4.0},
                       {"ratio": 1.0, "seed": 0, "target": "plural", "subject": 3.0, "margin": 3.0}])
    row = sr.default_number_table(bt, mg).iloc[0]
    assert row["default"] == "singular" and row["AC marked"] == 0.9 and row["verb default"] == 0.7
    # exact: copied inputs and the binary fractions 1/4 and 3/3
    assert row["subject share of margin, default"] == 0.25 and row["subject share of margin, marked"] == 1.0
    with pytest.raises(ValueError, match="both target numbers"):
        sr.default_number_table(bt.iloc[:2], mg)


def test_role_facts_follow_the_numbers():
    import pandas as pd

    def frames(subject_hi, share_hi):
        rows = []
        for r, subj, verb in ((1.0, 0.7, 0.05), (100.0, subject_hi, 0.05 + 0.7 - subject_hi)):
            rows.append({"condition": "all", "ratio": r, "seed": 0, "accuracy": 0.96, "AC@0.5": subj + 0.1,
                         "subject": subj, "attractor": 0.15, "verb": verb, "last": 0.0, "rest": 0.1,
                         "last position": 0.2})
        default = pd.DataFrame([{"ratio": 1.0, "seed": 0, "subject share of margin, default": 0.97},
                                {"ratio": 100.0, "seed": 0, "subject share of margin, default": share_hi}])
        return {"condition": pd.DataFrame(rows), "default": default}

    f = sr.role_facts(frames(0.35, 0.37))
    assert f["role_subject_lo"] == "70.0 %" and f["role_subject_hi"] == "35.0 %"
    assert "verb (+35.0 points)" in f["role_sentence"] and "leaves the subject" in f["role_sentence"]
    g = sr.role_facts(frames(0.75, 0.99))
    assert "still carries the prediction" in g["role_sentence"] and "nowhere" in g["role_sentence"]
