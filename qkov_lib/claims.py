"""The paper's claims, in the project's own words, and the rules that turn numbers into verdicts.

Each rule is a pure function of numbers (never of display strings) that returns a
:class:`Verdict`: one of :data:`VERDICTS`, the rule as stated on the scorecard (thresholds
included) and the reason (the numbers that decided it). Every threshold is a named constant
registered once in :data:`THRESHOLDS`; chapters glue them from there. A rule that has no data for
its comparison (one ratio, one parameterization, a missing metric) returns ``not tested``.

The real-data rules (R1-R3) decide on paired seed intervals, not on point estimates: each change
is a :class:`Change` (mean over seeds of run at ratio r minus run at ratio 1, its 95 % Student-t
half-width and the number of seed pairs), and 'reproduced' needs :data:`MIN_SEEDS` pairs.
"""

from __future__ import annotations

import math
import re
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

VERDICTS = ("reproduced", "holds where", "mixed", "not reproduced", "inconclusive", "not tested")
# The five words, defined once (the scorecard prints these definitions).
VERDICT_MEANING: dict[str, str] = {
    "reproduced": "the claim holds in every cell it reads",
    "holds where": "the claim holds in some of the cells it reads (named) and is contradicted in none",
    "mixed": "the claim holds in some cells and is contradicted in others (both named)",
    "not reproduced": "the claim is contradicted in some cell and holds in none",
    "inconclusive": "every cell's interval straddles the claim's margin: the verdict says how many seeds would decide it",
    "not tested": "the comparison could not be made (missing ratio, parameterization, metric or trained run)",
}
PARAMETERIZATIONS = ("FAFO", "CAFO", "FACO", "CACO")

# --- the paper's claims, restated (the project's own copy) ---------------------------------
CLAIMS: dict[str, str] = {
    "T1": "Symmetric reduction: under population gradient flow from a symmetric init, each circuit reduces "
          "to a scalar (an OV margin and a QK score advantage) with closed-form ODEs.",
    "T2": "Implicit rescaling: factorization acts as a state-dependent learning-rate rescaling; for a balanced "
          "factorized scalar the effective rate is about 2·eta·|param|.",
    "T3": "Growth rates: the OV scalar grows like O(log t) and the QK side like O(log² t) (the summaries' wording; "
          "possibly exp(QK scalar) ~ log² t), with constants that depend on eta_QK/eta_OV.",
    "T4": "In suitable coordinates the effective OV and QK parameters move along a line; the learning rates set "
          "the relative speed along it.",
    "T5": "Sharpening: when QK learns faster than OV, attention on common tokens shrinks faster and more mass "
          "goes to the relevant tokens.",
    "T6": "Parameterization matters: at equal nominal learning rates factorized and collapsed models follow "
          "different trajectories; a factorized QK circuit gives sharper attention than a collapsed one.",
    "S1": "DTAP heatmaps (attention on the distinct token vs. confidence in the correct class) differ between "
          "FAFO, CAFO, FACO and CACO.",
    "S2": "Which parameterizations concentrate attention on distinct tokens: (CACO, FACO), with faster QK moving "
          "FAFO toward FACO, or (CAFO, CACO), with FAFO moving toward CACO -- the two summaries disagree.",
    "S3": "A larger eta_QK/eta_OV moves DTAP mass toward high attention and high confidence at about the "
          "same loss and accuracy.",
    "R1": "On SQuAD, HateXplain and SVA, accuracy / F1 stays stable or improves slightly as eta_QK/eta_OV "
          "grows in {1, 10, 100}.",
    "R2": "Attention-based interpretability rises substantially (AC, ACMC, sufficiency); AC on SQuAD goes "
          "from about 12% to about 43%.",
    "R3": "Sharpness and accuracy are decoupled: sharper attention comes from the relative speed of the two "
          "circuits, not from better prediction.",
}

# Our extensions: tested with the same rules, reported as their own rows so that they never
# change the verdict on the paper's claim they extend.
EXTENSIONS: dict[str, tuple[str, str]] = {
    "R1-multilayer": ("R1", "R1 in a multi-layer, multi-head Transformer encoder with the knob on every head."),
    "R2-multilayer": ("R2", "R2 in a multi-layer encoder: the heads' attention on the relevant tokens rises in every "
                            "layer."),
    "R3-multilayer": ("R3", "R3 in a multi-layer encoder: heads sharpen without an accuracy change."),
    "R3-synthetic": ("R3", "Synthetic analogue of R3: at matched training loss, attention still depends on the ratio."),
    "S3-adam": ("S3", "S3 under AdamW: at matched training loss, a larger eta_QK/eta_OV (1, 10, 100) still sharpens "
                      "attention on the distinct token, as under gradient descent."),
    "S3-robustness": ("S3", "S3 under other optimizers, batch sizes, embeddings and task sizes (robustness variants)."),
}


def statement(claim_id: str) -> str:
    """The statement of a paper claim or an extension; KeyError for an unknown ID."""
    if claim_id in CLAIMS:
        return CLAIMS[claim_id]
    if claim_id in EXTENSIONS:
        return EXTENSIONS[claim_id][1]
    raise KeyError(f"unknown claim ID {claim_id!r}; known: {', '.join([*CLAIMS, *EXTENSIONS])}")


