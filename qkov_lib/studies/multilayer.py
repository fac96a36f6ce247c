"""Chapter "Faster QK learning in a multi-layer transformer": a small ``nn.TransformerEncoder``
(several layers and heads, read out at the query position) trained with AdamW on SVA and
HateXplain at several ``eta_QK/eta_OV``, with the knob applied by :mod:`qkov_lib.knob`.

What is measured, per test instance ``i``, layer ``l`` and head ``h``: the attention row of the
query position (the last column) ``alpha^{l,h}_i`` (T,) and its mass on the relevant tokens
``a^{l,h}_i = sum_{t in R_i} alpha^{l,h}_{i,t}`` (SVA: the subject noun; HateXplain: the union
of the annotators' rationales), averaged over the test instances that have relevant tokens.
Heads carry no identity across runs, so the per-head summaries sort the heads of each layer
by their mass ("rank 1" = the sharpest head of that layer in that run) before averaging seeds.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkov_lib.figure_source import draws
from qkov_lib.data.batch import Batch
from qkov_lib.knob import KnobReport, knob_groups, knob_optimizer
from qkov_lib.metrics import macro_f1, relevant_mass, seed_half_width, tag_frame
from qkov_lib import claims, protocol
from qkov_lib.runtime import pick_device, seed_everything
from qkov_lib.train import TrainConfig, train

DATASETS = ("sva", "hatexplain")
TAU = 0.5  # AC threshold for the per-head table
DELTA = claims.HEAD_DELTA  # a change of head attention smaller than this counts as "no change"

# Profile table: test = seconds (tests, CI); cpu = default build on 2 cores; full = GPU scale.
PROFILES: dict[str, dict] = {
    "test": dict(datasets=list(DATASETS), ratios=[1.0, 10.0, 100.0], seeds=[0], n_layers=2, n_heads=2,
                 d_model=16, dim_ff=32, steps=40, batch_size=32, eta_ov=1e-3, eta_other=None, weight_decay=0.01,
                 n_train=300, n_test=200, max_len_sva=16, max_len_hatexplain=48, n_logs=4, n_monitor=128, processes=1),
    "cpu": dict(datasets=list(DATASETS), ratios=[1.0, 10.0, 100.0], seeds=[0, 1], n_layers=2, n_heads=4,
                d_model=64, dim_ff=128, steps=800, batch_size=64, eta_ov=1e-4, eta_other=None, weight_decay=0.01,
                n_train=None, n_test=None, max_len_sva=16, max_len_hatexplain=64, n_logs=8, n_monitor=256, processes=2),
    "full": dict(datasets=list(DATASETS), ratios=[1.0, 10.0, 100.0], seeds=[0, 1, 2, 3, 4], n_layers=4, n_heads=8,
                 d_model=128, dim_ff=256, steps=6000, batch_size=128, eta_ov=1e-4, eta_other=None, weight_decay=0.01,
                 n_train=None, n_test=None, max_len_sva=16, max_len_hatexplain=96, n_logs=20, n_monitor=1024, processes=1),
}


# --- the model ------------------------------------------------------------------------------
def encoder_with_attention(encoder: nn.TransformerEncoder, x: Tensor, key_padding_mask: Tensor) -> tuple[Tensor, list[Tensor]]:
    """Run ``encoder`` (batch_first layers, pre- or post-norm) on ``x`` (B, T, d) and also return
    each layer's per-head attention weights, a list of ``L`` tensors (B, H, T, T) (rows: queries,
    columns: keys; exactly zero on padded keys). ``key_padding_mask`` (B, T) is True on padding.
    Each layer is re-traced from its public parts so that ``self_attn`` can be called with
    ``need_weights=True, average_attn_weights=False``; the output equals ``encoder(x, src_key_padding_mask=...)``."""
    maps = []
    for layer in encoder.layers:
        if not getattr(layer.self_attn, "batch_first", False):
            raise ValueError("encoder_with_attention needs batch_first=True layers")

        def sa(h: Tensor) -> Tensor:
            out, w = layer.self_attn(h, h, h, key_padding_mask=key_padding_mask, need_weights=True,
                                     average_attn_weights=False)
            maps.append(w)
            return layer.dropout1(out)

        def ff(h: Tensor) -> Tensor:
            return layer.dropout2(layer.linear2(layer.dropout(layer.activation(layer.linear1(h)))))

        if layer.norm_first:
            x = x + sa(layer.norm1(x))
            x = x + ff(layer.norm2(x))
        else:
            x = layer.norm1(x + sa(x))
            x = layer.norm2(x + ff(x))
    if encoder.norm is not None:
        x = encoder.norm(x)
    return x, maps


class EncoderClassifier(nn.Module):
    """Token + position embeddings (positions counted back from the query, as in
    :class:`qkov_lib.models.TokenModel`), a pre-norm ``nn.TransformerEncoder`` (``n_layers`` layers of
    ``n_heads`` heads, ``batch_first``, no dropout) with a final LayerNorm, and a linear readout of the
    query position (the last column). ``forward(tokens (B, T), key_mask (B, T))`` -> ``(logits (B, C),
    attn (B, L, H, T))``: the query row of every layer's and head's attention."""

    def __init__(self, vocab_size: int, n_classes: int, max_len: int, d_model: int = 64, n_heads: int = 4,
                 n_layers: int = 2, dim_ff: int = 128, generator: torch.Generator | None = None) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by n_heads ({n_heads})")
        if n_layers < 1:
            raise ValueError(f"n_layers must be >= 1, got {n_layers}")
        self.embed = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        with torch.no_grad():
            self.embed.weight.normal_(0.0, 1.0, generator=generator)
            self.pos.weight.normal_(0.0, 1.0, generator=generator)
        # the encoder and readout use torch's default initialisation, drawn from ``generator``
        # (through a forked global RNG, which is left as it was)
        seed = int(torch.randint(0, 2**62, (1,), generator=generator)) if generator is not None else None
        with torch.random.fork_rng(devices=[]):
            if seed is not None:
                torch.manual_seed(seed)
            layer = nn.TransformerEncoderLayer(d_model, n_heads, dim_ff, dropout=0.0, batch_first=True, norm_first=True)
            self.encoder = nn.TransformerEncoder(layer, n_layers, norm=nn.LayerNorm(d_model), enable_nested_tensor=False)
            self.head = nn.Linear(d_model, n_classes)
        self.max_len, self.n_layers, self.n_heads = max_len, n_layers, n_heads

    def embed_tokens(self, tokens: Tensor) -> Tensor:
        T = tokens.shape[1]
        if T > self.max_len:
            raise ValueError(f"sequence length {T} exceeds the model's max_len {self.max_len}")
        back = torch.arange(T - 1, -1, -1, device=tokens.device)  # distance from the query
        return self.embed(tokens) + self.pos(back)[None]

    def maps(self, tokens: Tensor, key_mask: Tensor) -> tuple[Tensor, list[Tensor]]:
        """``(logits (B, C), [attention (B, H, T, T)] * L)``: full per-head attention maps."""
        if tokens.shape != key_mask.shape or not bool(key_mask.any(dim=1).all()):
            raise ValueError("tokens and key_mask must have the same shape (B, T) and every row needs a key")
        h, maps = encoder_with_attention(self.encoder, self.embed_tokens(tokens), ~key_mask)
        return self.head(h[:, -1]), maps

    def forward(self, tokens: Tensor, key_mask: Tensor) -> tuple[Tensor, Tensor]:
        logits, maps = self.maps(tokens, key_mask)
        return logits, torch.stack([m[:, :, -1] for m in maps], dim=1)


def rollout(maps: Sequence[Tensor]) -> Tensor:
    """Attention rollout (Abnar & Zuidema 2020) of the query row: with the head-averaged maps
    ``A_l`` (B, T, T) and the residual stream as an identity, ``r = e_q^T R_L ... R_1`` with
    ``R_l = (A_l + I) / 2``. Returns (B, T), rows summing to 1: how much of each input
    position flows into the query's final state through attention."""
    B, _, T, _ = maps[0].shape
    r = torch.zeros(B, T, dtype=maps[0].dtype, device=maps[0].device)
    r[:, -1] = 1.0
    for m in reversed(maps):
        A = m.mean(dim=1)
        r = 0.5 * torch.einsum("bt,bts->bs", r, A) + 0.5 * r
    return r


