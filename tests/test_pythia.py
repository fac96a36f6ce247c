"""Tests of qkov_lib.studies.pythia: the knob on a Pythia-architecture GPT-NeoX model built
from a config (nothing downloaded), trained on the synthetic distinct/common-token task."""

from __future__ import annotations

import pytest
import torch

from qkov_lib import profiles
from qkov_lib.data.batch import Batch
from qkov_lib.data.synthetic import sample
from qkov_lib.studies import pythia

CFG = profiles.resolve(pythia.PROFILES, "test")


@pytest.fixture(scope="module")
def runs():
    return pythia.run_grid(CFG)


def small_model():
    # float32 as trained (transformers' float64 eager mask turns fully padded query rows into NaN)
    return pythia.build_model(pythia.task_of(CFG), CFG, seed=0).eval()


def test_config_is_pythia_architecture_and_checks_sizes():
    cfg = pythia.pythia_config(20, 16, 2, 4, 8, pad_id=19)
    assert cfg.use_parallel_residual and not cfg.tie_word_embeddings and cfg.attention_bias
    assert cfg.rope_parameters["partial_rotary_factor"] == 0.25 and cfg.intermediate_size == 64
    assert cfg.hidden_act == "gelu" and cfg.hidden_dropout == 0.0 and cfg.attention_dropout == 0.0
    model = pythia.build_model(pythia.task_of(CFG), CFG, seed=0)
    assert type(model).__name__ == "GPTNeoXForCausalLM"
    assert model.config.vocab_size == pythia.task_of(CFG).pad_id + 1
    with pytest.raises(ValueError, match="multiple of n_heads"):
        pythia.pythia_config(20, 10, 2, 4, 8, pad_id=19)
    with pytest.raises(ValueError, match="pad_id 20"):
        pythia.pythia_config(20, 16, 2, 4, 8, pad_id=20)


def test_same_seed_same_initial_model_and_global_rng_untouched():
    state = torch.random.get_rng_state()
    a, b = small_model(), small_model()
    assert torch.equal(torch.random.get_rng_state(), state)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))  # exact: same seed, same code


def test_query_readout_ignores_left_padding_and_masks_padding():
    """Extra left padding changes neither the query's logits nor its attention on real tokens
    (rotary embeddings are relative; padding is masked): the readout is the query's row."""
    model, task = small_model(), pythia.task_of(CFG)
    b = sample(task, 6, torch.Generator().manual_seed(0))
    pad = torch.full((6, 3), task.pad_id)
    wide = Batch(torch.cat([pad, b.tokens], 1), torch.cat([pad != pad, b.key_mask], 1),
                 torch.cat([pad != pad, b.relevant], 1), b.y)
    with torch.no_grad():
        logits, maps = pythia.query_readout(model, b, attentions=True)
        logits_w, maps_w = pythia.query_readout(model, wide, attentions=True)
    assert len(maps) == CFG["n_layers"] and maps[0].shape == (6, CFG["n_heads"], task.seq_len, task.seq_len)
    assert torch.allclose(logits, logits_w, atol=1e-5)
    real = b.tokens != task.pad_id
    for m, mw in zip(maps, maps_w):
        q, qw = m[:, :, -1], mw[:, :, -1]
        # exact zeros: padded keys get exp(finfo.min - max) = 0
        assert torch.allclose(q, qw[..., 3:], atol=1e-6) and float(qw[..., :3].abs().max()) == 0.0
        assert float((q * ~real[:, None]).abs().max()) == 0.0  # no attention on padding
        assert torch.allclose(q.sum(-1), torch.ones_like(q.sum(-1)))


def test_evaluate_reads_the_query_attention_on_the_distinct_token():
    model, task = small_model(), pythia.task_of(CFG)
    test = sample(task, 32, torch.Generator().manual_seed(1))
    scores, heads = pythia.evaluate(model, test)
    with torch.no_grad():
        logits, maps = pythia.query_readout(model, test, attentions=True)
    pos = test.relevant.long().argmax(1)  # one distinct token per sequence
    for layer in (1, 2):
        for head in (1, 2):
            by_hand = maps[layer - 1][torch.arange(32), head - 1, -1, pos].mean()
            row = heads[(heads["layer"] == layer) & (heads["head"] == head)]
            assert float(row["attn_relevant"].iloc[0]) == pytest.approx(float(by_hand), abs=1e-6)
    real = test.tokens != task.pad_id
    assert float(heads["uniform"].iloc[0]) == pytest.approx(float((1.0 / real.sum(1)).mean()))
    assert scores["accuracy"] == pytest.approx(float((logits.argmax(-1) == test.y).double().mean()))
    assert scores["loss"] == pytest.approx(float(torch.nn.functional.cross_entropy(logits, test.y)), rel=1e-6)