# --- thresholds --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Threshold:
    """A named threshold of a verdict rule: its value, unit and meaning."""

    name: str
    value: float
    unit: str
    meaning: str

    def text(self) -> str:
        """The value as the book prints it (e.g. ``0.05 nats``)."""
        return f"{self.value:g}" + (f" {self.unit}" if self.unit else "")


THRESHOLDS: dict[str, Threshold] = {}


def _threshold(name: str, value: float, unit: str, meaning: str) -> float:
    THRESHOLDS[name] = Threshold(name, float(value), unit, meaning)
    return float(value)


SAME_LOSS = _threshold("SAME_LOSS", 0.05, "nats", "largest change of test loss that counts as 'about the same loss'")
SAME_ACC = _threshold("SAME_ACC", 0.02, "", "largest drop (as a fraction) of accuracy or macro-F1 that counts as "
                                             "'stable'; also the largest change that counts as 'same accuracy'")
SHARPER = _threshold("SHARPER", 0.005, "", "smallest rise of the mean attention on the relevant token that counts "
                                           "as 'sharper'")
DTAP_TV = _threshold("DTAP_TV", 0.1, "", "smallest total-variation distance between two DTAP heatmaps that counts "
                                         "as 'they differ'")
STUCK_ACC = _threshold("STUCK_ACC", 0.99, "", "a synthetic run whose test accuracy ends below this is 'stuck'")
MIN_GAIN_AC = _threshold("MIN_GAIN_AC", 0.05, "", "smallest rise of AC@0.5 (fraction of instances) that counts as "
                                                  "'improves substantially'")
MIN_GAIN_ACMC = _threshold("MIN_GAIN_ACMC", 0.05, "", "smallest rise of ACMC@0.5 that counts as "
                                                      "'improves substantially'")
MIN_GAIN_SUFF = _threshold("MIN_GAIN_SUFF", 0.01, "", "smallest fall of the sufficiency score "
                                                      "(p(y|x) - p(y|top-k)) that counts as an improvement")
HEAD_DELTA = _threshold("HEAD_DELTA", 0.02, "", "smallest change of a head's attention on the relevant token that "
                                                "counts as a change (multi-layer chapter)")
TRAINED_MARGIN = _threshold("TRAINED_MARGIN", 0.05, "", "a real-data run 'trained' when its validation accuracy "
                                                       "beats the majority-class rate by at least this (fraction)")
TOL_GRAD = _threshold("TOL_GRAD", 1e-12, "", "largest entrywise gap between reduced and autograd loss/gradients (T1)")
TOL_VELOCITY = _threshold("TOL_VELOCITY", 1e-9, "", "largest relative gap between the rescaled ODE and "
                                                    "factor-level autograd (T2)")
TOL_OVERLAY = _threshold("TOL_OVERLAY", 0.1, "", "largest gap between the ODE and full-model GD at the "
                                                 "largest step (T1)")
SLOPE_TOL = _threshold("SLOPE_TOL", 0.05, "", "largest gap between a fitted and a derived growth exponent (T3)")
LITERAL_TOL = _threshold("LITERAL_TOL", 0.2, "", "largest gap to 2 of the fitted exponent of q in log t for "
                                                 "'q ~ log² t' (T3, literal wording)")
LINE_EXACT = _threshold("LINE_EXACT", 1e-6, "", "largest residual of an exact straight line (T4)")
LINE_APPROX = _threshold("LINE_APPROX", 0.01, "", "largest relative residual of an approximate straight line (T4)")
CONST_TOL = _threshold("CONST_TOL", 0.1, "", "largest relative gap between the fitted and the derived scaling of a "
                                             "growth constant A with the ratio that counts as agreeing (T3 prose)")


def threshold_text(name: str) -> str:
    """``name``'s value as printed in the book (for glue)."""
    return THRESHOLDS[name].text()


# --- verdicts -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Verdict:
    """The outcome of a rule: ``verdict`` (one of :data:`VERDICTS`), ``rule`` (the rule with its
    thresholds, as shown on the scorecard), ``reason`` (the numbers that decided it), ``region``
    (where the claim holds, in words and numbers; required for ``holds where``) and ``effect``
    (the effect size the rule read, with its interval where there are seeds)."""

    verdict: str
    rule: str
    reason: str = ""
    region: str = ""
    effect: str = ""

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict must be one of {VERDICTS}, got {self.verdict!r}")
        if self.verdict == "holds where" and not self.region.strip():
            raise ValueError("a 'holds where' verdict must name its region")

    @property
    def label(self) -> str:
        """The verdict as a reader sees it: ``holds where <region>`` for a region, else the word."""
        return f"holds where {self.region}" if self.verdict == "holds where" else self.verdict


def claim(claim_id: str, paper: str, ours: str, verdict: str | Verdict, chapter: str | None = None) -> dict[str, str]:
    """One row of the reproducibility scorecard: a claim ID (:data:`CLAIMS` or :data:`EXTENSIONS`),
    what the paper says, what we measured (numbers included), the verdict and, for a
    :class:`Verdict`, its rule, reason, region and effect."""
    v = verdict if isinstance(verdict, Verdict) else Verdict(verdict, "", "")
    return {"id": claim_id, "paper": paper, "ours": ours, "verdict": v.verdict, "rule": v.rule,
            "reason": v.reason, "region": v.region, "effect": v.effect, "chapter": chapter or ""}