# --- metrics --------------------------------------------------------------------------------
@torch.no_grad()
def predict_maps(model: EncoderClassifier, data: Batch, chunk: int = 256) -> tuple[Tensor, Tensor, Tensor]:
    """``(probs (N, C), query attention (N, L, H, T), rollout (N, T))`` on ``data``, in chunks."""
    was = model.training
    model.eval()
    probs, att, roll = [], [], []
    for i in range(0, len(data), chunk):
        b = data.index(slice(i, i + chunk))
        logits, maps = model.maps(b.tokens, b.key_mask)
        probs.append(torch.softmax(logits.double(), -1).cpu())
        att.append(torch.stack([m[:, :, -1] for m in maps], dim=1).cpu())
        roll.append(rollout(maps).cpu())
    model.train(was)
    return torch.cat(probs), torch.cat(att), torch.cat(roll)


def head_metrics(attn: Tensor, roll: Tensor, relevant: Tensor, key_mask: Tensor, tau: float = TAU) -> pd.DataFrame:
    """Attention on the relevant tokens at the query position, over the instances with at least
    one relevant token. ``attn`` (N, L, H, T), ``roll`` (N, T), ``relevant``/``key_mask`` (N, T).

    One row per (layer, head) with ``head`` = 1..H, plus ``head="mean"`` (the layer's head-averaged
    row) per layer and one row ``layer="rollout"``. Columns: ``attn_relevant`` (mean mass), ``AC``
    (fraction with mass >= ``tau``), ``focus`` (fraction whose most-attended key is relevant),
    ``uniform`` (mass of uniform attention over the keys, ``|R_i| / #keys``: the chance reference)."""
    has = relevant.any(dim=1)
    if not bool(has.any()):
        raise ValueError("no test instance has relevant tokens")
    attn, roll, rel = attn[has].double(), roll[has].double(), relevant[has]
    uniform = float((rel.sum(1) / key_mask[has].sum(1)).double().mean())
    L, H = attn.shape[1:3]

    def row(layer, head, a_rows: Tensor) -> dict:
        a = relevant_mass(a_rows, rel)
        top = a_rows.argmax(dim=-1)
        return {"layer": layer, "head": head, "attn_relevant": float(a.mean()), "AC": float((a >= tau).double().mean()),
                "focus": float(rel.gather(1, top[:, None])[:, 0].double().mean()), "uniform": uniform}

    rows = []
    for l in range(L):
        rows += [row(l + 1, h + 1, attn[:, l, h]) for h in range(H)] + [row(l + 1, "mean", attn[:, l].mean(dim=1))]
    return pd.DataFrame(rows + [row("rollout", "-", roll)])


