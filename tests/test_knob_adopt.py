"""The knob in an ordinary training workflow (qkov_lib.knob, qkov_lib.knob_trainer).

Checkpoints: a split model's state dict has the original keys and shapes, in both directions
with ``strict=True``, and through ``save_pretrained`` / ``from_pretrained`` of real
``transformers`` classes (tiny random configs, nothing downloaded). The one-call form takes any
optimizer class; weight decay skips biases and norms; every refused call leaves the model
untouched; ``models.param_groups`` refuses a ratio that would act on nothing; schedulers keep the
ratio; the ``transformers`` Trainer trains, checkpoints, resumes and reloads with per-group rates.
"""

from __future__ import annotations

import copy
import io
import json
import math
import warnings

import pytest
import torch
from torch import nn

from qkov_lib import knob
from qkov_lib.models import TokenModel, param_groups

E, H = 8, 2
TINY = dict(num_hidden_layers=2, hidden_size=E, num_attention_heads=H, intermediate_size=16, vocab_size=20,
            max_position_embeddings=8)


def encoder(seed=0) -> nn.Module:
    torch.manual_seed(seed)
    layer = nn.TransformerEncoderLayer(E, H, 16, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).double()


def x_in() -> torch.Tensor:
    return torch.randn(3, 5, E, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


def snapshot(model: nn.Module) -> dict:
    """Names, identities and values of every parameter (to show a refused call changed nothing)."""
    return {n: (id(p), p.detach().clone()) for n, p in model.named_parameters()}


def unchanged(model: nn.Module, snap: dict) -> bool:
    now = snapshot(model)
    return list(now) == list(snap) and all(now[n][0] == snap[n][0] and torch.equal(now[n][1], snap[n][1]) for n in snap)


def train_steps(model: nn.Module, opt, steps: int = 3) -> None:
    for _ in range(steps):
        opt.zero_grad()
        model(x_in()).pow(2).mean().backward()
        opt.step()


# --- checkpoints ---------------------------------------------------------------------------
def test_state_dict_keeps_original_keys_and_loads_both_ways_strictly():
    model = encoder()
    original = copy.deepcopy(model.state_dict())
    opt, _ = knob.knob_optimizer(model, torch.optim.AdamW, lr=1e-2, qk_ratio=10.0)
    assert any("parametrizations" in n for n, _ in model.named_parameters())  # really split
    sd = model.state_dict()
    assert list(sd) == list(original) and all(sd[k].shape == original[k].shape for k in sd)
    train_steps(model, opt)
    trained = model(x_in()).detach()

    # split checkpoint -> unsplit model, strict
    plain = encoder(seed=1)
    assert plain.load_state_dict(model.state_dict(), strict=True) == nn.modules.module._IncompatibleKeys([], [])
    assert torch.allclose(plain(x_in()), trained, rtol=0, atol=1e-12)
    # original checkpoint -> split model, strict: the slices take the values
    model.load_state_dict(original, strict=True)
    assert torch.allclose(model(x_in()), encoder()(x_in()), rtol=0, atol=1e-12)
    # and the slices are still the optimizer's parameters: a step moves the packed tensor
    before = knob.tensor_value(model, "layers.0.self_attn.in_proj_weight").detach().clone()
    train_steps(model, opt, 1)
    assert not torch.equal(knob.tensor_value(model, "layers.0.self_attn.in_proj_weight"), before)
    # assign=True (the loaded tensors become the parameters): each slice its own contiguous tensor
    other = encoder(seed=2)
    knob.split_packed(other)
    other.load_state_dict(original, assign=True)
    slices = [p for n, p in other.named_parameters() if "parametrizations" in n]
    assert slices and all(p.is_contiguous() for p in slices)
    assert len({p.untyped_storage().data_ptr() for p in slices}) == len(slices)
    assert torch.allclose(other(x_in()), encoder()(x_in()), rtol=0, atol=1e-12)
    # a checkpoint of the wrong size is a load error naming the key
    bad = dict(original)
    bad["layers.0.self_attn.in_proj_weight"] = torch.zeros(3 * E + 1, E, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="layers.0.self_attn.in_proj_weight"):
        model.load_state_dict(bad)


def test_torch_save_of_split_model_is_refused_and_unsplit_exports():
    model = encoder()
    knob.knob_optimizer(model, torch.optim.AdamW, lr=1e-2, qk_ratio=10.0)
    with pytest.raises(RuntimeError, match="state_dict"):  # torch's own refusal for parametrized modules
        torch.save(model, io.BytesIO())
    buf = io.BytesIO()
    torch.save(knob.unsplit(model), buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=False)
    assert type(back.layers[0].self_attn) is nn.MultiheadAttention
    assert torch.allclose(back(x_in()), model(x_in()), rtol=0, atol=1e-12)


HF = {  # family: (model class, config class, extra config)
    "gpt2": ("GPT2LMHeadModel", "GPT2Config", dict(n_layer=2, n_embd=E, n_head=H, vocab_size=20, n_positions=8,
                                                   bos_token_id=0, eos_token_id=0)),
    "gpt_neox": ("GPTNeoXForCausalLM", "GPTNeoXConfig", TINY),
    "llama": ("LlamaForCausalLM", "LlamaConfig", dict(TINY, num_key_value_heads=1)),
    "bert": ("BertForMaskedLM", "BertConfig", TINY),
}


@pytest.mark.parametrize("family", list(HF))
def test_save_pretrained_from_pretrained_round_trip(family, tmp_path):
    """A split model trained for 3 AdamW steps, saved with save_pretrained: a fresh
    from_pretrained loads every key (no missing, unexpected or mismatched one) and gives the same
    logits; the saved file has the original names only."""
    import transformers

    model_cls, cfg_cls, kw = HF[family]
    cls = getattr(transformers, model_cls)
    torch.manual_seed(0)
    model = cls(getattr(transformers, cfg_cls)(**kw))
    names = list(model.state_dict())
    opt, _ = knob.knob_optimizer(model, torch.optim.AdamW, lr=1e-2, qk_ratio=10.0, weight_decay=0.01)
    ids = torch.randint(0, 20, (2, 6), generator=torch.Generator().manual_seed(3))
    for _ in range(3):
        opt.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    model.save_pretrained(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        back, info = cls.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert list(back.state_dict()) == names
    back.eval()
    with torch.no_grad():
        diff = float((back(input_ids=ids).logits - ref).abs().max())
    print(f"{family}: largest logit difference after from_pretrained {diff:.3g}")
    assert diff <= 1e-6


# --- any optimizer, weight decay -----------------------------------------------------------
def test_any_optimizer_class_and_its_kwargs():
    model = encoder()
    opt, _ = knob.knob_optimizer(model, torch.optim.RMSprop, lr=1e-3, qk_ratio=4.0, weight_decay=0.1, alpha=0.9)
    assert isinstance(opt, torch.optim.RMSprop) and all(g["alpha"] == 0.9 for g in opt.param_groups)
    lrs = {g["name"]: g["lr"] for g in opt.param_groups}
    assert lrs["qk"] == pytest.approx(4e-3) and lrs["ov"] == pytest.approx(1e-3) and lrs["other"] == pytest.approx(1e-3)
    assert {g["name"]: g["lr_scale"] for g in opt.param_groups}["qk.no_decay"] == pytest.approx(4.0)
    opt2, _ = knob.knob_optimizer(encoder(), "sgd", lr=0.1, qk_ratio=2.0, momentum=0.9, other_lr=0.05)
    assert isinstance(opt2, torch.optim.SGD) and opt2.param_groups[0]["momentum"] == 0.9
    assert {g["name"]: g["lr"] for g in opt2.param_groups} == {"qk": 0.2, "ov": 0.1, "other": 0.05}


def test_default_no_decay_rule():
    """With weight_decay > 0, exactly the 1-D tensors (biases, LayerNorm gains, slices of the
    packed in_proj_bias) land in the *.no_decay groups, listed here by hand."""
    model = encoder()
    opt, rep = knob.knob_optimizer(model, torch.optim.AdamW, lr=1e-2, qk_ratio=10.0, weight_decay=0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    quiet = {names[id(p)] for g in opt.param_groups if g["name"].endswith(".no_decay") for p in g["params"]}
    assert all(g["weight_decay"] == (0.0 if g["name"].endswith(".no_decay") else 0.1) for g in opt.param_groups)
    expected = set()
    for i in range(2):
        lay = f"layers.{i}."
        expected |= {f"{lay}self_attn.parametrizations.in_proj_bias.original{j}" for j in range(2)}  # Q+K, V
        expected |= {lay + n for n in ("self_attn.out_proj.bias", "linear1.bias", "linear2.bias", "norm1.weight",
                                       "norm1.bias", "norm2.weight", "norm2.bias")}
    assert quiet == expected
    # the report says it: the rule, and each tensor's weight decay
    assert str(rep).splitlines()[0] == ("weight decay: 0.1; none on 20 tensors/slices (1-D tensors, biases (bias, "
                                        "bias_k, b_Q ...) and *Norm* modules: default_no_decay)")
    by = {e.parameter: e.weight_decay for e in rep.entries}  # Q and K bias slices share one leaf
    assert {n for n, wd in by.items() if wd == 0.0} == expected and set(by.values()) == {0.0, 0.1}
    assert "layers.0.self_attn.in_proj_bias[0:8]" in str(rep) and "wd 0.1" in str(rep)
    # overridable: decay everything, or a rule of one's own
    opt, _ = knob.knob_optimizer(encoder(), torch.optim.AdamW, lr=1e-2, weight_decay=0.1, no_decay=None)
    assert {g["name"] for g in opt.param_groups} == {"qk", "ov", "other"}
    opt, _ = knob.knob_optimizer(encoder(), torch.optim.AdamW, lr=1e-2, weight_decay=0.1,
                                 no_decay=lambda name, p, m: isinstance(m, nn.LayerNorm))
    assert sum(len(g["params"]) for g in opt.param_groups if g["name"].endswith(".no_decay")) == 8
    with pytest.raises(TypeError, match="no_decay must be a function"):
        knob.knob_groups(encoder(), 1e-2, weight_decay=0.1, no_decay="bias")


# --- all or nothing ------------------------------------------------------------------------
def refusals():
    """(description, call on a fresh encoder, expected error, match) -- each must leave the model as it was."""
    return [
        ("unknown optimizer name", lambda m: knob.knob_optimizer(m, "adam"), ValueError, "unknown optimizer 'adam'"),
        ("not an optimizer", lambda m: knob.knob_optimizer(m, 3), TypeError, "optimizer_cls"),
        ("bad optimizer kwargs", lambda m: knob.knob_optimizer(m, torch.optim.AdamW, betas=(2.0, 0.9)), ValueError,
         "model was not changed"),
        ("unknown optimizer kwarg", lambda m: knob.knob_optimizer(m, torch.optim.SGD, lr=0.1, nesterov_x=True),
         TypeError, "nesterov_x"),
        ("infinite QK rate", lambda m: knob.knob_optimizer(m, lr=1e300, qk_ratio=1e10), ValueError, "not a finite"),
        ("zero rate", lambda m: knob.knob_optimizer(m, lr=0.0), ValueError, "eta_ov"),
        ("nan ratio", lambda m: knob.knob_groups(m, 1e-3, float("nan")), ValueError, "ratio"),
        ("bad regex", lambda m: knob.knob_optimizer(m, rules={"(": "qk"}), ValueError, "not a valid regular"),
        ("bad group", lambda m: knob.knob_optimizer(m, rules={"x": "QK"}), ValueError, "names group"),
        ("negative weight decay", lambda m: knob.knob_optimizer(m, weight_decay=-1.0), ValueError, "weight_decay"),
    ]


@pytest.mark.parametrize("case", range(len(refusals())), ids=[r[0] for r in refusals()])
def test_refused_calls_leave_the_model_untouched(case):
    _, call, err, match = refusals()[case]
    model = encoder()
    snap = snapshot(model)
    with pytest.raises(err, match=match):
        call(model)
    assert unchanged(model, snap)
    assert not any(hasattr(m, "parametrizations") for m in model.modules())


def test_shared_packed_weight_is_refused_by_name_and_rules_resolve_it():
    model = nn.Module()
    model.a, model.b = nn.MultiheadAttention(E, H), nn.MultiheadAttention(E, H)
    model.b.in_proj_weight = model.a.in_proj_weight
    snap = snapshot(model)
    with pytest.raises(ValueError, match=r"a.in_proj_weight \(also b.in_proj_weight\)"):
        knob.knob_optimizer(model, lr=1e-3, qk_ratio=10.0)
    assert unchanged(model, snap) and model.b.in_proj_weight is model.a.in_proj_weight
    # a rule keeps the shared tensor whole (one group), the tie stays
    opt, rep = knob.knob_optimizer(model, lr=1e-3, qk_ratio=10.0, rules={r"in_proj_weight$": "qk"})
    assert model.b.in_proj_weight is model.a.in_proj_weight
    assert {e.where: e.group for e in rep.entries}["a.in_proj_weight"] == "qk"
    # one module registered under two names shares nothing with another module: it is split once
    alias = nn.Module()
    alias.a = nn.MultiheadAttention(E, H)
    alias.b = alias.a
    knob.knob_optimizer(alias, lr=1e-3, qk_ratio=10.0)
    assert alias.b is alias.a and "in_proj_weight" in alias.a.parametrizations


def test_module_tied_under_two_names_and_frozen_attention():
    class Att(nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj = nn.Linear(E, E)
            self.k_proj = self.q_proj  # one module, two names: shared Q/K projection
            self.v_proj, self.o_proj = nn.Linear(E, E), nn.Linear(E, E)

    model = nn.Sequential(Att(), nn.Linear(E, 2))
    rep = knob.classify(model)
    by = {e.where: e.group for e in rep.entries}
    assert by["0.q_proj.weight"] == "qk" and by["0.v_proj.weight"] == "ov" and by["1.weight"] == "other"
    frozen = nn.Sequential(Att(), nn.Linear(E, 2))
    for p in frozen[0].parameters():
        p.requires_grad_(False)
    with pytest.raises(ValueError, match="are all frozen"):
        knob.classify(frozen)
    mha = nn.Sequential(nn.MultiheadAttention(E, H))
    for p in mha.parameters():
        p.requires_grad_(False)
    with pytest.raises(ValueError, match=r"frozen.*0.in_proj_weight"):
        knob.knob_optimizer(mha)


def test_param_groups_refuses_a_ratio_that_acts_on_nothing():
    import transformers

    llama = transformers.LlamaModel(transformers.LlamaConfig(**dict(TINY, num_key_value_heads=1)))
    with pytest.raises(ValueError, match="knob_optimizer"):
        param_groups(llama, 1e-3, ratio=10.0)
    with pytest.warns(UserWarning, match="would act on nothing"):
        groups = param_groups(llama, 1e-3, ratio=10.0, strict=False)
    assert [g["name"] for g in groups] == ["other"]
    assert [g["name"] for g in param_groups(llama, 1e-3)] == ["other"]  # ratio 1: nothing is lost
    tm = TokenModel(10, 4, 2, max_len=6)
    assert {g["name"]: g["lr"] for g in param_groups(tm, 1e-3, ratio=10.0)}["qk"] == pytest.approx(1e-2)


# --- schedulers ----------------------------------------------------------------------------
def scheduled_rates(make_sched, steps=12):
    model = encoder()
    opt, _ = knob.knob_optimizer(model, torch.optim.AdamW, lr=1e-2, qk_ratio=10.0, other_lr=5e-3)
    sched = make_sched(opt)
    out = []
    for _ in range(steps):
        opt.step()  # no gradients: nothing moves, only the schedule advances
        sched.step()
        out.append({g["name"]: g["lr"] for g in opt.param_groups})
    return out


@pytest.mark.parametrize("kind", ["lambda", "cosine", "onecycle"])
def test_schedulers_keep_the_ratio(kind):
    """At every step qk / ov = 10 and other / ov = 0.5 (rel. tolerance 1e-9), while the rates do
    change; OneCycleLR gets per-group max_lr from the groups' lr_scale."""
    makers = {
        "lambda": lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)),
        "cosine": lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=20),  # eta_min 0: multiplicative
        "onecycle": lambda o: torch.optim.lr_scheduler.OneCycleLR(
            o, max_lr=[3e-2 * g["lr_scale"] for g in o.param_groups], total_steps=13),
    }
    rates = scheduled_rates(makers[kind])
    for r in rates:
        assert r["qk"] / r["ov"] == pytest.approx(10.0, rel=1e-9)
        assert r["other"] / r["ov"] == pytest.approx(0.5, rel=1e-9)
    assert len({round(r["ov"], 12) for r in rates}) > 5
    # a scalar max_lr, by contrast, sets every group to the same rate: the ratio is gone
    flat = scheduled_rates(lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=3e-2, total_steps=13))
    assert flat[3]["qk"] == pytest.approx(flat[3]["ov"])