def verdict_glue(verdicts: Mapping[str, Verdict]) -> dict[str, str]:
    """Glue entries ``verdict_<ID>``, ``label_<ID>``, ``region_<ID>``, ``effect_<ID>``, ``rule_<ID>``
    and ``reason_<ID>`` of each verdict (``-`` in an ID becomes ``_``, so ``R3-synthetic`` gives
    ``verdict_R3_synthetic``; an empty region or effect is glued as ``-``)."""
    out = {}
    for cid, v in verdicts.items():
        key = cid.replace("-", "_")
        out.update({f"verdict_{key}": v.verdict, f"rule_{key}": v.rule, f"reason_{key}": v.reason,
                    f"label_{key}": v.label, f"region_{key}": v.region or "-", f"effect_{key}": v.effect or "-"})
    return out


def verdict_frame(verdicts: Mapping[str, Verdict]):
    """The verdicts as a table for display: one row per claim ID with verdict, region, effect, rule
    and reason."""
    import pandas as pd

    return pd.DataFrame([{"claim": k, "verdict": v.verdict, "region": v.region, "effect": v.effect, "rule": v.rule,
                          "reason": v.reason}
                         for k, v in verdicts.items()]).set_index("claim")


def _finite(xs: Sequence[float]) -> list[float]:
    return [float(x) for x in xs if x is not None and math.isfinite(float(x))]


SHARPER_LOGIT = _threshold("SHARPER_LOGIT", 0.1, "nats", "smallest rise of the log-odds of the attention on the "
                                                       "relevant token, log(a / (1 - a)), that counts as 'sharper' "
                                                       "(near saturation: the fall of the log common-token mass)")


def log_odds(attention: float) -> float:
    """``log(a / (1 - a))`` of an attention mass ``a`` on the relevant token (``1 - a``: the mass
    on common tokens), clipped to [1e-12, 1 - 1e-12]; in nats. It keeps moving where ``a`` saturates
    (a common-token mass falling 10x raises it by log 10), which a difference of ``a`` does not."""
    a = min(max(float(attention), 1e-12), 1.0 - 1e-12)
    return math.log(a) - math.log1p(-a)


# --- synthetic experiments -------------------------------------------------------------------
S2_PAIRS = {"A": frozenset({"CACO", "FACO"}), "B": frozenset({"CAFO", "CACO"})}
S2_PARTNER = {"A": "FACO", "B": "CACO"}  # where each summary says a faster QK moves FAFO


def s2_summary(attention: Mapping[str, float]) -> str:
    """Which summary (``A`` = (CACO, FACO), ``B`` = (CAFO, CACO), or ``neither``) the two
    parameterizations with the most attention on the distinct token match."""
    top = frozenset(sorted(attention, key=lambda p: -attention[p])[:2])
    return next((k for k, pair in S2_PAIRS.items() if pair == top), "neither")


def s2_fafo_move(before: Mapping[str, float], after: Mapping[str, float], gap: Change | None = None) -> str | None:
    """Where a faster QK moves FAFO (S2): ``before``/``after`` are FAFO's distances (at the lower /
    at the faster ratio) to each candidate (``FACO``, ``CACO``). The candidate whose distance
    fell; if both fell, the closer one after, unless the two distances after are equal:
    :func:`is_tie` of ``gap`` (the per-seed difference of the distances after, FACO's minus
    CACO's), or exactly equal without it. Then ``"tie"``, which
    supports neither summary. ``"neither"`` when FAFO moved away from both; None when a distance
    is missing."""
    keys = [k for k in before if k in after]
    vals = {k: (float(before[k]), float(after[k])) for k in keys}
    if not vals or not all(math.isfinite(a) and math.isfinite(b) for a, b in vals.values()):
        return None
    closer = [k for k, (a, b) in vals.items() if b < a]
    if len(closer) == 2 and is_tie(vals[closer[0]][1] - vals[closer[1]][1], gap):
        return "tie"
    return min(closer, key=lambda k: vals[k][1]) if closer else "neither"


def is_tie(difference: float, gap: Change | None = None) -> bool:
    """Whether two distances are equal for S2: their seed interval (``gap``, a :class:`Change`
    of the per-seed differences) contains 0 or is unbounded (fewer than two seeds); without
    ``gap``, whether ``difference`` is 0 (up to 1e-12)."""
    if gap is None:
        return abs(float(difference)) <= 1e-12
    return not (gap.bounded and abs(gap.mean) > gap.half_width)


S2_ODE_TIE = _threshold("S2_ODE_TIE", 0.01, "nats", "largest gap in log-odds of the attention on the distinct token "
                                                    "between the second and the third parameterization that counts "
                                                    "as a tie in the reduced ODE (S2 phase map)")
S2_WORDS = {"A": "summary A's pair (CACO, FACO)", "B": "summary B's pair (CAFO, CACO)", "neither": "neither pair",
            "tie": "a tie", "not tested": "not tested"}