# --- training -------------------------------------------------------------------------------
@dataclass
class Run:
    """One trained model: settings, test scores, per-head metrics, training history and the
    knob report (which tensor went to which group)."""

    dataset: str
    ratio: float
    seed: int
    test: dict[str, float]
    heads: pd.DataFrame
    history: pd.DataFrame
    knob_report: str = ""
    knob_summary: pd.DataFrame = field(default_factory=pd.DataFrame)


def length_batches(lengths: Tensor, batch_size: int, gen: torch.Generator, pool: int = 32) -> list[Tensor]:
    """One epoch of minibatch indices: a random permutation cut into pools of ``pool`` batches,
    each pool sorted by sequence length and cut into batches, then the batches shuffled. Batches
    of similar lengths need little padding (see :func:`trim_padding`); every index occurs once."""
    perm = torch.randperm(len(lengths), generator=gen)
    batches: list[Tensor] = []
    for chunk in perm.split(batch_size * pool):
        chunk = chunk[torch.argsort(lengths[chunk], stable=True)]
        batches.extend(chunk.split(batch_size))
    return [batches[i] for i in torch.randperm(len(batches), generator=gen).tolist()]


def trim_padding(b: Batch) -> Batch:
    """Drop the leading columns that are padding in every row of a left-padded batch (positions
    are counted back from the query, so the model's output does not change)."""
    first = int(b.key_mask.any(dim=0).int().argmax())
    if first == 0:
        return b
    return Batch(b.tokens[:, first:], b.key_mask[:, first:], b.relevant[:, first:], b.y, b.weight)


def _loss_accuracy(probs: Tensor, y: Tensor) -> dict[str, float]:
    """Mean negative log-likelihood (nats) and accuracy of the probabilities ``probs`` (N, C)."""
    return {"loss": float(F.nll_loss(probs.clamp_min(1e-300).log(), y)),
            "accuracy": float((probs.argmax(-1) == y).double().mean())}


def _monitor(model: EncoderClassifier, data: Batch) -> dict[str, float]:
    probs, attn, _ = predict_maps(model, data)
    out = _loss_accuracy(probs, data.y.cpu())
    has = data.relevant.any(1).cpu()
    if bool(has.any()):
        a = (attn[has] * data.relevant.cpu()[has][:, None, None].to(attn.dtype)).sum(-1)  # (n, L, H)
        for l in range(a.shape[1]):
            out[f"L{l + 1} head-mean"] = float(a[:, l].mean())
            out[f"L{l + 1} best head"] = float(a[:, l].mean(0).max())
    return out


def train_one(data, dataset: str, ratio: float, seed: int, cfg: dict, device: torch.device | None = None,
              progress: bool = False) -> Run:
    """Train one :class:`EncoderClassifier` on ``data`` (a :class:`qkov_lib.data.text.TextDataset`)
    with AdamW over the groups of :func:`qkov_lib.knob.knob_groups` (qk: ``eta_ov * ratio``; ov:
    ``eta_ov``; other: ``eta_other`` or ``eta_ov``) for ``cfg["steps"]`` steps of
    :func:`qkov_lib.train.train` (batches of similar lengths, trimmed padding), logging
    :func:`_monitor` on the first ``n_monitor`` test instances; then evaluate on the test split."""
    device = device or pick_device()
    gen = seed_everything(seed)
    model = EncoderClassifier(data.vocab_size, data.n_classes, data.max_len, cfg["d_model"], cfg["n_heads"],
                              cfg["n_layers"], cfg["dim_ff"], generator=gen).to(device)
    # the knob splits packed tensors (in_proj_weight) in place, so the groups are made once here
    groups, report = knob_groups(model, eta_ov=cfg["eta_ov"], ratio=float(ratio), eta_other=cfg["eta_other"],
                                 weight_decay=cfg["weight_decay"])
    test = data.test.to(device)
    monitor = test.index(slice(0, cfg["n_monitor"]))
    lengths = data.train.key_mask.sum(dim=1).cpu()
    tc = TrainConfig.from_profile(cfg, optimizer="adamw", ratio=ratio, seed=seed, progress=progress, log_subsample=0)
    # minibatches of similar lengths, drawn from the generator that also drew the weights
    hist = train(model, data.train, tc, probe=lambda m: _monitor(m, monitor), desc=f"{dataset} r={ratio:g} s={seed}",
                 groups=lambda m, c: groups, batches=lambda _, n, bs: length_batches(lengths, bs, gen),
                 prepare=trim_padding).frame()
    probs, attn, roll = predict_maps(model, test)
    y = test.y.cpu()
    scores = {**_loss_accuracy(probs, y), "macro_f1": macro_f1(probs.argmax(-1), y, data.n_classes)}
    heads = head_metrics(attn, roll, test.relevant.cpu(), test.key_mask.cpu())
    return Run(dataset, float(ratio), seed, scores, heads, hist, str(report), report.summary())


def load_data(cfg: dict, data_dir=None) -> dict:
    """The :class:`TextDataset` of each dataset in ``cfg["datasets"]`` (data split seed 0)."""
    from qkov_lib.data.registry import load_text_dataset

    out = {}
    for name in cfg["datasets"]:
        if name not in DATASETS:
            raise ValueError(f"unknown dataset {name!r}; this chapter takes {', '.join(DATASETS)}")
        out[name] = load_text_dataset(name, data_dir=data_dir, max_len=cfg[f"max_len_{name}"], n_train=cfg["n_train"],
                                      n_test=cfg["n_test"], seed=0)
    return out