# --- the transformers Trainer --------------------------------------------------------------
def neox_init():
    """A tiny random Pythia-style GPT-NeoX, input and output embeddings tied: transformers 5.24's
    Trainer resume loads GPT-NeoX checkpoints without renaming the legacy ``embed_out`` key (which
    ``from_pretrained`` does), so an untied output head would resume at its initial values,
    with or without the knob."""
    from transformers import GPTNeoXForCausalLM

    from qkov_lib.studies.pythia import pythia_config

    cfg = pythia_config(vocab_size=20, d_model=E, n_layers=2, n_heads=H, max_len=8, pad_id=0)
    cfg.tie_word_embeddings = True
    torch.manual_seed(0)
    return GPTNeoXForCausalLM(cfg)


def lm_data(n=24, T=8):
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(1, 20, (n, T), generator=g)
    return [{"input_ids": row, "labels": row} for row in ids]


def knob_args(out, **kw):
    from qkov_lib.knob_trainer import KnobTrainingArguments

    base = dict(output_dir=str(out), max_steps=6, per_device_train_batch_size=4, learning_rate=1e-3, qk_ratio=10.0,
                weight_decay=0.01, warmup_steps=2, lr_scheduler_type="linear", logging_steps=1, save_steps=3,
                save_strategy="steps", report_to=[], use_cpu=True, disable_tqdm=True, seed=0, data_seed=0,
                dataloader_num_workers=0, save_only_model=False)
    return KnobTrainingArguments(**{**base, **kw})