S2_SHORT = {"A": "(CACO, FACO)", "B": "(CAFO, CACO)", "neither": "neither pair", "tie": "a tie"}

def s2_top_two(values: Mapping[str, float], gap: Change | None = None, tie: float | None = None) -> str:
    """A cell's top two for S2: ``"A"``/``"B"`` (a summary's pair), ``"neither"``, ``"tie"`` or
    ``"not tested"``. ``values`` rank the parameterizations (higher = more attention on the
    distinct token; NaN or missing: not tested). With ``gap`` (the per-seed difference between
    the second and the third, a :class:`Change`) the tie is :func:`is_tie` of it, and fewer than
    two seeds is ``"not tested"``; without it, second minus third ``<= tie`` (default
    :data:`S2_ODE_TIE`, for log-odds from the reduced ODE) is a tie."""
    vals = {p: float(v) for p, v in values.items()}
    if len(vals) < 3 or not all(math.isfinite(v) for v in vals.values()):
        return "not tested"
    order = sorted(vals, key=lambda p: -vals[p])
    if gap is not None:
        if not gap.bounded:
            return "not tested"
        if is_tie(gap.mean, gap):
            return "tie"
    elif vals[order[1]] - vals[order[2]] <= (S2_ODE_TIE if tie is None else tie):
        return "tie"
    return s2_summary(vals)


def _s2_values(cells: Sequence[tuple], axis: int) -> list:
    return sorted({c[axis] for c in cells}, key=lambda v: (isinstance(v, str), v))


def s2_region(cells: Sequence[tuple], everywhere: Sequence[tuple], axes: Sequence[str]) -> str:
    """Where ``cells`` (a subset of the map ``everywhere``; each a tuple of axis values named by
    ``axes``) lie, in words: ``k of N cells`` and, per axis on which they do not cover every value of
    the map, the values they take (``ratio 0.01-0.1``: a run of consecutive map values)."""
    if not cells:
        return "at no cell"
    parts = []
    for i, name in enumerate(axes):
        full, have = _s2_values(everywhere, i), _s2_values(cells, i)
        if have == full:
            continue
        idx = [full.index(v) for v in have]
        fmt = lambda v: f"{v:g}" if isinstance(v, (int, float)) else str(v)  # noqa: E731
        run = idx == list(range(idx[0], idx[-1] + 1)) and len(idx) > 2
        parts.append(f"{name} {fmt(have[0])}-{fmt(have[-1])}" if run else f"{name} " + ", ".join(map(fmt, have)))
    if not parts:
        return f"at {len(cells)} of {len(everywhere)} cells, spread over every value of " + ", ".join(axes)
    return f"at {', '.join(parts)} ({len(cells)} of {len(everywhere)} cells)"


def s2_settled(ode: Mapping[tuple, str], axes: Sequence[str]) -> tuple[float, str] | None:
    """The depth from which the map's top two no longer depend on anything: ``(level, call)`` with
    ``level`` the shallowest training loss such that every cell at that loss or below has the same
    top two ``call``, provided some shallower level exists; None without a ``"loss"`` axis or when
    even the deepest level is mixed."""
    if "loss" not in axes or not ode:
        return None
    i = list(axes).index("loss")
    levels = sorted({c[i] for c in ode})
    found = None
    for k, lv in enumerate(levels):
        calls = {v for c, v in ode.items() if c[i] <= lv}
        if len(calls) != 1 or k == len(levels) - 1:
            break
        found = (lv, calls.pop())
    return found


# --- real data -----------------------------------------------------------------------------
MIN_SEEDS = int(_threshold("MIN_SEEDS", 3, "", "fewest seeds whose runs at both ratios trained for a change to "
                                              "count as 'reproduced'"))
NECESSITY_SHARE = _threshold("NECESSITY_SHARE", 0.5, "", "smallest share of the above-chance accuracy that uniform "
                                                         "attention must lose for the head's attention to count as "
                                                         "necessary (R3)")