def run_grid(cfg: dict, datasets: dict, device: torch.device | None = None) -> list[Run]:
    """Train every (dataset, ratio, seed) of ``cfg`` with a progress bar; on a CPU in
    ``cfg["processes"]`` one-thread processes at once (:func:`qkov_lib.protocol.run_each`: every run
    seeds itself, so the runs are those of one process on one thread)."""
    device = device or pick_device()
    grid = list(itertools.product(cfg["datasets"], cfg["ratios"], cfg["seeds"]))
    processes = int(cfg.get("processes") or 1) if device.type == "cpu" else 1
    return protocol.run_each([(datasets[d], d, r, s, cfg, device) for d, r, s in grid], train_one, "multi-layer grid",
                             processes=processes)


# --- the knob on this model -----------------------------------------------------------------
def first_step_moves(cfg: dict, ratio: float, seed: int = 0) -> tuple[KnobReport, dict[str, float]]:
    """The knob's report for a fresh :class:`EncoderClassifier` of ``cfg``'s shape (vocabulary 50,
    2 classes, 8 positions, weights drawn from seed ``seed``), and the mean absolute move of the Q,
    K and V rows (``{"Q": ..., "K": ..., "V": ...}``) of its first layer's packed
    ``in_proj_weight`` in one AdamW step (OV rate ``cfg["eta_ov"]``, QK rate ``eta_ov * ratio``,
    AdamW's default weight decay) on one batch of 16 random sequences (seed ``seed + 1``), all of
    class 0. Adam's first step moves each element by about its rate, so Q/V and K/V come out near
    ``ratio`` when the packed tensor is split right."""
    model = EncoderClassifier(50, 2, 8, cfg["d_model"], cfg["n_heads"], cfg["n_layers"], cfg["dim_ff"],
                              generator=torch.Generator().manual_seed(seed))
    before = model.encoder.layers[0].self_attn.in_proj_weight.detach().clone()
    opt, report = knob_optimizer(model, torch.optim.AdamW, lr=cfg["eta_ov"], qk_ratio=float(ratio))
    tokens = torch.randint(3, 50, (16, 8), generator=torch.Generator().manual_seed(seed + 1))
    logits, _ = model(tokens, torch.ones_like(tokens, dtype=torch.bool))
    F.cross_entropy(logits, torch.zeros(16, dtype=torch.long)).backward()
    opt.step()
    move = (model.encoder.layers[0].self_attn.in_proj_weight.detach() - before).abs().split(cfg["d_model"])
    return report, {part: float(m.mean()) for part, m in zip("QKV", move)}


def first_layer_report(report: KnobReport | str) -> str:
    """``str(report)`` without the lines of any layer but the first: a line naming ``layers.<n>.``
    with ``n != 0`` is dropped (the other layers repeat layer 0's lines)."""
    return "\n".join(line for line in str(report).splitlines()
                     if all(n == "0" for n in re.findall(r"\blayers\.(\d+)\.", line)))


def move_facts(moves: Mapping[str, float], ratio: float, prefix: str, digits: int = 1) -> dict[str, str]:
    """Text of a first-step check: ``<prefix>_ratio`` (the ratio), ``<prefix>_qv`` and
    ``<prefix>_kv`` (the Q and K moves as multiples of the V move, ``digits`` decimals)."""
    return {f"{prefix}_ratio": f"{ratio:g}", f"{prefix}_qv": f"{moves['Q'] / moves['V']:.{digits}f}",
            f"{prefix}_kv": f"{moves['K'] / moves['V']:.{digits}f}"}


def data_frame(data: Mapping) -> pd.DataFrame:
    """One row per dataset of ``data`` (name -> :class:`~qkov_lib.data.text.TextDataset`): the shapes
    (instances x positions) of the train and test tokens, the vocabulary size, the class names and
    the number of test instances with at least one relevant token."""
    return pd.DataFrame([{"dataset": name, "train": "x".join(map(str, ds.train.tokens.shape)),
                          "test": "x".join(map(str, ds.test.tokens.shape)), "vocabulary": ds.vocab_size,
                          "classes": ", ".join(map(str, ds.class_names)),
                          "test items with relevant tokens": int(ds.test.relevant.any(1).sum())}
                         for name, ds in data.items()]).set_index("dataset")


# --- tables ---------------------------------------------------------------------------------
def scores_frame(runs: Sequence[Run]) -> pd.DataFrame:
    """One row per run: dataset, ratio, seed, test loss/accuracy/macro-F1."""
    return pd.DataFrame([{"dataset": r.dataset, "ratio": r.ratio, "seed": r.seed, **r.test} for r in runs])


def heads_frame(runs: Sequence[Run]) -> pd.DataFrame:
    """Long table of every run's :func:`head_metrics`, plus ``rank``: the head's position when the heads of
    its layer are sorted by ``attn_relevant`` (1 = sharpest; NaN for the mean and rollout rows)."""
    parts = []
    for r in runs:
        f = r.heads.copy()
        idx = f["head"].map(lambda h: isinstance(h, (int, np.integer)))
        f["rank"] = np.nan
        for layer, g in f[idx].groupby("layer"):
            order = g["attn_relevant"].rank(ascending=False, method="first")
            f.loc[order.index, "rank"] = order
        parts.append(tag_frame(f, dataset=r.dataset, ratio=r.ratio, seed=r.seed))
    return pd.concat(parts, ignore_index=True)


