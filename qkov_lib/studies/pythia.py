"""The knob on a Pythia-architecture model (section "The knob on a Pythia-architecture model" of
the multi-layer chapter).

A ``transformers.GPTNeoXForCausalLM`` is built from a small config with the architecture choices
of the Pythia suite (parallel attention and MLP residual, rotary embeddings on a quarter of each
head's dimensions, GELU, untied input/output embeddings, biases, LayerNorm) and random weights;
nothing is downloaded. It learns the synthetic distinct/common-token task
(:mod:`qkov_lib.data.synthetic`) as a language model: after the query token, predict the
distinct token (its id is the class). It is trained with AdamW by :func:`qkov_lib.train.train` over the groups of
:func:`qkov_lib.knob.knob_groups`, which splits each layer's fused ``query_key_value`` (heads
interleaved as ``[n_heads, 3, d_head]``) into per-head Q, K and V slices, at several
``eta_QK/eta_OV``. Measured per layer and head: the query position's attention on the distinct
token, with :func:`qkov_lib.studies.multilayer.head_metrics`.
"""

from __future__ import annotations

import itertools
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass

import pandas as pd
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkov_lib.data.batch import Batch
from qkov_lib.figure_source import draws
from qkov_lib.data.synthetic import SyntheticTask, sample
from qkov_lib.knob import KnobReport, knob_groups, knob_optimizer, tensor_value
from qkov_lib.metrics import prediction_metrics
from qkov_lib.profiles import profile_table
from qkov_lib.runtime import seed_everything, torch_threads
from qkov_lib.train import TrainConfig, predict, train
from qkov_lib import protocol
from qkov_lib.studies import multilayer as ml

DATASET = "synthetic"
TEST_SEED = 10_000  # the test set's seed, apart from every training seed

# Profile table: test = seconds (tests, CI); cpu = default build on 2 cores; full = GPU scale.
PROFILES: dict[str, dict] = {
    "test": dict(ratios=[1.0, 10.0], seeds=[0], n_layers=2, n_heads=2, d_model=16, steps=40, batch_size=32,
                 eta_ov=3e-3, weight_decay=0.01, n_classes=4, n_common_vocab=6, n_common=[2, 4, 6], n_test=256,
                 n_logs=3, threads=1),
    "cpu": dict(ratios=[1.0, 10.0], seeds=[0, 1, 2], n_layers=2, n_heads=4, d_model=32, steps=200, batch_size=64,
                eta_ov=3e-3, weight_decay=0.01, n_classes=4, n_common_vocab=6, n_common=[2, 4, 6], n_test=1024,
                n_logs=6, threads=1),
    "full": dict(ratios=[1.0, 10.0], seeds=[0, 1, 2, 3, 4], n_layers=6, n_heads=8, d_model=128, steps=3000,
                 batch_size=128, eta_ov=1e-3, weight_decay=0.01, n_classes=16, n_common_vocab=32,
                 n_common=[4, 8, 16], n_test=4096, n_logs=20, threads=None),
}


def task_of(cfg: dict) -> SyntheticTask:
    """The synthetic task of a resolved profile (token ids only; the model has its own embeddings)."""
    return SyntheticTask(n_classes=cfg["n_classes"], n_common_vocab=cfg["n_common_vocab"],
                         n_common=tuple(cfg["n_common"]))


