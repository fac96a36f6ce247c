"""The one tensor container every dataset produces and every trainer consumes."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import Tensor


@dataclass
class Batch:
    """``N`` left-padded sequences whose last column is the query position.

    tokens (N, T) long; key_mask (N, T) bool, True where a key may be attended;
    relevant (N, T) bool, the annotated relevant positions; y (N,) long targets;
    weight (N,) float or None: probabilities summing to 1 for an exact population batch,
    None for an empirical sample (uniform weights).
    """

    tokens: Tensor
    key_mask: Tensor
    relevant: Tensor
    y: Tensor
    weight: Tensor | None = None

    def __post_init__(self) -> None:
        N, T = self.tokens.shape
        for name in ("key_mask", "relevant"):
            if getattr(self, name).shape != (N, T):
                raise ValueError(f"{name} must have shape {(N, T)}, got {tuple(getattr(self, name).shape)}")
        if self.y.shape != (N,) or (self.weight is not None and self.weight.shape != (N,)):
            raise ValueError("y and weight must have shape (N,)")

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def index(self, idx: Tensor | slice) -> "Batch":
        """The sub-batch at ``idx``; population weights are renormalised to sum to 1."""
        w = None if self.weight is None else self.weight[idx]
        if w is not None:
            w = w / w.sum()
        return Batch(self.tokens[idx], self.key_mask[idx], self.relevant[idx], self.y[idx], w)

    def to(self, device: torch.device | str) -> "Batch":
        vals = {f.name: getattr(self, f.name) for f in fields(self)}
        return Batch(**{k: (v.to(device) if v is not None else None) for k, v in vals.items()})


def spread(n_total: int, n: int) -> Tensor:
    """``min(n, n_total)`` evenly spaced indices in ``[0, n_total)`` (all when ``n >= n_total``):
    a fixed subset that covers test files sorted by condition or source."""
    if n >= n_total:
        return torch.arange(n_total)
    return torch.linspace(0, n_total - 1, n).round().long().unique()


def left_pad(seqs: list[list[int]], pad_id: int, length: int | None = None) -> tuple[Tensor, Tensor]:
    """Left-pad integer sequences to ``length`` (default: the longest); returns
    ``(tokens (N, T) long, is_real (N, T) bool)``."""
    T = length or max(len(s) for s in seqs)
    if any(len(s) > T for s in seqs):
        raise ValueError(f"a sequence is longer than the pad length {T}")
    tokens = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    real = torch.zeros((len(seqs), T), dtype=torch.bool)
    for i, s in enumerate(seqs):
        if s:
            tokens[i, T - len(s):] = torch.as_tensor(s, dtype=torch.long)
            real[i, T - len(s):] = True
    return tokens, real