def histories_frame(runs: Sequence[Run]) -> pd.DataFrame:
    """Every logged training record, tagged with dataset, ratio and seed."""
    return pd.concat([tag_frame(r.history, dataset=r.dataset, ratio=r.ratio, seed=r.seed) for r in runs],
                     ignore_index=True)


def layer_table(heads: pd.DataFrame) -> pd.DataFrame:
    """Per dataset, ratio and layer (and the rollout): mean over seeds of the head-averaged
    attention on relevant tokens (``head-mean``, with its 95% half-width over seeds) and of the
    sharpest head's (``best head``), AC and focus of the head-mean row, and ``uniform``."""
    rows = []
    for (d, r, layer), g in heads.groupby(["dataset", "ratio", "layer"], sort=False):
        mean_rows = g[g["head"].isin(["mean", "-"])]
        per_seed_best = g[g["rank"] == 1].set_index("seed")["attn_relevant"]
        rows.append({"dataset": d, "ratio": r, "layer": layer,
                     "head-mean": mean_rows["attn_relevant"].mean(), "head-mean ±": seed_half_width(mean_rows["attn_relevant"]),
                     "best head": per_seed_best.mean() if len(per_seed_best) else np.nan,
                     "AC head-mean": mean_rows["AC"].mean(), "focus head-mean": mean_rows["focus"].mean(),
                     "uniform": g["uniform"].mean()})
    return pd.DataFrame(rows)


def rank_table(heads: pd.DataFrame) -> pd.DataFrame:
    """Wide table: attention on relevant tokens of the rank-k head of each layer (mean over
    seeds), one row per (dataset, layer, rank), one column per ratio."""
    h = heads[heads["rank"].notna()].copy()
    h["rank"] = h["rank"].astype(int)
    t = h.groupby(["dataset", "layer", "rank", "ratio"])["attn_relevant"].mean().unstack("ratio")
    t.columns = [f"ratio {c:g}" for c in t.columns]
    return t


def head_table(heads: pd.DataFrame, seed: int) -> pd.DataFrame:
    """Per-head attention on relevant tokens by head index for one seed (the seed fixes the heads'
    initialisation across ratios): rows (dataset, layer, head), columns ratios."""
    h = heads[(heads["seed"] == seed) & heads["rank"].notna()]
    t = h.pivot_table(index=["dataset", "layer", "head"], columns="ratio", values="attn_relevant")
    t.columns = [f"ratio {c:g}" for c in t.columns]
    return t


def changes(heads: pd.DataFrame, lo: float, hi: float, delta: float = DELTA) -> pd.DataFrame:
    """Per dataset, layer and head rank: the change of attention on relevant tokens from ratio ``lo`` to
    ``hi``, paired by seed: mean over seeds, its 95% half-width (NaN with one seed), and ``sharpened`` /
    ``blunted``: the mean change exceeds ``+delta`` / falls below ``-delta`` and every seed's has that sign."""
    h = heads[heads["rank"].notna()]
    a, b = (h[h["ratio"] == r].set_index(["dataset", "layer", "rank", "seed"])["attn_relevant"] for r in (lo, hi))
    d = (b - a).dropna().rename("change").reset_index()
    rows = []
    for (ds, layer, rank), g in d.groupby(["dataset", "layer", "rank"]):
        m = g["change"].mean()
        rows.append({"dataset": ds, "layer": layer, "rank": int(rank), "ratio": hi, "change": m,
                     "±": seed_half_width(g["change"]),
                     "sharpened": bool(m > delta and (g["change"] > 0).all()),
                     "blunted": bool(m < -delta and (g["change"] < 0).all())})
    return pd.DataFrame(rows)


def all_changes(heads: pd.DataFrame, ratios: Sequence[float], delta: float = DELTA) -> pd.DataFrame:
    """:func:`changes` from the lowest ratio to each of the others, stacked."""
    lo = min(ratios)
    return pd.concat([changes(heads, lo, r, delta) for r in sorted(ratios) if r != lo], ignore_index=True)


# --- facts and verdicts ---------------------------------------------------------------------
def _verdict(layers: Sequence[int], max_heads: int, n_layers: int) -> str:
    """The answer to "beyond one layer and one head?" from the layers that have a sharper head
    and the largest number of sharper heads in one layer."""
    if not layers:
        return "no: no head got sharper"
    several = max_heads >= 2
    if len(layers) >= 2:
        where = "in every layer" if len(layers) == n_layers else f"in layers {', '.join(map(str, layers))} of {n_layers}"
        return f"yes, {where}, " + ("with several heads per layer" if several else "but in one head per layer")
    return f"only in layer {layers[0]}, " + ("in several of its heads" if several else "in a single head")


def _arrow(values: Sequence[float]) -> str:
    return " → ".join(f"{v:.3f}" for v in values)