@pytest.mark.parametrize("ratio", [1.0, 10.0])
def test_first_adamw_step_moves_interleaved_qk_slices_by_the_ratio(ratio):
    report, moves = pythia.first_step_moves(CFG, ratio)
    d = CFG["d_model"] // CFG["n_heads"]
    parts = [(e.part, e.start) for e in report.entries if e.tensor == "gpt_neox.layers.0.attention.query_key_value.weight"]
    assert parts == [(p, i * d) for i, p in enumerate("QKV" * CFG["n_heads"])]  # [n_heads, 3, d_head]
    assert moves["Q"] / moves["V"] == pytest.approx(ratio, rel=0.02)
    assert moves["K"] / moves["V"] == pytest.approx(ratio, rel=0.02)
    assert moves["V"] == pytest.approx(CFG["eta_ov"], rel=0.02)
    f = pythia.knob_facts(report, moves, ratio)
    # one slice per head and part; each head's adjacent Q and K rows share one leaf, its V rows another
    assert f["py_slices"] == str(3 * CFG["n_heads"]) and f["py_leaves"] == str(2 * CFG["n_heads"])
    assert f["py_demo_ratio"] == f"{ratio:g}" and f["py_demo_qv"] == f"{moves['Q'] / moves['V']:.2f}"


def test_training_learns_is_deterministic_and_facts(runs):
    assert [(r.ratio, r.seed) for r in runs] == [(1.0, 0), (10.0, 0)]
    for r in runs:
        assert r.test["accuracy"] > 1.0 / CFG["n_classes"]  # above chance
        d, L = CFG["d_model"], CFG["n_layers"]
        assert r.knob_summary.loc["qk", "numel"] == L * (2 * d * d + 2 * d)  # Q and K rows of every layer, + biases
    again = pythia.train_one(CFG, 10.0, 0)
    # exact: run_grid calls this same train_one, with the same seed, test set and threads
    assert again.test == runs[1].test and again.heads.equals(runs[1].heads)
    table = pythia.summary_table(runs)
    assert list(table["layer"].unique()) == [1, 2, "rollout"] and set(table["ratio"]) == {1.0, 10.0}
    assert ((table["head-mean"] >= 0) & (table["head-mean"] <= 1)).all()
    f = pythia.facts(runs, CFG)
    assert f["py_ratios"] == "1, 10" and f["py_acc"].count(",") == 1
    assert f["py_layers"].startswith("layer 1: head-mean ")
    assert all(isinstance(v, str) for v in f.values())


def test_bad_ratio_is_refused():
    with pytest.raises(ValueError, match="ratio"):
        pythia.train_one(CFG, 0.0, 0)


def _tiny_sva():
    """Prefixes "the dog(s) near cat(s)...": the number is the subject's (word 1), attractors after
    it carry the other number; roles as the SVA loader stores them (one letter per word)."""
    from qkov_lib.data import sva
    from qkov_lib.data.text import Example, finish

    exs = []
    for i in range(96):
        y, k = i % 2, 1 + i % 3
        words = ["the", "dogs" if y else "dog", "near", *(["cat" if y else "cats"] * k)]
        exs.append(Example(words, [1], y, info={"roles": "-S-" + "A" * k}))
    return finish("sva", exs[:64], exs[64:], sva.CLASS_NAMES, {}, 1)


def test_one_head_roles_trains_token_models_with_its_profile_settings():
    """The stack of one_head_roles equals a TokenModel trained alone by training.train with the
    settings of ONE_HEAD_PROFILES (float32: stack and loop differ by summation order, 1e-5);
    the role masses partition the attention (sum 1 per ratio)."""
    from qkov_lib.studies import agreement_roles
    from qkov_lib.models import TokenModel
    from qkov_lib.runtime import seed_everything
    from qkov_lib.train import TrainConfig, predict, train

    ds = _tiny_sva()
    roles, acc, rcfg = pythia.one_head_roles(ds, {"ratios": [1.0, 10.0], "seeds": [0]}, "test")
    assert rcfg["steps"] == pythia.ONE_HEAD_PROFILES["test"]["steps"] and rcfg["ratios"] == [1.0, 10.0]
    assert list(roles.index) == [1.0, 10.0] and acc["accuracy"].between(0, 1).all()
    assert (roles[list(agreement_roles.ROLES)].sum(axis=1) - 1).abs().max() < 1e-6  # the roles partition the keys
    m = TokenModel(ds.vocab_size, rcfg["d_model"], ds.n_classes, ds.max_len, generator=seed_everything(0),
                   parameterization=rcfg["parameterization"], init_scale=rcfg["init_scale"])
    train(m, ds.train, TrainConfig(optimizer="adamw", eta_ov=rcfg["eta_ov"], ratio=10.0, steps=rcfg["steps"],
                                   batch_size=rcfg["batch_size"], n_logs=rcfg["n_logs"], seed=0, progress=False,
                                   log_subsample=rcfg["log_subsample"]))
    attn, _ = predict(m, ds.test)
    alone = agreement_roles.role_mass(attn, ds.test_info["roles"], ds.test.key_mask)
    for r in ("subject", "attractor", "rest"):
        assert abs(roles.loc[10.0, r] - alone[r]) < 1e-5, r
    assert abs(roles.loc[10.0, "subject"] - roles.loc[1.0, "subject"]) > 1e-6  # the ratio changes the model