@dataclass(frozen=True)
class Change:
    """A paired change over seeds: ``mean`` of the per-seed differences (run at ratio r minus
    run at ratio 1, same seed; in the metric's unit), ``half_width`` of its 95 % Student-t
    interval (NaN when ``n`` < 2) and ``n``, the number of seed pairs."""

    mean: float
    half_width: float
    n: int

    def __post_init__(self) -> None:
        try:
            n = operator.index(self.n)
        except TypeError:
            raise ValueError(f"Change.n must be a whole number of seed pairs, got {self.n!r}") from None
        if n < 0:
            raise ValueError(f"Change.n must be >= 0, got {n}")
        hw = float(self.half_width)
        if hw < 0:
            raise ValueError(f"Change.half_width must be >= 0 or NaN, got {hw}")
        object.__setattr__(self, "n", n)
        object.__setattr__(self, "mean", float(self.mean))
        object.__setattr__(self, "half_width", hw)

    @classmethod
    def of(cls, values: Sequence[float]) -> "Change":
        """The change from the per-seed differences ``values`` (non-finite values are ignored;
        none left: mean NaN, n 0), with :func:`qkov_lib.metrics.seed_half_width`."""
        from qkov_lib.metrics import seed_half_width

        v = _finite(list(values))
        if not v:
            return cls(math.nan, math.nan, 0)
        return cls(sum(v) / len(v), seed_half_width(v), len(v))

    @classmethod
    def exact(cls, value: float) -> "Change":
        """A value computed without seeds (an ODE, an exact gradient): an interval of width 0."""
        return cls(value, 0.0, 1)

    @property
    def bounded(self) -> bool:
        """Whether the interval is finite (at least two seed pairs and a finite half-width, or an
        exact value: :meth:`exact`)."""
        return (self.n >= 2 and math.isfinite(self.half_width)) or (self.n >= 1 and self.half_width == 0)

    @property
    def lo(self) -> float:
        """Lower end of the interval (``-inf`` when it is unbounded)."""
        return self.mean - self.half_width if self.bounded else -math.inf

    @property
    def hi(self) -> float:
        """Upper end of the interval (``+inf`` when it is unbounded)."""
        return self.mean + self.half_width if self.bounded else math.inf

    def text(self, percent: bool = True) -> str:
        """The change as the reasons quote it: ``-3.1 % ± 1.2 % over 4 seeds`` (``percent=False``:
        ``-0.031 ± 0.012 over 4 seeds``; ``, no interval`` when it is unbounded)."""
        m, e = self.mean, self.half_width
        body = (f"{100 * m:+.1f} %" + (f" ± {100 * e:.1f} %" if self.bounded else "")) if percent else \
            (f"{m:+.3f}" + (f" ± {e:.3f}" if self.bounded else ""))
        return body + f" over {self.n} seed{'s' if self.n != 1 else ''}{'' if self.bounded else ', no interval'}"


# --- the one rule -------------------------------------------------------------------------------
# Every claim is read as an estimate: a change with its interval, in each cell the claim speaks of.
# One test, the same for confirming and for refuting, turns each interval into a cell outcome, and
# one function turns the outcomes into the claim's word. Nothing else decides a word.
OUTCOMES = ("holds", "contradicted", "undecided")
FAMILY_LEVEL = 0.95  # the confidence of all the cells a claim reads in one place, together (Bonferroni)
MAX_SEEDS = 1000  # seeds_to_decide stops looking here

ONE_RULE = ("Each claim is an effect with its 95 % interval in every cell it reads (Bonferroni over the cells of one "
            "dataset or study). A cell holds when the interval lies wholly on the claim's side of its margin, is "
            "contradicted when it lies wholly on the other side, and is undecided otherwise. The word: reproduced "
            "(holds in every cell), holds where (holds in some, contradicted in none), mixed (holds in some, "
            "contradicted in others), not reproduced (contradicted somewhere, holds nowhere), inconclusive (undecided "
            "in every cell).")


@dataclass(frozen=True)
class Estimand:
    """What a claim reads and where it stands: ``what`` (the change, read where, in words), ``direction``
    (+1: the claim says the change is at least ``margin``; -1: at most ``margin``), ``margin`` (in the
    change's unit, signed: -0.02 for 'falls by no more than 2 points') and ``unit``."""

    what: str
    direction: int
    margin: float
    unit: str = ""

    def __post_init__(self) -> None:
        if self.direction not in (1, -1):
            raise ValueError(f"Estimand.direction must be +1 or -1, got {self.direction!r}")
        if not math.isfinite(float(self.margin)):
            raise ValueError(f"Estimand.margin must be finite, got {self.margin!r}")

    @property
    def side(self) -> str:
        """The claim's side of its margin, e.g. ``Δ ≥ +0.05``."""
        return f"Δ {'≥' if self.direction > 0 else '≤'} {self.margin:+g}" + (f" {self.unit}" if self.unit else "")

    def text(self) -> str:
        """The estimand as a page states it: what, and the claim's side."""
        return f"{self.what}; the claim's side: {self.side}"


def family_half_width(c: "Change", cells: int = 1) -> float:
    """The half-width of ``c``'s interval at :data:`FAMILY_LEVEL` over ``cells`` cells together
    (Bonferroni: each at level 1 - 0.05 / cells): its 95 % Student-t half-width rescaled by the ratio
    of the two t quantiles. 0 for an exact value (half-width 0), NaN when ``c`` is unbounded."""
    from scipy import stats

    if not c.bounded:
        return math.nan
    if c.half_width == 0 or cells <= 1:
        return c.half_width
    a = (1 - FAMILY_LEVEL) / cells
    return c.half_width * float(stats.t.ppf(1 - a / 2, c.n - 1) / stats.t.ppf(0.5 + FAMILY_LEVEL / 2, c.n - 1))


def outcome(c: "Change | None", est: Estimand, cells: int = 1) -> str:
    """``holds``, ``contradicted`` or ``undecided``: where ``c``'s interval over ``cells`` cells
    (:func:`family_half_width`) lies against ``est``'s margin. Holds: wholly on the claim's side
    (the margin itself included); contradicted: wholly on the other side; undecided: it straddles the
    margin, or has no width (fewer than two seeds), or nothing was measured."""
    if c is None or not math.isfinite(c.mean):
        return "undecided"
    hw = family_half_width(c, cells)
    if not math.isfinite(hw):
        return "undecided"
    lo, hi = est.direction * (c.mean - hw - est.margin), est.direction * (c.mean + hw - est.margin)
    lo, hi = min(lo, hi), max(lo, hi)
    return "holds" if lo >= 0 else "contradicted" if hi < 0 else "undecided"