def pythia_config(vocab_size: int, d_model: int, n_layers: int, n_heads: int, max_len: int, pad_id: int):
    """A ``GPTNeoXConfig`` with Pythia's architecture at a small size: parallel residual, rotary
    embeddings on 25% of each head's dimensions (base 10000), GELU MLP of width ``4 d_model``,
    untied embeddings, biases, LayerNorm eps 1e-5; no dropout, no cache, and eager attention so
    that the model returns its attention probabilities. ``pad_id`` is the padding token."""
    from transformers import GPTNeoXConfig

    if d_model < 1 or n_heads < 1 or d_model % n_heads:
        raise ValueError(f"d_model ({d_model}) must be a positive multiple of n_heads ({n_heads})")
    if n_layers < 1 or vocab_size < 2 or max_len < 2:
        raise ValueError(f"need n_layers >= 1, vocab_size >= 2, max_len >= 2; got {n_layers}, {vocab_size}, {max_len}")
    if not 0 <= pad_id < vocab_size:
        raise ValueError(f"pad_id {pad_id} is not a token of the vocabulary of size {vocab_size}")
    cfg = GPTNeoXConfig(vocab_size=vocab_size, hidden_size=d_model, num_hidden_layers=n_layers,
                        num_attention_heads=n_heads, intermediate_size=4 * d_model, max_position_embeddings=max_len,
                        hidden_act="gelu", rotary_pct=0.25, rotary_emb_base=10000, use_parallel_residual=True,
                        tie_word_embeddings=False, attention_bias=True, layer_norm_eps=1e-5, hidden_dropout=0.0,
                        attention_dropout=0.0, use_cache=False, bos_token_id=None, eos_token_id=None,
                        pad_token_id=pad_id)
    cfg._attn_implementation = "eager"
    return cfg