def carry_table(scores: pd.DataFrame, heads: pd.DataFrame, cfg: dict, delta: float = DELTA) -> pd.DataFrame:
    """Per dataset and ratio above the lowest, against the lowest: the answer to "does the
    sharpening carry beyond one layer and one head?" (:func:`_verdict`), the sharper and blunter
    (layer, head-rank) slots of :func:`changes` at ``delta`` out of all slots, the layers with a
    sharper slot, the layer with the largest head-mean gain (attention on relevant tokens) and that
    gain, and the change of accuracy (seed means). Columns ``dataset, ratio, answer, sharper,
    blunter, slots, sharp_layers, best_layer, best_gain, d_accuracy``."""
    ratios = sorted(cfg["ratios"])
    lo, L = ratios[0], cfg["n_layers"]
    lt = layer_table(heads).set_index(["dataset", "ratio", "layer"])
    acc = scores.groupby(["dataset", "ratio"])["accuracy"].mean()
    rows = []
    for ds in cfg["datasets"]:
        for r in ratios[1:]:
            c = changes(heads, lo, r, delta)
            c = c[c["dataset"] == ds]
            sharp = c[c["sharpened"]]
            layers = sorted({int(x) for x in sharp["layer"]})
            max_heads = int(sharp.groupby("layer").size().max()) if len(sharp) else 0
            gains = {l: lt.loc[(ds, r, l), "head-mean"] - lt.loc[(ds, lo, l), "head-mean"] for l in range(1, L + 1)}
            best = max(gains, key=gains.get)
            rows.append({"dataset": ds, "ratio": r, "answer": _verdict(layers, max_heads, L), "sharper": len(sharp),
                         "blunter": int(c["blunted"].sum()), "slots": len(c),
                         "sharp_layers": ", ".join(map(str, layers)) or "none", "best_layer": best,
                         "best_gain": float(gains[best]), "d_accuracy": float(acc.loc[(ds, r)] - acc.loc[(ds, lo)])})
    return pd.DataFrame(rows)


def chapter_facts(scores: pd.DataFrame, heads: pd.DataFrame, cfg: dict, delta: float = DELTA,
                  carry: pd.DataFrame | None = None) -> dict[str, str]:
    """The numbers and verdicts the chapter's prose quotes. Per dataset ``<ds>_...``: accuracy and the
    head-mean / sharpest-head attention of each layer across the ratios, the uniform baseline, the rollout;
    per higher ratio ``<ds>_r<ratio>_...``: counts of sharper/blunter (layer, head-rank) slots against the
    lowest ratio, their layers, the layer with the largest head-mean gain and the answer to "does the
    sharpening carry beyond one layer and one head?" (:func:`carry_table`); ``<ds>_yes_at`` lists the ratios
    where it does ("none" if none); ``full_size``: the model and seeds of the ``full`` profile.
    ``carry``: that table, if the caller already has it."""
    ratios = sorted(cfg["ratios"])
    lo, L = ratios[0], cfg["n_layers"]
    lt = layer_table(heads).set_index(["dataset", "ratio", "layer"])
    acc = scores.groupby(["dataset", "ratio"])[["accuracy", "macro_f1"]].mean()
    out = {"r_low": f"{lo:g}", "r_high": f"{ratios[-1]:g}", "ratios": " / ".join(f"{r:g}" for r in ratios),
           "n_layers": str(L), "n_heads": str(cfg["n_heads"]), "n_seeds": str(len(cfg["seeds"])), "delta": f"{delta:g}",
           "n_slots": str(L * cfg["n_heads"])}
    ct = carry_table(scores, heads, cfg, delta) if carry is None else carry
    for ds in cfg["datasets"]:
        out[f"{ds}_acc"] = _arrow([acc.loc[(ds, r), "accuracy"] for r in ratios])
        out[f"{ds}_f1"] = _arrow([acc.loc[(ds, r), "macro_f1"] for r in ratios])
        out[f"{ds}_uniform"] = f"{lt.loc[(ds, lo, 1), 'uniform']:.3f}"
        out[f"{ds}_rollout"] = _arrow([lt.loc[(ds, r, "rollout"), "head-mean"] for r in ratios])
        out[f"{ds}_layers"] = "; ".join(
            f"layer {l}: head-mean {_arrow([lt.loc[(ds, r, l), 'head-mean'] for r in ratios])}, "
            f"sharpest head {_arrow([lt.loc[(ds, r, l), 'best head'] for r in ratios])}" for l in range(1, L + 1))
        rows = ct[ct["dataset"] == ds]
        for r in rows.itertuples(index=False):
            tag = f"{ds}_r{r.ratio:g}"
            out.update({f"{tag}_n_sharp": str(r.sharper), f"{tag}_n_blunt": str(r.blunter),
                        f"{tag}_n_slots": str(r.slots), f"{tag}_sharp_layers": r.sharp_layers, f"{tag}_best_layer": str(r.best_layer),
                        f"{tag}_best_gain": f"{r.best_gain:+.3f}", f"{tag}_dacc": f"{r.d_accuracy:+.3f}",
                        f"{tag}_verdict": r.answer})
        out[f"{ds}_yes_at"] = ", ".join(f"{r:g}" for r, v in zip(rows["ratio"], rows["answer"]) if v.startswith("yes"))
        out[f"{ds}_yes_at"] = out[f"{ds}_yes_at"] or "none"
    out["eta_qk_high"] = f"{cfg['eta_ov'] * ratios[-1]:g}"
    out["eta_ov"] = f"{cfg['eta_ov']:g}"
    full = PROFILES["full"]
    out["full_size"] = f"{full['n_layers']} layers × {full['n_heads']} heads, {len(full['seeds'])} seeds"
    return out