def seeds_to_decide(c: "Change | None", est: Estimand, cells: int = 1) -> int | None:
    """The fewest seeds that would decide an undecided cell: the smallest n whose interval over
    ``cells`` cells, at ``c``'s own mean and per-seed spread, lies wholly on one side of the margin.
    ``c.n`` when it is already decided; None when no number up to :data:`MAX_SEEDS` would (the mean
    sits on the margin) or the spread is unknown (fewer than two seeds)."""
    from scipy import stats

    if c is None or not c.bounded:
        return None
    if outcome(c, est, cells) != "undecided":
        return c.n
    gap = abs(c.mean - est.margin)
    sd = c.half_width * math.sqrt(c.n) / float(stats.t.ppf(0.5 + FAMILY_LEVEL / 2, c.n - 1))
    a = (1 - FAMILY_LEVEL) / max(cells, 1)
    for n in range(c.n + 1, MAX_SEEDS + 1):
        if float(stats.t.ppf(1 - a / 2, n - 1)) * sd / math.sqrt(n) < gap:
            return n
    return None


@dataclass(frozen=True)
class Reading:
    """One cell of a claim: ``cell`` (its name in words, e.g. ``AdamW, η_OV = 1e-3, ratio 10 vs 1``),
    the ``change`` read there, its ``outcome`` (:func:`outcome`), the family half-width ``hw`` it was
    decided with, ``seeds`` (:func:`seeds_to_decide`; None when unknown) and the ``est`` it was read
    against."""

    cell: str
    change: "Change | None"
    outcome: str
    hw: float
    seeds: int | None
    est: "Estimand | None" = None

    def text(self, digits: int = 3) -> str:
        """``+0.154 ± 0.030 (n = 8)``: the change with its family interval."""
        c = self.change
        if c is None or not math.isfinite(c.mean):
            return "not measured"

        def num(x: float, sign: str = "+") -> str:  # a gap of 1e-16 stays readable, not +0.000
            return f"{x:{sign}.{digits}f}" if x == 0 or abs(x) >= 10 ** -digits else f"{x:{sign}.{digits}g}"

        ci = f" ± {num(self.hw, '')}" if math.isfinite(self.hw) else ", no interval"
        return f"{num(c.mean)}{ci} (n = {c.n})"


def read_cells(changes: Mapping[str, "Change | None"], est: "Estimand | Mapping[str, Estimand]") -> list[Reading]:
    """Every cell of a claim read by the one rule: ``changes`` maps each cell's name to its change
    (None: not measured, which is undecided and counts as a cell of the family); ``est`` is the
    claim's estimand, or one per cell where the cells read different quantities."""
    m = max(len(changes), 1)
    of = (lambda k: est[k]) if isinstance(est, Mapping) else (lambda k: est)  # noqa: E731
    return [Reading(k, c, outcome(c, of(k), m), family_half_width(c, m) if c is not None else math.nan,
                    seeds_to_decide(c, of(k), m), of(k)) for k, c in changes.items()]


def word(outcomes: Sequence[str]) -> str:
    """The claim's word from its cells' outcomes (:data:`OUTCOMES`): reproduced, holds where, mixed,
    not reproduced, inconclusive; ``not tested`` when there is no cell."""
    bad = [o for o in outcomes if o not in OUTCOMES]
    if bad:
        raise ValueError(f"cell outcomes must be among {OUTCOMES}, got {bad[0]!r}")
    if not outcomes:
        return "not tested"
    holds, against = "holds" in outcomes, "contradicted" in outcomes
    if holds and against:
        return "mixed"
    if holds:
        return "reproduced" if all(o == "holds" for o in outcomes) else "holds where"
    return "not reproduced" if against else "inconclusive"


def seeds_text(readings: Sequence[Reading]) -> str:
    """What the undecided cells would take: the seeds that would decide each (at its own mean and spread),
    or why no number can be given (fewer than two seed pairs: no spread yet; a mean on the margin)."""
    parts = []
    for r in sorted((r for r in readings if r.outcome == "undecided"), key=lambda r: (r.seeds is None, r.seeds or 0)):
        c = r.change
        if c is None or not math.isfinite(c.mean):
            parts.append(f"{r.cell}: nothing measured (no trained pair)")
        elif not c.bounded:
            parts.append(f"{r.cell}: {c.n} seed pair{'s' if c.n != 1 else ''}, no interval yet")
        elif r.seeds is None:
            parts.append(f"no number of seeds up to {MAX_SEEDS} would decide {r.cell} (its mean sits at the margin)")
        else:
            parts.append(f"{r.seeds} seeds would decide {r.cell}")
    return "; ".join(parts)


