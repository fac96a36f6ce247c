"""Single-layer self-attention read out at a query position, in the four QK/OV parameterizations.

Notation (the book's introduction): the score of key token ``x_i`` for the query ``x_q`` is ``x_i^T W_QK x_q``,
the attention row is ``softmax`` over the keys, and the logits are ``W_OV sum_i alpha_i x_i``.

* collapsed QK: one matrix ``W_QK`` (d, d);
  factorized QK: ``W_Q`` (r, d) and ``W_K`` (r, d) with ``W_QK = W_K^T W_Q``, so the score is
  ``(W_K x_i) . (W_Q x_q)``, the usual query/key dot product.
* collapsed OV: one matrix ``W_OV`` (C, d);
  factorized OV: ``W_O`` (C, r) and ``W_V`` (r, d) with ``W_OV = W_O W_V``.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from qkov_lib.runtime import is_batched

PARAMETERIZATIONS: tuple[str, ...] = ("FAFO", "CAFO", "FACO", "CACO")
GROUPS: tuple[str, ...] = ("qk", "ov", "other")
QK_PARAMS = ("W_QK", "W_Q", "W_K")
OV_PARAMS = ("W_OV", "W_O", "W_V")


@dataclass(frozen=True)
class Parameterization:
    """Which circuits are factorized; ``name`` is one of FAFO, CAFO, FACO, CACO."""

    name: str

    @property
    def qk_factorized(self) -> bool:
        return self.name[:2] == "FA"

    @property
    def ov_factorized(self) -> bool:
        return self.name[2:] == "FO"


def parse_parameterization(name: str) -> Parameterization:
    """Validate a parameterization name (case-insensitive) and return it."""
    if not isinstance(name, str) or name.upper() not in PARAMETERIZATIONS:
        raise ValueError(
            f"unknown parameterization {name!r}; expected one of {', '.join(PARAMETERIZATIONS)}"
        )
    return Parameterization(name.upper())


def balanced_factors(M: Tensor, rank: int) -> tuple[Tensor, Tensor]:
    """Split ``M`` (m, n) into ``A`` (m, rank) and ``B`` (rank, n) with ``A @ B = M`` and
    ``A^T A = B B^T`` (balanced), using the SVD ``M = U S V^T``: ``A = U S^1/2``, ``B = S^1/2 V^T``.

    Needs ``rank >= min(m, n)`` unless ``M`` has lower rank; surplus directions are zero.
    """
    if rank < 1:
        raise ValueError(f"rank must be >= 1, got {rank}")
    U, S, Vh = torch.linalg.svd(M, full_matrices=False)
    k = S.numel()
    if rank < k and S[rank:].abs().max() > 1e-12 * max(float(S[0]), 1.0):
        raise ValueError(f"rank {rank} is smaller than the rank of the matrix to factorize")
    k = min(k, rank)
    root = S[:k].sqrt()
    A = torch.zeros(M.shape[0], rank, dtype=M.dtype)
    B = torch.zeros(rank, M.shape[1], dtype=M.dtype)
    A[:, :k] = U[:, :k] * root
    B[:k] = root[:, None] * Vh[:k]
    return A, B


class QKOVAttention(nn.Module):
    """One attention head read out at the last position, in any of the four parameterizations.

    ``forward(x, key_mask)`` takes embedded tokens ``x`` (B, T, d) whose last position is the
    query, and a boolean ``key_mask`` (B, T) of the positions that may be attended. It returns
    ``(logits (B, C), attention (B, T))``; masked keys get exactly zero attention.
    """

    def __init__(
        self,
        d_model: int,
        n_out: int,
        parameterization: str = "CACO",
        rank_qk: int | None = None,
        rank_ov: int | None = None,
        init_scale: float = 1e-2,
        balanced: bool = True,
        generator: torch.Generator | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        if d_model < 1 or n_out < 1:
            raise ValueError(f"d_model and n_out must be positive, got {d_model}, {n_out}")
        if not (init_scale >= 0 and math.isfinite(init_scale)):
            raise ValueError(f"init_scale must be a finite number >= 0, got {init_scale}")
        self.param = parse_parameterization(parameterization)
        self.d_model, self.n_out = d_model, n_out
        self.rank_qk = rank_qk or d_model
        self.rank_ov = rank_ov or max(min(d_model, n_out), 1)
        self.balanced = balanced
        if balanced:
            W_QK = init_scale * torch.randn(d_model, d_model, generator=generator, dtype=dtype)
            W_OV = init_scale * torch.randn(n_out, d_model, generator=generator, dtype=dtype)
            self._register_effective(W_QK, W_OV)
        else:
            self._unbalanced_init(init_scale, generator, dtype)

    # --- construction -------------------------------------------------------------------
    def _register_effective(self, W_QK: Tensor, W_OV: Tensor) -> None:
        if self.param.qk_factorized:
            A, B = balanced_factors(W_QK, self.rank_qk)  # W_QK = W_K^T W_Q
            self.W_K = nn.Parameter(A.T.contiguous())
            self.W_Q = nn.Parameter(B)
        else:
            self.W_QK = nn.Parameter(W_QK.clone())
        if self.param.ov_factorized:
            W_O, W_V = balanced_factors(W_OV, self.rank_ov)
            self.W_O, self.W_V = nn.Parameter(W_O), nn.Parameter(W_V)
        else:
            self.W_OV = nn.Parameter(W_OV.clone())

    def _unbalanced_init(self, scale: float, gen: torch.Generator | None, dtype: torch.dtype) -> None:
        # independent Gaussian factors whose product has entries of std ``scale``
        def gauss(std: float, *shape: int) -> nn.Parameter:
            return nn.Parameter(std * torch.randn(*shape, generator=gen, dtype=dtype))

        d, C, rq, ro = self.d_model, self.n_out, self.rank_qk, self.rank_ov
        if self.param.qk_factorized:
            s = math.sqrt(scale / math.sqrt(rq))
            self.W_Q, self.W_K = gauss(s, rq, d), gauss(s, rq, d)
        else:
            self.W_QK = gauss(scale, d, d)
        if self.param.ov_factorized:
            s = math.sqrt(scale / math.sqrt(ro))
            self.W_O, self.W_V = gauss(s, C, ro), gauss(s, ro, d)
        else:
            self.W_OV = gauss(scale, C, d)

    @torch.no_grad()
    def set_effective(self, W_QK: Tensor, W_OV: Tensor) -> None:
        """Set the parameters so that the effective matrices equal ``W_QK`` (d, d) and
        ``W_OV`` (C, d); factorized circuits get balanced factors."""
        if W_QK.shape != (self.d_model, self.d_model) or W_OV.shape != (self.n_out, self.d_model):
            raise ValueError(
                f"expected W_QK {(self.d_model, self.d_model)} and W_OV {(self.n_out, self.d_model)}, "
                f"got {tuple(W_QK.shape)} and {tuple(W_OV.shape)}"
            )
        dtype = next(self.parameters()).dtype
        for name in QK_PARAMS + OV_PARAMS:
            if hasattr(self, name):
                delattr(self, name)
        self._register_effective(W_QK.detach().to(dtype), W_OV.detach().to(dtype))

    # --- effective matrices -------------------------------------------------------------
    def W_QK_eff(self) -> Tensor:
        """The collapsed QK matrix (d, d): ``W_QK``, or ``W_K^T W_Q``."""
        return self.W_K.T @ self.W_Q if self.param.qk_factorized else self.W_QK

    def W_OV_eff(self) -> Tensor:
        """The collapsed OV matrix (C, d): ``W_OV``, or ``W_O W_V``."""
        return self.W_O @ self.W_V if self.param.ov_factorized else self.W_OV

    def effective(self) -> tuple[Tensor, Tensor]:
        """``(W_QK, W_OV)`` of any parameterization, as collapsed matrices."""
        return self.W_QK_eff(), self.W_OV_eff()

    def conserved(self) -> dict[str, Tensor]:
        """Gradient-flow invariants of the factorized circuits (r, r):
        ``W_K W_K^T - W_Q W_Q^T`` (qk) and ``W_O^T W_O - W_V W_V^T`` (ov)."""
        out: dict[str, Tensor] = {}
        if self.param.qk_factorized:
            out["qk"] = self.W_K @ self.W_K.T - self.W_Q @ self.W_Q.T
        if self.param.ov_factorized:
            out["ov"] = self.W_O.T @ self.W_O - self.W_V @ self.W_V.T
        return out

    # --- forward ------------------------------------------------------------------------
    def scores(self, x: Tensor, query: Tensor | None = None) -> Tensor:
        """Raw attention scores ``x_i^T W_QK x_q`` (B, T) of the keys ``x`` (B, T, d) for the query
        ``x_q`` = ``query`` (B, d), by default the last position ``x[:, -1]``."""
        q = x[:, -1] if query is None else query
        # contract the query side first: W_K^T (W_Q x_q) is one d-vector per sequence, so the keys
        # cost O(T d) instead of projecting every key, O(T d r); and a multiply-and-sum (vecdot)
        # instead of batched (T, d) @ (d, 1) products, whose per-matrix overhead dominates here
        u = (q @ self.W_Q.T) @ self.W_K if self.param.qk_factorized else q @ self.W_QK.T
        return torch.linalg.vecdot(x, u[:, None, :])

    def forward(self, x: Tensor, key_mask: Tensor) -> tuple[Tensor, Tensor]:
        if x.dim() != 3 or key_mask.shape != x.shape[:2]:
            raise ValueError(f"expected x (B, T, d) and key_mask (B, T), got {tuple(x.shape)}, {tuple(key_mask.shape)}")
        # under torch.func.vmap (the stacked trainer) a per-row check cannot run, nor where torch
        # cannot tell (is_batched None); the trainer checks the whole data set once instead
        if is_batched(key_mask) is False and not bool(key_mask.any(dim=1).all()):
            raise ValueError("every sequence needs at least one attendable key")
        s = self.scores(x).masked_fill(~key_mask, float("-inf"))
        attn = torch.softmax(s, dim=-1)
        ctx = torch.linalg.vecdot(x, attn[..., None], dim=1)  # sum_t attn_t x_t, (B, d)
        logits = (ctx @ self.W_V.T) @ self.W_O.T if self.param.ov_factorized else ctx @ self.W_OV.T
        return logits, attn


class SyntheticModel(nn.Module):
    """Fixed (untrained) token embeddings ``E`` (V, d) followed by :class:`QKOVAttention`."""

    def __init__(self, embeddings: Tensor, n_classes: int, **attention_kwargs) -> None:
        super().__init__()
        dtype = attention_kwargs.setdefault("dtype", embeddings.dtype)
        self.register_buffer("E", embeddings.to(dtype))
        self.attention = QKOVAttention(embeddings.shape[1], n_classes, **attention_kwargs)

    def forward(self, tokens: Tensor, key_mask: Tensor) -> tuple[Tensor, Tensor]:
        return self.attention(self.E[tokens], key_mask)


class TokenModel(nn.Module):
    """Learned token embeddings plus learned positions (counted back from the query), followed
    by :class:`QKOVAttention`. Sequences are left-padded so that the query is always last."""

    def __init__(self, vocab_size: int, d_model: int, n_classes: int, max_len: int,
                 positional: bool = True, generator: torch.Generator | None = None,
                 **attention_kwargs) -> None:
        super().__init__()
        dtype = attention_kwargs.get("dtype", torch.float32)
        self.embed = nn.Embedding(vocab_size, d_model, dtype=dtype)
        with torch.no_grad():
            self.embed.weight.copy_(torch.randn(vocab_size, d_model, generator=generator, dtype=dtype) / math.sqrt(d_model))
        self.pos = None
        if positional:
            self.pos = nn.Embedding(max_len, d_model, dtype=dtype)
            with torch.no_grad():
                self.pos.weight.copy_(0.1 * torch.randn(max_len, d_model, generator=generator, dtype=dtype) / math.sqrt(d_model))
        self.max_len = max_len
        self.attention = QKOVAttention(d_model, n_classes, generator=generator, **attention_kwargs)

    def forward(self, tokens: Tensor, key_mask: Tensor) -> tuple[Tensor, Tensor]:
        T = tokens.shape[1]
        if T > self.max_len:
            raise ValueError(f"sequence length {T} exceeds the model's max_len {self.max_len}")
        x = self.embed(tokens)
        if self.pos is not None:
            back = torch.arange(T - 1, -1, -1, device=tokens.device)  # distance from the query
            x = x + self.pos(back)[None]
        return self.attention(x, key_mask)


def group_of(param_name: str) -> str:
    """The optimizer group (``qk``, ``ov`` or ``other``) of a parameter, by its name."""
    leaf = param_name.rsplit(".", 1)[-1]
    if leaf in QK_PARAMS:
        return "qk"
    if leaf in OV_PARAMS:
        return "ov"
    return "other"


def named_groups(model: nn.Module) -> dict[str, list[str]]:
    """Names of the trainable parameters in each group ``qk``, ``ov``, ``other``."""
    out: dict[str, list[str]] = {g: [] for g in GROUPS}
    for name, p in model.named_parameters():
        if p.requires_grad:
            out[group_of(name)].append(name)
    return out


def check_rate(name: str, value: float) -> float:
    """Return ``value`` as a float if it is a finite positive number, else raise ValueError."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def param_groups(model: nn.Module, eta_ov: float, ratio: float = 1.0,
                 eta_other: float | None = None, weight_decay: float = 0.0, strict: bool = True) -> list[dict]:
    """Optimizer parameter groups of the library's own models, by parameter *name*
    (:func:`group_of`: ``W_QK``/``W_Q``/``W_K`` -> ``qk``, ``W_OV``/``W_O``/``W_V`` -> ``ov``):
    ``lr = eta_ov * ratio`` for ``qk``, ``eta_ov`` for ``ov`` and ``eta_other`` (default
    ``eta_ov``) for everything else. Empty groups are dropped.

    On any other model (``nn.MultiheadAttention``, Hugging Face, TransformerLens) use
    :func:`qkov_lib.knob.knob_optimizer`, which recognises their attention modules. A ratio
    other than 1 on a model without a ``qk`` parameter would change nothing, so it raises
    ValueError (``strict=False``: a warning instead)."""
    eta_ov = check_rate("eta_ov", eta_ov)
    ratio = check_rate("ratio (eta_QK/eta_OV)", ratio)
    eta_other = eta_ov if eta_other is None else check_rate("eta_other", eta_other)
    lrs = {"qk": eta_ov * ratio, "ov": eta_ov, "other": eta_other}
    if not math.isfinite(lrs["qk"]):
        raise ValueError(f"eta_ov * ratio = {eta_ov!r} * {ratio!r} is not a finite learning rate")
    names = named_groups(model)
    if ratio != 1.0 and not names["qk"]:
        msg = (f"param_groups found no W_QK/W_Q/W_K parameter in {type(model).__name__}, so ratio={ratio:g} "
               "would act on nothing; for standard attention modules use qkov_lib.knob.knob_optimizer")
        if strict:
            raise ValueError(msg)
        warnings.warn(msg, stacklevel=2)
    params = dict(model.named_parameters())
    groups = []
    for g, ns in names.items():
        if ns:
            groups.append({"name": g, "params": [params[n] for n in ns], "lr": lrs[g],
                           "weight_decay": weight_decay})
    return groups