def test_trainer_trains_checkpoints_resumes_and_reloads(tmp_path):
    """A tiny random GPT-NeoX through KnobTrainer with model_init at ratio 10: every logged step
    has qk = 10 x ov = 10 x other rates, following the linear schedule; resuming from step 3
    reproduces steps 4-6 (rates, optimizer state and weights, tolerance 1e-6); from_pretrained
    of the last checkpoint gives the trained model's logits."""
    from transformers import GPTNeoXForCausalLM, get_linear_schedule_with_warmup

    from qkov_lib.knob_trainer import KnobTrainer

    data = lm_data()
    a = KnobTrainer(model_init=neox_init, args=knob_args(tmp_path / "a"), train_dataset=data)
    a.train()
    logs = [h for h in a.state.log_history if "loss" in h]
    assert [h["step"] for h in logs] == [1, 2, 3, 4, 5, 6]
    # the schedule the Trainer uses, on a stand-in optimizer: the OV rate at each logged step
    stand_in = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1e-3)
    sched = get_linear_schedule_with_warmup(stand_in, 2, 6)
    expected_ov = []
    for _ in range(6):
        stand_in.step()
        sched.step()
        expected_ov.append(sched.get_last_lr()[0])
    for h, ov in zip(logs, expected_ov):
        print(json.dumps({k: h[k] for k in ("step", "learning_rate/qk", "learning_rate/ov", "learning_rate/other")}))
        assert h["learning_rate/ov"] == pytest.approx(ov, rel=1e-9, abs=1e-15)
        assert h["learning_rate/qk"] == pytest.approx(10 * ov, rel=1e-9, abs=1e-15)
        assert h["learning_rate/other"] == pytest.approx(ov, rel=1e-9, abs=1e-15)
        assert h["learning_rate"] == h["learning_rate/ov"]
    assert a.knob_report is not None and a.knob_report.lrs["qk"] == pytest.approx(1e-2)

    b = KnobTrainer(model_init=neox_init, args=knob_args(tmp_path / "b"), train_dataset=data)
    b.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-3"))
    logs_b = [h for h in b.state.log_history if "loss" in h and h["step"] > 3]  # 1-3: from trainer_state.json
    assert [h["step"] for h in logs_b] == [4, 5, 6]
    for hb, ha in zip(logs_b, logs[3:]):
        for k in ("learning_rate/qk", "learning_rate/ov", "learning_rate/other"):
            assert hb[k] == pytest.approx(ha[k], rel=1e-12)
        assert hb["loss"] == pytest.approx(ha["loss"], rel=1e-6)
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert all(torch.allclose(sa[k], sb[k], rtol=0, atol=1e-6) for k in sa)
    oa, ob = a.optimizer.state_dict(), b.optimizer.state_dict()
    assert [g["name"] for g in oa["param_groups"]] == [g["name"] for g in ob["param_groups"]]
    for i, st in oa["state"].items():
        assert torch.allclose(st["exp_avg_sq"], ob["state"][i]["exp_avg_sq"], rtol=1e-5, atol=1e-12)

    ids = torch.randint(1, 20, (2, 8), generator=torch.Generator().manual_seed(9))
    a.model.eval()
    with torch.no_grad():
        ref = a.model(input_ids=ids).logits
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        back, info = GPTNeoXForCausalLM.from_pretrained(tmp_path / "a" / "checkpoint-6", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    back.eval()
    with torch.no_grad():
        diff = float((back(input_ids=ids).logits - ref).abs().max())
    print(f"Trainer checkpoint -> from_pretrained: largest logit difference {diff:.3g}")
    assert diff <= 1e-6


def test_trainer_refuses_a_ready_optimizer():
    from qkov_lib.knob_trainer import KnobTrainer

    opt = torch.optim.SGD(neox_init().parameters(), lr=0.1)
    with pytest.raises(ValueError, match="builds its own optimizer"):
        KnobTrainer(model=neox_init(), args=knob_args("unused"), optimizers=(opt, None))
    with pytest.raises(ValueError, match="qk_ratio"):
        knob_args("unused", qk_ratio=-1.0)
    assert math.isfinite(knob_args("unused").qk_ratio)


def test_trainer_reads_qk_ratio_from_args_at_each_train_call(tmp_path):
    """What a hyper-parameter search does per trial (set an argument, call train(): model_init
    builds a fresh model, the Trainer a fresh optimizer): the new qk_ratio takes effect."""
    from qkov_lib.knob_trainer import KnobTrainer

    t = KnobTrainer(model_init=neox_init, args=knob_args(tmp_path, max_steps=2, save_strategy="no", warmup_steps=0,
                                                         lr_scheduler_type="constant"), train_dataset=lm_data(8))
    ratios = []
    for r in (1.0, 3.0):
        t.args.qk_ratio = r
        t.train()
        last = [h for h in t.state.log_history if "loss" in h][-1]
        ratios.append(last["learning_rate/qk"] / last["learning_rate/ov"])
    assert ratios == [pytest.approx(1.0), pytest.approx(3.0)]


def test_knob_imports_and_works_with_torch_alone():
    """In a fresh interpreter where the book's stack (pandas, scipy, matplotlib, seaborn, tqdm)
    and transformers cannot be imported, the knob still imports and builds its optimizer."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "for m in ('pandas', 'scipy', 'matplotlib', 'seaborn', 'tqdm', 'transformers'):\n"
        "    sys.modules[m] = None\n"
        "import torch\n"
        "sys.modules['numpy'] = None  # torch itself imports numpy when it is installed; the knob must not\n"
        "for m in [m for m in sys.modules if m.startswith('qkov_lib')]:\n"
        "    del sys.modules[m]\n"
        "from qkov_lib.knob import knob_optimizer\n"
        "m = torch.nn.TransformerEncoderLayer(8, 2, 16, batch_first=True)\n"
        "opt, rep = knob_optimizer(m, torch.optim.Adam, lr=1e-3, qk_ratio=10.0)\n"
        "print(sorted({g['name'] for g in opt.param_groups}), str(rep).splitlines()[0])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "['other', 'ov', 'qk']" in out.stdout and "lr 0.01" in out.stdout


def test_trainer_takes_any_optimizer_class(tmp_path):
    """optimizer_cls_and_kwargs (the Trainer's own way to pass an optimizer class) goes through
    the knob: the class and its kwargs are used, the rates come from the arguments."""
    from qkov_lib.knob_trainer import KnobTrainer

    t = KnobTrainer(model=neox_init(), args=knob_args(tmp_path, qk_ratio=4.0, learning_rate=0.1),
                    optimizer_cls_and_kwargs=(torch.optim.SGD, {"momentum": 0.9}))
    opt = t.create_optimizer()
    assert isinstance(opt, torch.optim.SGD) and all(g["momentum"] == 0.9 for g in opt.param_groups)
    lrs = {g["name"]: g["lr"] for g in opt.param_groups}
    assert lrs["qk"] == pytest.approx(0.4) and lrs["ov"] == pytest.approx(0.1) and lrs["other.no_decay"] == 0.1
    assert t.create_optimizer() is opt  # made once


def test_hyperparameter_search_varies_qk_ratio(tmp_path):
    """The Trainer's own hyper-parameter search (optuna backend, two trials) with the knob: each
    trial's qk_ratio comes from the search space, model_init builds a fresh model, and the logged
    QK/OV rate ratio of the trial is the ratio the search chose."""
    pytest.importorskip("optuna")
    import optuna

    from qkov_lib.knob_trainer import KnobTrainer

    seen = []

    class Recording(KnobTrainer):
        def train(self, *a, **k):
            out = super().train(*a, **k)
            last = [h for h in self.state.log_history if "loss" in h][-1]
            seen.append((self.args.qk_ratio, last["learning_rate/qk"] / last["learning_rate/ov"]))
            return out

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    t = Recording(model_init=lambda trial: neox_init(),
                  args=knob_args(tmp_path, max_steps=2, save_strategy="no", warmup_steps=0, lr_scheduler_type="constant",
                                 eval_strategy="no"), train_dataset=lm_data(8), eval_dataset=lm_data(4))
    best = t.hyperparameter_search(
        hp_space=lambda trial: {"qk_ratio": trial.suggest_categorical("qk_ratio", [1.0, 10.0])},
        compute_objective=lambda metrics: metrics["eval_loss"], n_trials=2, direction="minimize",
        backend="optuna", sampler=optuna.samplers.GridSampler({"qk_ratio": [1.0, 10.0]}))
    assert sorted(r for r, _ in seen) == [1.0, 10.0]          # the grid sampler tries each ratio once
    assert all(got == pytest.approx(r) for r, got in seen)     # and each trial trained at its ratio
    assert best.hyperparameters["qk_ratio"] in (1.0, 10.0)