def decide(readings: Sequence[Reading], est: Estimand, rule: str = "") -> Verdict:
    """The claim's :class:`Verdict` from its cells (:func:`read_cells`): the word (:func:`word`), the
    region naming where it holds and where it is contradicted, the effect (every cell's change with its
    interval) and, for undecided cells, the seeds that would decide them."""
    outs = [r.outcome for r in readings]
    w = word(outs)
    rule = rule or est.text()
    if w == "not tested":
        return Verdict(w, rule, "no cell measured")
    named = {o: [r.cell for r in readings if r.outcome == o] for o in OUTCOMES}
    region = "; ".join(f"{label} {', '.join(named[o])}" for o, label in
                       (("holds", "holds at"), ("contradicted", "contradicted at"), ("undecided", "undecided at"))
                       if named[o]) if w in ("holds where", "mixed") else ""
    # cells read against different margins say each their own, so that the effect states what decided them
    sides = {r.est.side for r in readings if r.est is not None}
    effect = "; ".join(f"{r.cell}: {r.text()}" + (f" [{r.est.side}]" if len(sides) > 1 and r.est else "")
                       for r in readings)
    reason = f"{len(readings)} cells: " + ", ".join(f"{len(named[o])} {o}" for o in OUTCOMES if named[o])
    seeds = seeds_text(readings)
    return Verdict(w, rule, reason + (f"; {seeds}" if seeds else ""), region=region, effect=effect)


# Each claim's estimand: the change it reads, its direction and its margin (the thresholds above).
ESTIMANDS: dict[str, Estimand] = {
    "T1": Estimand("largest gap between the reduced loss and gradients and autograd's", -1, TOL_GRAD),
    "T2": Estimand("largest relative gap between the ODE with rate 2·eta·|w| and factor-level autograd", -1,
                   TOL_VELOCITY),
    "T3": Estimand("gap between a fitted exponent in log t and the claimed one (1 for OV, 2 for exp(q))", -1, SLOPE_TOL),
    "T4": Estimand("residual of the effective (OV, QK) path off a straight line", -1, LINE_EXACT),
    "T5": Estimand("fall of the log common-token mass at matched training loss, from one ratio to the next", 1,
                   SHARPER_LOGIT, "nats"),
    "T6": Estimand("log-odds of attention on the distinct token, factorized QK minus collapsed QK, at ratio 1", 1,
                   SHARPER_LOGIT, "nats"),
    "S1": Estimand("DTAP total-variation distance between two parameterizations at matched training loss", 1, DTAP_TV),
    "S2": Estimand("log-odds margin of a summary's pair over the best other parameterization", 1, S2_ODE_TIE, "nats"),
    "S3": Estimand("change of the log-odds of attention on the distinct token at matched training loss, higher ratio "
                   "against lower", 1, SHARPER_LOGIT, "nats"),
    "R1": Estimand("change of test accuracy, ratio r against ratio 1 at the same eta_OV, every run", 1, -SAME_ACC),
    "R2": Estimand("change of AC@0.5 on the test split, ratio r against ratio 1 at the same eta_OV, runs that trained",
                   1, MIN_GAIN_AC),
    "R3": Estimand("change of the mean attention on the relevant tokens at matched validation loss (both runs "
                   "learned), ratio r against ratio 1", 1, SHARPER),
    "R1-multilayer": Estimand("change of test accuracy, higher ratio against the lowest, paired by seed", 1, -SAME_ACC),
    "R2-multilayer": Estimand("change of a layer's head-mean attention on the relevant tokens, highest ratio against "
                              "the lowest, paired by seed", 1, HEAD_DELTA),
    "R3-multilayer": Estimand("change of the head-mean attention on the relevant tokens of the layer that gained most, "
                              "higher ratio against the lowest, paired by seed", 1, SHARPER),
}


def head_necessary(model: float, uniform: float, chance: float) -> bool | None:
    """Whether a head's attention is necessary for the prediction: the model's accuracy with its
    own attention (``model``), with uniform attention over the keys (``uniform``) and the chance
    accuracy (``chance``), all fractions. True when uniform attention loses at least
    :data:`NECESSITY_SHARE` of the above-chance accuracy; None when an input is not finite or the
    model is not above chance."""
    if any(x is None or not math.isfinite(float(x)) for x in (model, uniform, chance)) or float(model) <= float(chance):
        return None
    return (float(model) - float(uniform)) >= NECESSITY_SHARE * (float(model) - float(chance))


# the cell outcomes a word stands for, so that words from several chapters combine by the same rule
WORD_OUTCOMES = {"reproduced": ("holds",), "holds where": ("holds", "undecided"), "mixed": ("holds", "contradicted"),
                 "not reproduced": ("contradicted",), "inconclusive": ("undecided",), "not tested": ()}