def chapter_verdicts(scores: pd.DataFrame, heads: pd.DataFrame, cfg: dict) -> dict[str, dict[str, claims.Verdict]]:
    """Per dataset, the extension verdicts by the one rule of :mod:`qkov_lib.claims`: R1-multilayer (accuracy
    at every higher ratio against the lowest, paired by seed), R2-multilayer (each layer's head-mean attention
    gain at the highest ratio, paired by seed) and R3-multilayer (the per-seed gain of the layer that gained
    most, at every higher ratio)."""

    ratios = sorted(cfg["ratios"])
    lo, hi, higher = ratios[0], ratios[-1], ratios[1:]
    lt = layer_table(heads).set_index(["dataset", "ratio", "layer"])
    layers = range(1, cfg["n_layers"] + 1)
    out = {}
    for ds in cfg["datasets"]:
        def gain(r: float, l: int) -> float:
            return float(lt.loc[(ds, r, l), "head-mean"] - lt.loc[(ds, lo, l), "head-mean"])

        def paired(per_seed: pd.Series, r: float) -> claims.Change:
            """The change from ratio ``lo`` to ``r`` paired by seed (``per_seed`` indexed by ratio, seed)."""
            return claims.Change.of((per_seed.xs(r) - per_seed.xs(lo)).to_numpy(dtype=float))

        sc = scores[scores["dataset"] == ds].groupby(["ratio", "seed"])[["accuracy", "macro_f1"]].mean()
        hm = heads[(heads["dataset"] == ds) & heads["head"].isin(["mean", "-"])].groupby(
            ["layer", "ratio", "seed"])["attn_relevant"].mean()
        d_acc = {f"{ds}, ratio {r:g} vs {lo:g}": paired(sc["accuracy"], r) for r in higher}
        d_layer = {f"{ds}, layer {l}, ratio {hi:g} vs {lo:g}": paired(hm.xs(l), hi) for l in layers} if higher else {}
        # R3: the layer whose head-mean attention gained most at each ratio, its per-seed gains
        d_att = {f"{ds}, layer {(b := max(layers, key=lambda l: gain(r, l)))}, ratio {r:g} vs {lo:g}":
                 paired(hm.xs(b), r) for r in higher}
        out[ds] = {cid: claims.decide(claims.read_cells(cells, claims.ESTIMANDS[cid]), claims.ESTIMANDS[cid])
                   for cid, cells in (("R1-multilayer", d_acc), ("R2-multilayer", d_layer), ("R3-multilayer", d_att))}
    return out


def verdict_words(verdicts: Mapping[str, Mapping[str, claims.Verdict]], datasets: Sequence[str] = DATASETS
                  ) -> dict[str, str]:
    """The word of each extension verdict (:func:`chapter_verdicts`) for the chapter's opening
    sentence: ``ml_verdict_<dataset>_<R1|R2|R3>``, "not run" for a dataset or claim not in ``verdicts``."""
    out = {}
    for ds in datasets:
        for cid in ("R1", "R2", "R3"):
            v = verdicts.get(ds, {}).get(f"{cid}-multilayer")
            out[f"ml_verdict_{ds}_{cid}"] = v.verdict if v else "not run"
    return out


def verdict_table(verdicts: Mapping[str, Mapping[str, claims.Verdict]]) -> pd.DataFrame:
    """The extension verdicts of every dataset in one table: :func:`qkov_lib.claims.verdict_frame`
    of each dataset's verdicts, stacked, with the dataset as the outer index level."""
    return pd.concat({ds: claims.verdict_frame(vs) for ds, vs in verdicts.items()}, names=["dataset"])


@dataclass
class Analysis:
    """What the chapter reads from a grid of runs (:func:`analyse`): ``scores`` (one row per run,
    :func:`scores_frame`), ``heads`` (:func:`heads_frame`), ``history`` (:func:`histories_frame`),
    ``layers`` (:func:`layer_table`), ``carry`` (:func:`carry_table`), ``facts``
    (:func:`chapter_facts`) and ``verdicts`` (:func:`chapter_verdicts`), for the settings ``cfg``."""

    cfg: dict
    scores: pd.DataFrame
    heads: pd.DataFrame
    history: pd.DataFrame
    layers: pd.DataFrame
    carry: pd.DataFrame
    facts: dict[str, str]
    verdicts: dict[str, dict[str, claims.Verdict]]

    def text(self) -> dict[str, str]:
        """The texts the chapter quotes: the facts and the verdict words (:func:`verdict_words`)."""
        return {**self.facts, **verdict_words(self.verdicts)}

    def metrics(self) -> dict:
        """The chapter's metrics for its results file: run scores, the per-layer table (what the
        layer figure draws, ``layers``), every head's row (the heatmaps, ``heads``; layer and head as
        text), the training history per dataset (the curves, ``history.<dataset>``), the quoted
        facts and the scorecard rows (``claims``)."""
        h = self.history
        return {"scores": self.scores.to_dict("records"), "layers": self.layers.to_dict("records"),
                "heads": self.heads.astype({"layer": str, "head": str}).to_dict("records"),
                "history": {ds: h[h["dataset"] == ds].to_dict("records") for ds in self.cfg["datasets"]},
                "facts": self.facts, "claims": claims_rows(self.facts, self.verdicts, self.cfg)}


def analyse(runs: Sequence[Run], cfg: dict, delta: float = DELTA) -> Analysis:
    """Every table, fact and verdict of the chapter from its ``runs`` (settings ``cfg``; slots
    count as sharper or blunter beyond ``delta``)."""
    scores, heads = scores_frame(runs), heads_frame(runs)
    carry = carry_table(scores, heads, cfg, delta)
    return Analysis(cfg, scores, heads, histories_frame(runs), layer_table(heads), carry,
                    chapter_facts(scores, heads, cfg, delta, carry=carry), chapter_verdicts(scores, heads, cfg))