def build_model(task: SyntheticTask, cfg: dict, seed: int) -> nn.Module:
    """A ``GPTNeoXForCausalLM`` for ``task`` (vocabulary: the task's tokens and its padding id),
    initialised by transformers from a torch RNG seeded with ``seed`` (the global RNG is left as
    it was)."""
    from transformers import GPTNeoXForCausalLM

    config = pythia_config(task.vocab_size + 1, cfg["d_model"], cfg["n_layers"], cfg["n_heads"], task.seq_len,
                           task.pad_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return GPTNeoXForCausalLM(config)


def query_readout(model: nn.Module, batch: Batch, attentions: bool = False) -> tuple[Tensor, list[Tensor]]:
    """``(logits (N, V) at the query position, [attention probabilities (N, H, T, T)] * L)``.

    Padding (left) is masked out of attention; the query attends to itself and the real tokens
    before it (a causal model). Rotary embeddings depend only on relative positions, so the
    amount of left padding does not change the query's output. ``attentions=False`` returns []."""
    real = batch.tokens != model.config.pad_token_id
    out = model(input_ids=batch.tokens, attention_mask=real.long(), output_attentions=attentions, use_cache=False)
    return out.logits[:, -1], list(out.attentions) if attentions else []


def lm_loss(logits: Tensor, y: Tensor) -> Tensor:
    """Next-token cross-entropy at the query: the target token is the distinct token, whose id
    is the class ``y``."""
    return F.cross_entropy(logits.float(), y)


@torch.no_grad()
def evaluate(model: nn.Module, test: Batch) -> tuple[dict[str, float], pd.DataFrame]:
    """Test ``loss`` and ``accuracy`` (argmax over the whole vocabulary), and the per-head
    table of :func:`~qkov_lib.studies.multilayer.head_metrics`: the query's attention on the
    distinct token per layer and head (key mask: the real tokens and the query itself)."""
    was = model.training
    model.eval()
    logits, maps = query_readout(model, test, attentions=True)
    model.train(was)
    attn = torch.stack([m[:, :, -1] for m in maps], dim=1).double()
    real = test.tokens != model.config.pad_token_id
    heads = ml.head_metrics(attn, ml.rollout([m.double() for m in maps]), test.relevant, real)
    scores = {"loss": float(lm_loss(logits, test.y)), "accuracy": float((logits.argmax(-1) == test.y).double().mean())}
    return scores, heads


class QueryReadout(nn.Module):
    """The causal LM as a ``(tokens, key_mask) -> (logits at the query (N, V), attention (N, T))``
    module, so that :func:`qkov_lib.train.train` trains it: the attention returned (for the
    trainer's logs) is the last layer's head-averaged row at the query; padding is read from the
    token ids, as in :func:`query_readout`."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: Tensor, key_mask: Tensor) -> tuple[Tensor, Tensor]:
        real = tokens != self.model.config.pad_token_id
        out = self.model(input_ids=tokens, attention_mask=real.long(), output_attentions=True, use_cache=False)
        return out.logits[:, -1].float(), out.attentions[-1][:, :, -1].mean(1)


def _layer_means(model: nn.Module, test: Batch) -> dict[str, float]:
    """Test loss, accuracy and each layer's head-mean attention on the distinct token (a probe)."""
    scores, heads = evaluate(model, test)
    rows = heads[heads["head"] == "mean"]
    return {"test_" + k: v for k, v in scores.items()} | {f"L{r.layer} head-mean": r.attn_relevant for r in rows.itertuples()}


def train_one(cfg: dict, ratio: float, seed: int, test: Batch | None = None, progress: bool = False) -> ml.Run:
    """Train one Pythia-architecture model for ``cfg["steps"]`` AdamW steps with
    :func:`qkov_lib.train.train` over the knob's groups (qk: ``eta_ov * ratio``; ov and
    other: ``eta_ov``), on one epoch of ``steps * batch_size`` i.i.d. sequences of the synthetic
    task, then evaluate on ``test`` (default: :func:`test_set`). Deterministic given ``seed``."""
    task = task_of(cfg)
    test = test_set(cfg) if test is None else test
    with torch_threads(cfg["threads"]):
        gen = seed_everything(seed)
        model = build_model(task, cfg, seed)
        # the knob splits the fused query_key_value in place, so its groups are made once, here
        groups, report = knob_groups(model, eta_ov=cfg["eta_ov"], ratio=float(ratio), weight_decay=cfg["weight_decay"])
        data = sample(task, cfg["steps"] * cfg["batch_size"], gen)
        tc = TrainConfig.from_profile(cfg, optimizer="adamw", ratio=ratio, seed=seed, progress=progress, log_subsample=0)
        hist = train(QueryReadout(model), data, tc, probe=lambda m: _layer_means(m.model, test),
                     desc=f"pythia r={ratio:g} s={seed}", groups=lambda m, c: groups).frame()
        scores, heads = evaluate(model, test)
    return ml.Run(DATASET, float(ratio), seed, scores, heads, hist, str(report), report.summary())


def test_set(cfg: dict) -> Batch:
    """``cfg["n_test"]`` i.i.d. test sequences (seed :data:`TEST_SEED`)."""
    return sample(task_of(cfg), cfg["n_test"], torch.Generator().manual_seed(TEST_SEED))


def run_grid(cfg: dict) -> list[ml.Run]:
    """Every (ratio, seed) of ``cfg``, on one shared test set, with a progress bar."""
    test = test_set(cfg)
    grid = list(itertools.product(cfg["ratios"], cfg["seeds"]))
    return protocol.run_each([(cfg, r, s, test) for r, s in grid], train_one, "Pythia grid")


# --- the knob on this model ----------------------------------------------------------------
def first_step_moves(cfg: dict, ratio: float, seed: int = 0) -> tuple[KnobReport, dict[str, float]]:
    """The knob's report for a fresh model, and the mean absolute move of the Q, K and V slices
    of every layer's ``query_key_value`` weight in one AdamW step (no weight decay) on one batch.
    Adam's first step moves each element by its learning rate, so Q/V and K/V come out at
    ``ratio`` when the interleaved slices are placed right."""
    task = task_of(cfg)
    model = build_model(task, cfg, seed)
    opt, report = knob_optimizer(model, torch.optim.AdamW, lr=cfg["eta_ov"], qk_ratio=float(ratio))
    fused = [e for e in report.entries if e.tensor.endswith("attention.query_key_value.weight")]
    if not fused:
        raise ValueError("no query_key_value slices in the knob's report")
    before = {t: tensor_value(model, t).detach().clone() for t in {e.tensor for e in fused}}
    b = sample(task, cfg["batch_size"], torch.Generator().manual_seed(seed))
    lm_loss(query_readout(model, b)[0], b.y).backward()
    opt.step()
    moved: dict[str, list[Tensor]] = {}
    for e in fused:
        move = (tensor_value(model, e.tensor).detach() - before[e.tensor])[e.index].abs()
        moved.setdefault(e.part, []).append(move.flatten())
    return report, {part: float(torch.cat(ms).mean()) for part, ms in sorted(moved.items())}


def knob_facts(report: KnobReport, moves: dict[str, float], ratio: float) -> dict[str, str]:
    """Text of the first-step check (:func:`first_step_moves`): ``py_demo_ratio``, ``py_demo_qv``,
    ``py_demo_kv`` (:func:`qkov_lib.studies.multilayer.move_facts`, two decimals), ``py_slices``
    (the slices of layer 0's ``query_key_value`` weight in ``report``) and ``py_leaves`` (the
    parameters holding them)."""
    l0 = [e for e in report.entries if e.tensor.endswith("layers.0.attention.query_key_value.weight")]
    return {**ml.move_facts(moves, ratio, "py_demo", 2), "py_slices": str(len(l0)),
            "py_leaves": str(len({e.parameter for e in l0}))}


# --- tables and facts ----------------------------------------------------------------------
def summary_table(runs: Sequence[ml.Run]) -> pd.DataFrame:
    """Per ratio and layer (and the rollout), means over seeds: the query's attention on the
    distinct token for the head-averaged row (``head-mean``) and the sharpest head (``best
    head``), ``uniform`` attention's mass, and the test accuracy of the ratio."""
    table = ml.layer_table(ml.heads_frame(runs)).drop(columns=["dataset"])
    acc = pd.DataFrame([{"ratio": r.ratio, "accuracy": r.test["accuracy"]} for r in runs]).groupby("ratio")["accuracy"].mean()
    table["accuracy"] = table["ratio"].map(acc)
    return table


def facts(runs: Sequence[ml.Run], cfg: dict, report: KnobReport | None = None,
          moves: dict[str, float] | None = None) -> dict[str, str]:
    """Text for the chapter's prose, from ``runs``: accuracy and per-layer attention on the
    distinct token at each ratio (means over seeds), and the count of (layer, head-rank) slots
    that got sharper / blunter from the lowest to the highest ratio (``multilayer.changes``);
    with the ``report`` and ``moves`` of :func:`first_step_moves` at the highest ratio, also
    their :func:`knob_facts`."""
    table = summary_table(runs)
    ratios = sorted(cfg["ratios"])
    lo, hi = ratios[0], ratios[-1]

    def at(col: str, layer) -> str:
        t = table[table["layer"] == layer].set_index("ratio")[col]
        return ", ".join(f"{t[r]:.2f}" for r in ratios)

    layers = [l for l in table["layer"].unique() if l != "rollout"]
    acc = table.drop_duplicates("ratio").set_index("ratio")["accuracy"]
    ch = ml.changes(ml.heads_frame(runs), lo, hi)
    out = {
        "py_ratios": ", ".join(f"{r:g}" for r in ratios),
        "py_seeds": str(len(cfg["seeds"])),
        "py_shape": f"{cfg['n_layers']} layers × {cfg['n_heads']} heads, width {cfg['d_model']}",
        "py_steps": str(cfg["steps"]),
        "py_acc": ", ".join(f"{acc[r]:.2f}" for r in ratios),
        "py_uniform": f"{table['uniform'].iloc[0]:.2f}",
        "py_layers": "; ".join(f"layer {l}: head-mean {at('head-mean', l)}, sharpest head {at('best head', l)}"
                              for l in layers),
        "py_rollout": at("head-mean", "rollout"),
        "py_sharper": f"{int(ch['sharpened'].sum())} of {len(ch)}",
        "py_blunter": f"{int(ch['blunted'].sum())} of {len(ch)}",
        "py_lo": f"{lo:g}",
        "py_hi": f"{hi:g}",
    }
    if report is not None and moves is not None:
        out.update(knob_facts(report, moves, hi))
    return out


# --- the Trainer and the knob on real text: Marvin & Linzen SVA prefixes --------------------
# A GPT-NeoX-style LM trained from scratch with transformers' Trainer (qkov_lib.knob_trainer) on
# the SVA prefixes: after the prefix and the query token, predict one of two class tokens
# (singular / plural). Beside it, a one-head model on the same split.
SVA_PROFILES: dict[str, dict] = profile_table(
    dict(ratios=[1.0, 10.0], n_layers=2, n_heads=4, d_model=32, eta_ov=1e-3, weight_decay=0.01, batch_size=64,
         warmup_steps=20, max_len=16, min_freq=2, test_frac=0.2, data_seed=0, n_logs=5, threads=1),
    dict(seeds=[0], steps=12, n_train=256, n_test=128, n_heads=2, d_model=16, warmup_steps=2, n_logs=3),
    dict(seeds=[0, 1], steps=300, n_train=None, n_test=None),
    dict(seeds=[0, 1, 2, 3, 4], steps=5000, n_layers=4, n_heads=8, d_model=128, n_train=None, n_test=None,
         threads=None),
)
QUERY_SELF = "query itself"  # a causal LM's query also attends to its own position


def load_sva(cfg: dict, data_dir=None):
    """The Marvin & Linzen SVA :class:`~qkov_lib.data.text.TextDataset` of ``cfg`` (prefix split
    seed ``data_seed``; ``test_info["roles"]``: every word's token role)."""
    from qkov_lib.data.registry import load_text_dataset

    return load_text_dataset("sva", data_dir, max_len=cfg["max_len"], min_freq=cfg["min_freq"], n_train=cfg["n_train"],
                             n_test=cfg["n_test"], seed=cfg["data_seed"], test_frac=cfg["test_frac"])


def sva_model(ds, cfg: dict, seed: int) -> nn.Module:
    """A fresh ``GPTNeoXForCausalLM`` (Pythia's design, :func:`pythia_config`) whose vocabulary
    is the dataset's words plus one token per class (ids ``V``, ``V + 1``), seeded with ``seed``."""
    from transformers import GPTNeoXForCausalLM

    from qkov_lib.data.text import PAD_ID

    config = pythia_config(ds.vocab_size + ds.n_classes, cfg["d_model"], cfg["n_layers"], cfg["n_heads"],
                           ds.max_len + 1, PAD_ID)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return GPTNeoXForCausalLM(config)


def lm_examples(batch: Batch, vocab_size: int) -> list[dict[str, Tensor]]:
    """The causal-LM examples of a left-padded batch (query last): ``input_ids`` = the tokens
    then the class token ``vocab_size + y``; ``labels`` = -100 (no loss) except that class token,
    so the loss is the next-token cross-entropy at the query; ``attention_mask`` hides padding."""
    from qkov_lib.data.text import PAD_ID

    cls = (vocab_size + batch.y)[:, None]
    ids = torch.cat([batch.tokens, cls], dim=1)
    labels = torch.cat([torch.full_like(batch.tokens, -100), cls], dim=1)
    mask = (ids != PAD_ID).long()
    return [{"input_ids": i, "attention_mask": m, "labels": l} for i, m, l in zip(ids, mask, labels)]


def sva_train_one(ds, cfg: dict, ratio: float, seed: int, out_dir: str) -> tuple[nn.Module, pd.DataFrame]:
    """Train :func:`sva_model` with :class:`qkov_lib.knob_trainer.KnobTrainer` (AdamW, OV rate
    ``eta_ov``, QK rate ``eta_ov * ratio``, linear schedule with warm-up, weight decay except on
    biases and norms) for ``steps`` steps on the training prefixes. Returns the model and the
    Trainer's training logs (step, loss, the rate of every group)."""
    from transformers import PrinterCallback

    from qkov_lib.knob_trainer import KnobTrainer, KnobTrainingArguments

    args = KnobTrainingArguments(
        output_dir=out_dir, max_steps=cfg["steps"], per_device_train_batch_size=cfg["batch_size"],
        learning_rate=cfg["eta_ov"], qk_ratio=float(ratio), weight_decay=cfg["weight_decay"],
        warmup_steps=cfg["warmup_steps"], lr_scheduler_type="linear", logging_steps=max(cfg["steps"] // cfg["n_logs"], 1),
        save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, seed=seed, data_seed=seed,
        dataloader_num_workers=0)
    with torch_threads(cfg["threads"]):
        trainer = KnobTrainer(model_init=lambda: sva_model(ds, cfg, seed), args=args,
                              train_dataset=lm_examples(ds.train, ds.vocab_size))
        trainer.remove_callback(PrinterCallback)  # the logs are returned, not printed
        trainer.train()
    logs = pd.DataFrame([h for h in trainer.state.log_history if "loss" in h])
    cols = ["step", "loss", "learning_rate/qk", "learning_rate/ov", "learning_rate/other"]
    return trainer.model, logs[cols]


@torch.no_grad()
def sva_roles_of(model: nn.Module, ds) -> dict[str, dict[str, float]]:
    """Test accuracy (argmax over the two class tokens at the query) and, per layer, the
    head-averaged attention of the query on each token role (subject, attractor, verb, last,
    rest, and the query itself; :func:`qkov_lib.studies.agreement_roles.role_mass`)."""
    from qkov_lib.studies import agreement_roles

    model.eval()
    t = ds.test
    out = model(input_ids=t.tokens, attention_mask=(t.tokens != model.config.pad_token_id).long(),
                output_attentions=True, use_cache=False)
    logits = out.logits[:, -1, ds.vocab_size:ds.vocab_size + ds.n_classes]
    acc = prediction_metrics(logits.double().softmax(-1), t.y, ds.n_classes)["accuracy"]
    res = {"accuracy": {"accuracy": acc}}
    for layer, a in enumerate(out.attentions, start=1):
        row = a[:, :, -1].mean(1).double()  # (N, T): the query's row, mean over heads
        res[f"layer {layer}"] = {**agreement_roles.role_mass(row, ds.test_info["roles"], t.key_mask),
                                 QUERY_SELF: float(row[:, -1].mean())}
    return res


def sva_grid(ds, cfg: dict, out_dir: str) -> tuple[dict[str, pd.DataFrame], pd.DataFrame, pd.DataFrame]:
    """Every (ratio, seed) of ``cfg`` through :func:`sva_train_one`. Returns ``(roles, accuracy,
    logs)``: per layer a table (ratio x role, means over seeds), the test accuracy per ratio
    (mean over seeds), and the training logs of every run."""
    import os

    def one(ratio: float, seed: int) -> tuple[list[dict], pd.DataFrame]:
        model, log = sva_train_one(ds, cfg, ratio, seed, os.path.join(out_dir, f"r{ratio:g}_s{seed}"))
        return ([{"ratio": float(ratio), "seed": seed, "where": where, **vals} for where, vals in
                 sva_roles_of(model, ds).items()], log.assign(ratio=float(ratio), seed=seed))

    done = protocol.run_each(itertools.product(cfg["ratios"], cfg["seeds"]), one, "GPT-NeoX on SVA (Trainer)")
    frame = pd.DataFrame([row for rows, _ in done for row in rows])
    logs = [log for _, log in done]
    acc = frame[frame["where"] == "accuracy"].groupby("ratio")["accuracy"].mean()
    roles = {w: f.drop(columns=["where", "seed", "accuracy"]).groupby("ratio").mean()
             for w, f in frame[frame["where"] != "accuracy"].groupby("where", sort=True)}
    return roles, acc.to_frame(), pd.concat(logs, ignore_index=True)


# The one-head model beside it: a qkov_lib.models.TokenModel (learned word and position
# embeddings, one head read at the query) trained with AdamW at eta_OV = 1e-4 (the embeddings at
# eta_OV too); ratios and seeds come from the Trainer's profile (SVA_PROFILES).
ONE_HEAD_PROFILES: dict[str, dict] = profile_table(
    dict(optimizer="adamw", eta_ov=1e-4, eta_other=None, parameterization="FAFO", init_scale=1e-2, d_model=64,
         batch_size=64, weight_decay=0.0, n_logs=8, log_subsample=2000, data_seed=0),
    dict(steps=40), dict(steps=2000), dict(steps=6000),
)


def one_head_roles(ds, cfg: dict, profile: str | None) -> tuple[pd.DataFrame, pd.DataFrame, dict]:
    """The one-head model of :data:`ONE_HEAD_PROFILES` (a :class:`~qkov_lib.models.TokenModel`)
    for ``profile``, trained on ``ds`` at the ratios and seeds of ``cfg`` as one stack
    (:func:`qkov_lib.protocol.train_grid`). Returns the mean attention mass per token role
    (ratio x role, means over seeds), the test accuracy per ratio and the one-head settings."""
    from qkov_lib.models import TokenModel
    from qkov_lib.profiles import resolve
    from qkov_lib.studies import agreement_roles

    rcfg = {**resolve(ONE_HEAD_PROFILES, profile), "ratios": list(cfg["ratios"]), "seeds": list(cfg["seeds"])}
    cells = protocol.profile_cells(rcfg, rcfg["ratios"], rcfg["seeds"])

    def measure(m: nn.Module, batch: Batch) -> dict[str, float]:
        attn, probs = predict(m, batch)
        return {"accuracy": prediction_metrics(probs, batch.y, ds.n_classes)["accuracy"],
                **agreement_roles.role_mass(attn, ds.test_info["roles"], batch.key_mask), QUERY_SELF: 0.0}

    frame = protocol.train_grid(
        cells, lambda s: TokenModel(ds.vocab_size, rcfg["d_model"], ds.n_classes, ds.max_len,
                                    generator=seed_everything(s), parameterization=rcfg["parameterization"],
                                    init_scale=rcfg["init_scale"]),
        ds.train, None, ds.test,
        lambda c: TrainConfig.from_profile(rcfg, ratio=c.ratio, seed=c.seed, progress=False, log_seed=rcfg["data_seed"]),
        measure, max_stack=len(cells), desc=f"{ds.name}: one-head models")
    protocol.raise_if_diverged(frame, f"{ds.name} one-head models")
    rows = frame.drop(columns=["optimizer", "eta_ov", "diverged", "stop_step"])
    f = rows.drop(columns="seed").groupby("ratio").mean()
    return f.drop(columns="accuracy"), f[["accuracy"]], rcfg


@draws
def role_figure(panels: dict[str, pd.DataFrame]):
    """:func:`qkov_lib.plotting.role_bars` of :meth:`SvaStudy.panels`: stacked bars of the mean
    attention mass per token role against the ratio, one panel per layer and one for the
    one-head model."""
    from qkov_lib import plotting

    return plotting.role_bars(panels, list(next(iter(panels.values())).columns))


def sva_facts(roles: dict[str, pd.DataFrame], acc: pd.DataFrame, head_roles: pd.DataFrame, head_acc: pd.DataFrame,
              cfg: dict, rcfg: dict) -> dict[str, str]:
    """Text for the section's prose: sizes, steps, seeds, and for every layer and the one-head
    model the subject and attractor mass and the accuracy at each ratio (means over seeds)."""
    def at(frame: pd.DataFrame, col: str) -> str:
        return ", ".join(f"{frame.loc[r, col]:.2f}" for r in sorted(frame.index))

    out = {
        "trainer_sva_shape": f"{cfg['n_layers']} layers × {cfg['n_heads']} heads, width {cfg['d_model']}",
        "trainer_sva_steps": str(cfg["steps"]), "trainer_sva_seeds": str(len(cfg["seeds"])),
        "trainer_sva_ratios": ", ".join(f"{r:g}" for r in sorted(cfg["ratios"])),
        "trainer_sva_acc": at(acc, "accuracy"),
        "trainer_sva_layers": "; ".join(f"{w}: subject {at(f, 'subject')}, attractors {at(f, 'attractor')}"
                                        for w, f in roles.items()),
        "trainer_sva_head": f"subject {at(head_roles, 'subject')}, attractors {at(head_roles, 'attractor')}",
        "trainer_sva_head_acc": at(head_acc, "accuracy"),
        "trainer_sva_head_steps": str(rcfg["steps"]), "trainer_sva_head_param": rcfg["parameterization"],
        "trainer_sva_head_opt": rcfg["optimizer"], "trainer_sva_head_eta": f"{rcfg['eta_ov']:g}",
        "trainer_sva_head_width": str(rcfg["d_model"]),
        "trainer_sva_eta": f"{cfg['eta_ov']:g}",
    }
    return out


@dataclass
class SvaStudy:
    """The Trainer section's runs (:func:`sva_study`): per layer of the GPT-NeoX model the mean
    attention mass per token role (``roles``: layer -> ratio x role, :func:`sva_grid`), its test
    accuracy per ratio, every run's Trainer log (``logs``), and the one-head model's role masses,
    accuracy and settings (:func:`one_head_roles`); ``cfg``: the Trainer's settings."""

    cfg: dict
    roles: dict[str, pd.DataFrame]
    accuracy: pd.DataFrame
    logs: pd.DataFrame
    head_roles: pd.DataFrame
    head_accuracy: pd.DataFrame
    head_cfg: dict

    def text(self) -> dict[str, str]:
        """The texts the section quotes (:func:`sva_facts`)."""
        return sva_facts(self.roles, self.accuracy, self.head_roles, self.head_accuracy, self.cfg, self.head_cfg)

    def first_run_log(self) -> pd.DataFrame:
        """The Trainer's log of the run at the highest ratio with the lowest seed: step, loss and
        the rate of every group, one row per logged step."""
        logs = self.logs
        run = logs[(logs["ratio"] == max(self.cfg["ratios"])) & (logs["seed"] == min(self.cfg["seeds"]))]
        return run.drop(columns=["ratio", "seed"]).reset_index(drop=True)

    def panels(self) -> dict[str, pd.DataFrame]:
        """The panels of the role figure: per layer of the GPT-NeoX model ("GPT-NeoX, <layer> (head
        mean)") and for the one-head model (titled with its parameterization), the mean attention
        mass per token role (ratio x role: :data:`qkov_lib.studies.agreement_roles.ROLES`, then
        :data:`QUERY_SELF`)."""
        from qkov_lib.studies import agreement_roles

        cols = [*agreement_roles.ROLES, QUERY_SELF]
        panels = {f"GPT-NeoX, {w} (head mean)": f[cols] for w, f in self.roles.items()}
        panels[f"one head ({self.head_cfg['parameterization']})"] = self.head_roles[cols]
        return panels

    def role_table(self) -> pd.DataFrame:
        """:meth:`panels` in one table, indexed by (model, ratio)."""
        return pd.concat(self.panels(), names=["model", "ratio"])


def sva_study(cfg: dict, profile: str | None, data_dir=None) -> SvaStudy:
    """Train the Trainer section's models on the SVA prefixes of ``cfg`` (:func:`load_sva`): the
    GPT-NeoX grid through the Trainer (:func:`sva_grid`, its output folders in a temporary
    directory) and the one-head models of ``profile`` (:func:`one_head_roles`)."""
    ds = load_sva(cfg, data_dir)
    with tempfile.TemporaryDirectory() as tmp:
        roles, acc, logs = sva_grid(ds, cfg, tmp)
    head_roles, head_acc, head_cfg = one_head_roles(ds, cfg, profile)
    return SvaStudy(cfg, roles, acc, logs, head_roles, head_acc, head_cfg)


def results_metrics(table: pd.DataFrame, sva: SvaStudy) -> dict:
    """The Pythia sections' metrics for the chapter's results file: the per-layer summary of the
    synthetic-task runs (``pythia_layers``, :func:`summary_table`) and the role panels of the SVA
    runs (``trainer_roles``: panel -> rows with their ``ratio``, what the role figure draws)."""
    return {"pythia_layers": table.to_dict("records"),
            "trainer_roles": {name: f.reset_index().to_dict("records") for name, f in sva.panels().items()}}