def combine(measurements: Sequence[Mapping[str, Any]]) -> tuple[str, str, str]:
    """One ``(verdict, reason, region)`` from several chapters' rows on a claim (each with ``verdict``,
    ``chapter`` and optionally ``region`` and ``reason``), by the same :func:`word` as a chapter's cells:
    each chapter's word stands for the outcomes it summarises (:data:`WORD_OUTCOMES`). ``not run`` when
    there are none, ``not tested`` when nothing was tested. The reason names every chapter's word, so that
    no chapter's negative is hidden; the region names where it holds and where it is contradicted."""
    if not measurements:
        return "not run", "no chapter in this build reported this claim", ""
    bad = [m.get("verdict") for m in measurements if m.get("verdict") not in WORD_OUTCOMES]
    if bad:
        raise ValueError(f"a chapter's verdict must be one of {VERDICTS}, got {bad[0]!r}")
    tested = [m for m in measurements if m.get("verdict") != "not tested"]
    if not tested:
        return "not tested", "no chapter could make the comparison", ""

    def name(m: Mapping[str, Any]) -> str:
        return str(m.get("chapter") or "?")

    w = word([o for m in tested for o in WORD_OUTCOMES[m["verdict"]]])
    each = " · ".join(f"{name(m)}: {m.get('verdict')}" + (f" ({m['reason']})" if m.get("reason") else "")
                      for m in measurements)
    if len(tested) == 1:
        return w, "", str(tested[0].get("region", "")) if w in ("holds where", "mixed") else ""
    if w not in ("holds where", "mixed"):
        n = len(dict.fromkeys(name(m) for m in tested))  # one chapter may report several rows on a claim
        return w, f"{n} chapter{'s' if n > 1 else ''}, each {w}" if all(m["verdict"] == w for m in tested) else each, ""
    holds = [name(m) + (f" ({m['region']})" if m.get("region") and m["verdict"] != "reproduced" else "")
             for m in tested if "holds" in WORD_OUTCOMES[m["verdict"]]]
    against = [name(m) for m in tested if "contradicted" in WORD_OUTCOMES[m["verdict"]]]
    return w, f"chapters differ: {each}", "holds in " + "; ".join(holds) + (
        "; contradicted in " + ", ".join(against) if against else "")


_SIDE = re.compile(r"the claim's side: Δ (≥|≤) ([+-]?\d[\d.]*(?:e[+-]?\d+)?)")
_NUM = r"[+-]?\d[\d.]*(?:e[+-]?\d+)?"
_CELL = re.compile(rf"^(?P<cell>.+?): (?:(?P<mean>{_NUM})(?: ± (?P<hw>{_NUM})|, no interval) \(n = \d+\)|not measured)"
                   rf"(?: \[Δ (?P<dir>≥|≤) (?P<margin>{_NUM})(?: \S+)?\])?$")


def word_problem(verdict: str, rule: str, effect: str) -> str | None:
    """Whether a printed word agrees with the numbers printed with it: ``rule`` names the claim's side
    (``the claim's side: Δ ≥ +0.05``, as :meth:`Estimand.text` writes it) and ``effect`` every cell's change
    with its interval (as :func:`decide` writes it). Each printed interval is read back (an interval that
    rounding could put on either side counts as undecided) and :func:`word` of the outcomes must be
    ``verdict``. None when they agree, or when the row was not written by the one rule (no side, or an
    effect in another form); else the disagreement in words."""
    side = _SIDE.search(str(rule))
    parts = [p.strip() for p in str(effect).split("; ") if p.strip()]
    cells = [_CELL.match(p) for p in parts]
    if side is None or not cells or not all(cells) or verdict == "not tested":
        return None
    slack = 1e-3  # the effect prints 3 decimals: half a unit of the last place each way, and some
    outs = []
    for m in cells:
        if m.group("mean") is None or m.group("hw") is None:
            outs.append("undecided")
            continue
        # a cell that names its own margin is read against it, the others against the claim's
        d, mg = (m.group("dir"), m.group("margin")) if m.group("dir") else (side.group(1), side.group(2))
        sign, margin = (1 if d == "≥" else -1), float(mg)
        x, hw = float(m.group("mean")), float(m.group("hw"))
        lo, hi = sorted((sign * (x - hw - margin), sign * (x + hw - margin)))
        outs.append("holds" if lo >= slack * (hw > 0) else "contradicted" if hi < -slack * (hw > 0)
                    else "holds" if lo >= 0 and hw == 0 else "contradicted" if hi < 0 and hw == 0 else "undecided")
    loose = word(outs)
    if loose == verdict:
        return None
    # a cell on the margin within rounding may have been decided either way: accept any word those allow
    edge = [i for i, m in enumerate(cells) if m.group("hw") is not None and outs[i] == "undecided"]
    for pick in range(1 << min(len(edge), 8)):
        trial = list(outs)
        for j, i in enumerate(edge[:8]):
            m = cells[i]
            d, mg = (m.group("dir"), m.group("margin")) if m.group("dir") else (side.group(1), side.group(2))
            sign, margin = (1 if d == "≥" else -1), float(mg)
            x, hw = float(m.group("mean")), float(m.group("hw"))
            near_lo = abs(sign * (x - hw - margin)) <= slack if sign > 0 else abs(-(x + hw - margin)) <= slack
            near_hi = abs(sign * (x + hw - margin)) <= slack if sign > 0 else abs(-(x - hw - margin)) <= slack
            if pick >> j & 1:
                trial[i] = "holds" if near_lo else "contradicted" if near_hi else trial[i]
        if word(trial) == verdict:
            return None
    return (f"printed '{verdict}', but the intervals printed with it ({'; '.join(parts)}) read as '{loose}' against "
            f"{side.group(0).removeprefix('the claim' + chr(39) + 's side: ')} (or the margins the cells name)")