def claims_rows(facts: dict[str, str], verdicts: dict[str, dict[str, claims.Verdict]], cfg: dict
                ) -> list[dict[str, str]]:
    """Scorecard rows of our multi-layer extension of R1-R3 (IDs ``R1-multilayer`` ...), one per
    dataset, so that they never change the verdicts on the paper's single-layer claims."""
    ch = "09_multilayer"
    size = f"{cfg['n_layers']} layers x {cfg['n_heads']} heads, AdamW, {len(cfg['seeds'])} seed(s)"
    rows = []
    for ds, vs in verdicts.items():
        ours = {"R1-multilayer": f"{ds} ({size}): accuracy {facts[f'{ds}_acc']}, macro-F1 {facts[f'{ds}_f1']} at "
                                 f"ratios {facts['ratios']}",
                "R2-multilayer": f"{ds} ({size}): {facts[f'{ds}_layers']}",
                "R3-multilayer": f"{ds} ({size}): " + "; ".join(
                    f"at ratio {r:g}, {facts[f'{t}_verdict']} ({facts[f'{t}_n_sharp']} sharper and "
                    f"{facts[f'{t}_n_blunt']} blunter slots of {facts[f'{t}_n_slots']}; largest head-mean gain in "
                    f"layer {facts[f'{t}_best_layer']}, {facts[f'{t}_best_gain']})"
                    for r in sorted(cfg["ratios"])[1:] for t in [f"{ds}_r{r:g}"])}
        rows += [claims.claim(cid, claims.statement(cid), ours[cid], v, ch) for cid, v in vs.items()]
    return rows


# --- figures --------------------------------------------------------------------------------
@draws
def head_heatmaps(heads: pd.DataFrame, datasets: Sequence[str], ratios: Sequence[float]) -> plt.Figure:
    """One panel per (dataset, ratio): layers x head ranks, colour = attention on relevant tokens
    at the query position (mean over seeds), annotated."""
    import seaborn as sns

    from qkov_lib.plotting import FACE, setup

    setup()
    h = heads[heads["rank"].notna()].copy()
    h["rank"] = h["rank"].astype(int)
    fig, axes = plt.subplots(len(datasets), len(ratios), figsize=(2.6 * len(ratios) + 1.5, 1.9 * len(datasets) + 0.8),
                             squeeze=False, facecolor=FACE)
    for i, ds in enumerate(datasets):
        for j, r in enumerate(ratios):
            g = h[(h["dataset"] == ds) & (h["ratio"] == r)]
            t = g.groupby(["layer", "rank"])["attn_relevant"].mean().unstack("rank")
            sns.heatmap(t, ax=axes[i, j], vmin=0, vmax=1, cmap="mako_r", annot=True, fmt=".2f", cbar=False,
                        annot_kws={"fontsize": 8})
            axes[i, j].set_title(f"{ds}, ratio {r:g}", fontsize=10)
            axes[i, j].set_xlabel("head rank (1 = sharpest)" if i == len(datasets) - 1 else "")
            axes[i, j].set_ylabel("layer" if j == 0 else "")
    fig.tight_layout()
    return fig


@draws
def layer_lines(table: pd.DataFrame, datasets: Sequence[str]) -> plt.Figure:
    """Head-mean and sharpest-head attention on relevant tokens against the ratio (log axis),
    one line per layer, one panel per dataset; dashed: uniform attention."""
    from qkov_lib.plotting import FACE, setup

    setup()
    fig, axes = plt.subplots(1, len(datasets), figsize=(4.6 * len(datasets), 3.4), squeeze=False, facecolor=FACE)
    for ax, ds in zip(axes[0], datasets):
        t = table[(table["dataset"] == ds) & (table["layer"] != "rollout")]
        for k, (layer, g) in enumerate(t.groupby("layer")):
            c = f"C{k}"
            ax.plot(g["ratio"], g["head-mean"], "o-", color=c, label=f"layer {layer} head-mean")
            ax.plot(g["ratio"], g["best head"], "s--", color=c, alpha=0.7, label=f"layer {layer} sharpest head")
        ro = table[(table["dataset"] == ds) & (table["layer"] == "rollout")]
        ax.plot(ro["ratio"], ro["head-mean"], "^:", color="k", label="rollout")
        ax.axhline(t["uniform"].iloc[0], color="grey", ls="--", lw=1, label="uniform attention")
        ax.set_xscale("log")
        ax.set_ylim(0, 1)
        ax.set_xlabel("eta_QK / eta_OV")
        ax.set_ylabel("attention on relevant tokens")
        ax.set_title(ds)
    axes[0, -1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1))
    fig.tight_layout()
    return fig


@draws
def training_curves(hist: pd.DataFrame, dataset: str) -> plt.Figure:
    """:func:`qkov_lib.plotting.training_curves` of one dataset's runs: test accuracy and every
    per-layer attention column of ``hist`` (``L<l> head-mean``, ``L<l> best head``) against AdamW
    steps, one line per ratio (mean over seeds with its band), titled with the dataset."""
    from qkov_lib import plotting

    cols = ["accuracy"] + [c for c in hist.columns if c.startswith("L")]
    fig = plotting.training_curves(hist[hist["dataset"] == dataset], cols, hue="ratio", col_wrap=3)
    fig.suptitle(dataset, y=1.02)
    return fig
