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
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

VERDICTS = ("reproduced", "partly", "not reproduced", "not tested")
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
    thresholds, as shown on the scorecard) and ``reason`` (what decided it)."""

    verdict: str
    rule: str
    reason: str = ""

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict must be one of {VERDICTS}, got {self.verdict!r}")


def claim(claim_id: str, paper: str, ours: str, verdict: str | Verdict, chapter: str | None = None) -> dict[str, str]:
    """One row of the reproducibility scorecard: a claim ID (:data:`CLAIMS` or :data:`EXTENSIONS`),
    what the paper says, what we measured (numbers included), the verdict and, for a
    :class:`Verdict`, its rule and reason."""
    v = verdict if isinstance(verdict, Verdict) else Verdict(verdict, "", "")
    return {"id": claim_id, "paper": paper, "ours": ours, "verdict": v.verdict, "rule": v.rule,
            "reason": v.reason, "chapter": chapter or ""}


def verdict_glue(verdicts: Mapping[str, Verdict]) -> dict[str, str]:
    """Glue entries ``verdict_<ID>``, ``rule_<ID>`` and ``reason_<ID>`` of each verdict (``-`` in
    an ID becomes ``_``, so ``R3-synthetic`` gives ``verdict_R3_synthetic``)."""
    out = {}
    for cid, v in verdicts.items():
        key = cid.replace("-", "_")
        out.update({f"verdict_{key}": v.verdict, f"rule_{key}": v.rule, f"reason_{key}": v.reason})
    return out


def verdict_frame(verdicts: Mapping[str, Verdict]):
    """The verdicts as a table for display: one row per claim ID with verdict, rule and reason."""
    import pandas as pd

    return pd.DataFrame([{"claim": k, "verdict": v.verdict, "rule": v.rule, "reason": v.reason}
                         for k, v in verdicts.items()]).set_index("claim")


def _finite(xs: Sequence[float]) -> list[float]:
    return [float(x) for x in xs if x is not None and math.isfinite(float(x))]


def _t(name: str) -> str:
    return threshold_text(name)


# --- theory -------------------------------------------------------------------------------
T1_RULE = (f"reproduced: reduced loss and gradients equal autograd within {_t('TOL_GRAD')} AND the ODE tracks "
           f"full-model GD within {_t('TOL_OVERLAY')}; partly: only one of the two; not reproduced: neither")


def t1_reduction(loss_err: float, grad_err: float, overlay_err: float) -> Verdict:
    """T1 from the largest reduced-vs-autograd gaps (loss, gradient) and the largest ODE-vs-GD gap."""
    if len(_finite([loss_err, grad_err, overlay_err])) < 3:
        return Verdict("not tested", T1_RULE, "a gap is missing or not finite")
    exact = max(loss_err, grad_err) <= TOL_GRAD
    tracks = overlay_err <= TOL_OVERLAY
    v = "reproduced" if exact and tracks else "partly" if exact or tracks else "not reproduced"
    return Verdict(v, T1_RULE, f"gradient gap {max(loss_err, grad_err):.1e}, ODE-vs-GD gap {overlay_err:.3g}")


T2_RULE = (f"reproduced: factor-level autograd equals the ODE with rate 2·eta·sigma within {_t('TOL_VELOCITY')} "
           "(relative); not reproduced: otherwise")


def t2_rescaling(velocity_err: float) -> Verdict:
    """T2 from the largest relative gap between the rescaled ODE and factor-level autograd."""
    if not _finite([velocity_err]):
        return Verdict("not tested", T2_RULE, "no finite velocity gap")
    v = "reproduced" if velocity_err <= TOL_VELOCITY else "not reproduced"
    return Verdict(v, T2_RULE, f"relative gap {velocity_err:.1e}")


T3_RULE = (f"reproduced: the OV scalar's fitted exponent in log t is within {_t('SLOPE_TOL')} of 1 for every "
           f"parameterization AND the QK scalar q itself grows like log² t (exponent within {_t('LITERAL_TOL')} of 2); "
           f"partly: OV ~ log t and exp(q) ~ log² t (exponent within {_t('SLOPE_TOL')} of 2) for CACO only; "
           "not reproduced: otherwise")


def t3_growth(ov_exponents: Sequence[float], q_exponents: Sequence[float], exp_q_exponent_caco: float) -> Verdict:
    """T3 from the fitted exponents in log t of the OV scalar and of q (one per parameterization)
    and of exp(q) for CACO."""
    ov, q = _finite(ov_exponents), _finite(q_exponents)
    if not ov or not q or not _finite([exp_q_exponent_caco]):
        return Verdict("not tested", T3_RULE, "no fitted exponents")
    ov_ok = max(abs(x - 1) for x in ov) <= SLOPE_TOL
    literal = any(abs(x - 2) <= LITERAL_TOL for x in q)
    exp_form = abs(exp_q_exponent_caco - 2) <= SLOPE_TOL
    v = "reproduced" if ov_ok and literal else "partly" if ov_ok and exp_form else "not reproduced"
    return Verdict(v, T3_RULE, f"OV exponents {min(ov):.3f}-{max(ov):.3f}; q exponents up to {max(q):.2f}; "
                               f"exp(q) exponent for CACO {exp_q_exponent_caco:.2f}")


T4_RULE = (f"reproduced: the line is exact (residual ≤ {_t('LINE_EXACT')}) for a fixed number of common tokens AND "
           f"within {_t('LINE_APPROX')} (relative) for the mixture; partly: exact for fixed n only; "
           "not reproduced: not even for fixed n")


def t4_line(residual_single: float, residual_mixture: float) -> Verdict:
    """T4 from the largest residual off the straight line for fixed n and for the mixture over n."""
    if not _finite([residual_single]):
        return Verdict("not tested", T4_RULE, "no residual")
    exact = residual_single <= LINE_EXACT
    mix_ok = _finite([residual_mixture]) and residual_mixture <= LINE_APPROX
    v = "reproduced" if exact and mix_ok else "partly" if exact else "not reproduced"
    return Verdict(v, T4_RULE, f"residual {residual_single:.1e} for fixed n, {residual_mixture:.1%} for the mixture")


T5_RULE = ("reproduced: in the ODE the common-token mass at the end falls strictly with the ratio for every "
           f"parameterization AND in full-model runs attention on the distinct token rises by ≥ {_t('SHARPER')} "
           "from the lowest to the highest ratio for every parameterization; partly: some but not all of these; "
           "not reproduced: none; not tested: fewer than two ratios")


def t5_sharpening(common_by_ratio: Mapping[str, Sequence[float]], full_rise: Mapping[str, float]) -> Verdict:
    """T5 from, per parameterization, the ODE's common-token mass at the end at increasing ratios
    and the full-model rise of attention on the distinct token (highest minus lowest ratio)."""
    series = {p: _finite(v) for p, v in common_by_ratio.items()}
    if not series or min(len(v) for v in series.values()) < 2:
        return Verdict("not tested", T5_RULE, "fewer than two ratios")
    falls = [all(b < a for a, b in zip(v, v[1:])) for v in series.values()]
    rises = [float(d) >= SHARPER for d in full_rise.values() if d is not None and math.isfinite(float(d))]
    checks = falls + rises
    v = "reproduced" if all(checks) else "partly" if any(checks) else "not reproduced"
    return Verdict(v, T5_RULE, f"common mass falls for {sum(falls)}/{len(falls)}; full-model attention rises for "
                               f"{sum(rises)}/{len(rises)}")


T6_RULE = ("reproduced: a factorized QK circuit is sharper than a collapsed one (FACO vs CACO and FAFO vs CAFO) in "
           "every comparison made (ODE horizons and full-model runs); partly: in some; not reproduced: in none; "
           "not tested: no comparison")


def t6_factorized_qk(margins: Sequence[float]) -> Verdict:
    """T6 from sharpness margins (factorized-QK attention minus collapsed-QK attention, or the
    collapsed one's common mass minus the factorized one's), one per comparison."""
    m = _finite(margins)
    if not m:
        return Verdict("not tested", T6_RULE, "no comparison")
    k = sum(x > 0 for x in m)
    v = "reproduced" if k == len(m) else "partly" if k else "not reproduced"
    return Verdict(v, T6_RULE, f"factorized QK sharper in {k}/{len(m)} comparisons")


# --- synthetic experiments -------------------------------------------------------------------
S2_PAIRS = {"A": frozenset({"CACO", "FACO"}), "B": frozenset({"CAFO", "CACO"})}
S2_PARTNER = {"A": "FACO", "B": "CACO"}  # where each summary says a faster QK moves FAFO


def s2_summary(attention: Mapping[str, float]) -> str:
    """Which summary (``A`` = (CACO, FACO), ``B`` = (CAFO, CACO), or ``neither``) the two
    parameterizations with the most attention on the distinct token match."""
    top = frozenset(sorted(attention, key=lambda p: -attention[p])[:2])
    return next((k for k, pair in S2_PAIRS.items() if pair == top), "neither")


def s2_fafo_move(before: Mapping[str, float], after: Mapping[str, float], gap: Change | None = None) -> str | None:
    """Where a faster QK moves FAFO, for :func:`s2_ladder`: ``before``/``after`` are FAFO's
    distances (at equal rates / at the faster ratio) to each candidate (``FACO``, ``CACO``) at
    equal rates. The candidate whose distance fell; if both fell, the closer one after, unless the
    two distances after are equal: :func:`is_tie` of ``gap`` (the per-seed difference of the
    distances after, FACO's minus CACO's), or exactly equal without it. Then ``"tie"``, which
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


S1_RULE = ("at each training-loss level of the matched-loss ladder, a pair of parameterizations differs when the 95 % "
           f"seed interval of its per-seed DTAP total-variation distance lies at or above {_t('DTAP_TV')}, and is the "
           "same when it lies below; reproduced: every pair differs at every level; partly: some pair differs at some "
           "level; not reproduced: every pair is the same at every level; not tested: no pair decided either way, or "
           "no level reached by two parameterizations")


def s1_pair(tv: Change) -> str:
    """One pair at one loss level for S1: ``"differ"`` when the seed interval of its per-seed
    DTAP distance (``tv``) lies at or above ``DTAP_TV``, ``"same"`` when it lies below,
    ``"undecided"`` when it straddles it or is unbounded (fewer than two seeds)."""
    if not tv.bounded:
        return "undecided"
    return "differ" if tv.lo >= DTAP_TV else "same" if tv.hi < DTAP_TV else "undecided"


def s1_ladder(levels: Mapping[float, Mapping[tuple[str, str], Change]]) -> Verdict:
    """S1 on the matched-loss ladder: ``levels`` maps each training-loss level to the per-seed
    DTAP distance of every pair of parameterizations there (:func:`s1_pair` decides each)."""
    calls = {lv: {k: s1_pair(c) for k, c in pairs.items()} for lv, pairs in levels.items() if pairs}
    if not calls:
        return Verdict("not tested", S1_RULE, "no loss level reached by two parameterizations")
    flat = [c for d in calls.values() for c in d.values()]
    v = ("reproduced" if all(c == "differ" for c in flat) else "partly" if "differ" in flat else
         "not reproduced" if all(c == "same" for c in flat) else "not tested")
    parts = [f"loss {lv:g}: {sum(c == 'differ' for c in d.values())} of {len(d)} pairs differ, "
             f"{sum(c == 'same' for c in d.values())} the same" for lv, d in sorted(calls.items(), reverse=True)]
    return Verdict(v, S1_RULE, "; ".join(parts))


S2_RULE = ("decided at equal rates at every training-loss level of the matched-loss ladder. At a level, the "
           "top two are the two parameterizations with the most attention on the distinct token, unless the second "
           "and third are equal within the 95 % seed interval of their per-seed difference (a tie: no top two); "
           "FAFO's move compares its DTAP distances to FACO's and CACO's equal-rate heatmaps at the same level, at "
           "equal rates and at the highest faster ratio, and is a tie when the two distances end equal within their "
           "seed interval. Reproduced: at every level the top two are one summary's pair, the same summary "
           "throughout, and FAFO moves toward its partner (FACO for (CACO, FACO), CACO for (CAFO, CACO)); partly: "
           "some level supports a summary by its pair or by FAFO's move; not reproduced: no level does, and every "
           "level's top two and move were measured; not tested: otherwise (no level reached by all four "
           "parameterizations, or a top two or move without two seeds). A tie supports neither summary")


def s2_level(pair: str, move: str | None) -> tuple[bool, bool]:
    """Whether one ladder level's top two (``"A"``, ``"B"``, ``"neither"``, ``"tie"`` or ``"not
    tested"``) and FAFO's move (``"FACO"``, ``"CACO"``, ``"neither"``, ``"tie"`` or None: not
    measured) support a summary."""
    pair_ok = pair in S2_PAIRS
    move_ok = move == S2_PARTNER[pair] if pair_ok else move in S2_PARTNER.values()
    return pair_ok, move_ok


def s2_ladder(levels: Mapping[float, tuple[str, str | None]]) -> Verdict:
    """The book's S2 verdict: ``levels`` maps each training-loss level reached by all four
    parameterizations to (top two, FAFO's move), as :func:`s2_level` reads them."""
    if not levels:
        return Verdict("not tested", S2_RULE, "no loss level reached by all four parameterizations")
    ok = {lv: s2_level(*pm) for lv, pm in levels.items()}
    full = all(a and b for a, b in ok.values()) and len({p for p, _ in levels.values()}) == 1
    measured = all(p != "not tested" and m is not None for p, m in levels.values())
    v = ("reproduced" if full else "partly" if any(a or b for a, b in ok.values()) else
         "not reproduced" if measured else "not tested")
    name = {"A": "summary A", "B": "summary B", "neither": "neither pair", "tie": "a tie", "not tested": "not measured"}
    parts = [f"loss {lv:g}: top two {name.get(p, p)}, FAFO's move {m or 'not measured'}"
             for lv, (p, m) in sorted(levels.items(), reverse=True)]
    return Verdict(v, S2_RULE, "; ".join(parts))


S3_RULE = (f"reproduced: from the lowest to the highest ratio, attention on the distinct token rises by ≥ {_t('SHARPER')} "
           f"for every parameterization while |Δ test loss| ≤ {_t('SAME_LOSS')} and |Δ accuracy| ≤ {_t('SAME_ACC')}; "
           "partly: it rises for some, or rises with a loss or accuracy change; not reproduced: it rises for none; "
           "not tested: fewer than two ratios")


def s3_ratio_sharpens(d_attention: Sequence[float], d_loss: Sequence[float], d_accuracy: Sequence[float]) -> Verdict:
    """S3 from, per parameterization, the change (highest minus lowest ratio) of mean attention on
    the distinct token, of test loss (nats) and of test accuracy. Empty: fewer than two ratios."""
    da, dl, dc = _finite(d_attention), _finite(d_loss), _finite(d_accuracy)
    if not da:
        return Verdict("not tested", S3_RULE, "fewer than two ratios")
    up = sum(x >= SHARPER for x in da)
    same = (max(map(abs, dl), default=0.0) <= SAME_LOSS) and (max(map(abs, dc), default=0.0) <= SAME_ACC)
    v = "reproduced" if up == len(da) and same else "partly" if up else "not reproduced"
    return Verdict(v, S3_RULE, f"attention rose for {up}/{len(da)}; largest |Δ loss| "
                               f"{max(map(abs, dl), default=float('nan')):.3f} nats, |Δ accuracy| "
                               f"{max(map(abs, dc), default=float('nan')):.3f}")


S3_ROBUST_RULE = ("S3's rule applied to each robustness variant; reproduced: every variant reproduces S3; "
                  "not reproduced: no variant reproduces or partly reproduces it; partly: otherwise (also when a "
                  "variant could not be tested); not tested: no variant could be tested")


def s3_robustness(per_variant: Mapping[str, Verdict]) -> Verdict:
    """The S3-robustness extension from the :func:`s3_ratio_sharpens` verdict of each variant."""
    tested = {k: v.verdict for k, v in per_variant.items() if v.verdict != "not tested"}
    if not tested:
        return Verdict("not tested", S3_ROBUST_RULE, "no variant with two ratios")
    n = {x: sum(v == x for v in tested.values()) for x in VERDICTS}
    untested = len(per_variant) - len(tested)
    v = ("reproduced" if n["reproduced"] == len(tested) and not untested else
         "not reproduced" if n["not reproduced"] == len(tested) else "partly")
    reason = ", ".join(f"{x} {n[x]}" for x in VERDICTS[:3] if n[x]) + (f", not tested {untested}" if untested else "")
    return Verdict(v, S3_ROBUST_RULE, f"of {len(per_variant)} variants: {reason}")


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

    @property
    def bounded(self) -> bool:
        """Whether the interval is finite (at least two seed pairs and a finite half-width)."""
        return self.n >= 2 and math.isfinite(self.half_width)

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


def _has(c: Change | None) -> bool:
    """Whether ``c`` is a measured change (a :class:`Change` with a finite mean); TypeError for
    anything but a Change or None (e.g. a bare float, which has no seed interval)."""
    if c is not None and not isinstance(c, Change):
        raise TypeError(f"the real-data rules take claims.Change values (mean, half_width, n) or None, "
                        f"got {type(c).__name__} {c!r}")
    return c is not None and math.isfinite(c.mean)


def _at(i: int, ratios: Sequence[float] | None, k: int) -> str:
    return f"ratio {ratios[i]:g}" if ratios is not None and i < len(ratios) else f"higher ratio {i + 1} of {k}"


def head_necessary(model: float, uniform: float, chance: float) -> bool | None:
    """Whether a head's attention is necessary for the prediction: the model's accuracy with its
    own attention (``model``), with uniform attention over the keys (``uniform``) and the chance
    accuracy (``chance``), all fractions. True when uniform attention loses at least
    :data:`NECESSITY_SHARE` of the above-chance accuracy; None when an input is not finite or the
    model is not above chance."""
    if any(x is None or not math.isfinite(float(x)) for x in (model, uniform, chance)) or float(model) <= float(chance):
        return None
    return (float(model) - float(uniform)) >= NECESSITY_SHARE * (float(model) - float(chance))


R1_RULE = ("each change is the mean over seeds of (ratio r minus ratio 1, same seed) over every model that "
           "trained, not only those that beat chance, with its 95 % seed interval; reproduced: at every ratio above 1 "
           f"the intervals of the accuracy and macro-F1 changes lie above -{_t('SAME_ACC')} (fraction) and come from "
           f"at least {_t('MIN_SEEDS')} seeds; not reproduced: at the highest ratio compared the whole accuracy "
           f"interval (and the macro-F1 one) lies below -{_t('SAME_ACC')}; partly: otherwise (an interval straddles "
           "the band, or too few seeds); not tested: no ratio above 1 with a change")


def r1_performance_stable(d_accuracy: Sequence[Change | None], d_f1: Sequence[Change | None],
                          ratios: Sequence[float] | None = None) -> Verdict:
    """R1 from the paired changes of test accuracy and macro-F1 (fractions), one :class:`Change`
    per ratio above 1 in increasing ratio order (None where nothing could be compared; ``d_f1``
    may be empty when macro-F1 was not measured). ``ratios``, if given, names the ratios in the
    reason."""
    acc, f1 = list(d_accuracy), list(d_f1)
    with_f1 = any(_has(c) for c in f1)
    per = [[("accuracy", a)] + ([("macro-F1", f1[i] if i < len(f1) else None)] if with_f1 else [])
           for i, a in enumerate(acc)]
    compared = [i for i, cs in enumerate(per) if _has(cs[0][1])]
    if not compared:
        return Verdict("not tested", R1_RULE, "no higher ratio with a change")
    k = len(per)
    changes = [(i, name, c) for i, cs in enumerate(per) for name, c in cs if _has(c)]
    i_w, name_w, worst = min(changes, key=lambda t: t[2].mean)
    why = f"largest drop {worst.text()} ({name_w}, {_at(i_w, ratios, k)})"
    complete = len(changes) == sum(len(cs) for cs in per)
    n_min = min(c.n for _, _, c in changes)
    if complete and all(c.lo >= -SAME_ACC for _, _, c in changes) and n_min >= MIN_SEEDS:
        return Verdict("reproduced", R1_RULE, why)
    top = [c for _, c in per[compared[-1]] if _has(c)]
    if all(c.hi < -SAME_ACC for c in top):
        return Verdict("not reproduced", R1_RULE, f"{why}; at {_at(compared[-1], ratios, k)} the whole interval "
                                                  f"is a drop beyond -{_t('SAME_ACC')}")
    causes = []
    if not complete:
        causes.append("no change at " + ", ".join(_at(i, ratios, k) for i, cs in enumerate(per)
                                                   if not all(_has(c) for _, c in cs)))
    if n_min < MIN_SEEDS:
        causes.append(f"too few seeds ({n_min} < {_t('MIN_SEEDS')})")
    elif any(c.lo < -SAME_ACC <= c.hi for _, _, c in changes):
        causes.append("undecided: interval straddles the band")
    if not causes:
        causes.append("a drop beyond the band below the highest ratio, or in only one of the two metrics")
    return Verdict("partly", R1_RULE, f"{why}; " + "; ".join(causes))


R2_RULE = (f"changes at the highest ratio with a trained run, against ratio 1, paired by seed; a metric improves "
           f"when its whole 95 % seed interval clears its margin: AC@0.5 rises by ≥ {_t('MIN_GAIN_AC')}, ACMC@0.5 "
           f"by ≥ {_t('MIN_GAIN_ACMC')}, sufficiency falls by ≥ {_t('MIN_GAIN_SUFF')} (an interval needs at least "
           f"2 seeds); reproduced: all three improve, from at least {_t('MIN_SEEDS')} seeds; partly: one or two "
           "improve, or all three with too few seeds; not reproduced: none improves; not tested: nothing measured")


def r2_interpretability(d_ac: Change | None, d_acmc: Change | None, d_sufficiency: Change | None) -> Verdict:
    """R2 from the paired changes at the highest trained ratio against ratio 1 of AC@0.5 and
    ACMC@0.5 (fractions, up is better) and of the sufficiency score (down is better); None
    when not measured."""
    items = [("AC@0.5", d_ac, MIN_GAIN_AC, 1), ("ACMC@0.5", d_acmc, MIN_GAIN_ACMC, 1),
             ("sufficiency", d_sufficiency, MIN_GAIN_SUFF, -1)]
    measured = [(name, c, gain, sign) for name, c, gain, sign in items if _has(c)]
    if not measured:
        return Verdict("not tested", R2_RULE, "nothing measured at a higher ratio")
    up = [name for name, c, gain, sign in measured if c.bounded and sign * c.mean - c.half_width >= gain]
    n_min = min(c.n for _, c, _, _ in measured)
    v = "reproduced" if len(up) == 3 and n_min >= MIN_SEEDS else "partly" if up else "not reproduced"
    each = ", ".join(f"{name} {c.text(percent=False)}" for name, c, _, _ in measured)

    tail = f"; too few seeds ({n_min} < {_t('MIN_SEEDS')})" if len(up) == 3 and v == "partly" else ""
    return Verdict(v, R2_RULE, f"{len(up)}/{len(measured)} improved beyond their margin ({each}){tail}")


R3_RULE = (f"read at the highest ratio with a change, against ratio 1, paired by seed, with 95 % seed intervals; "
           f"reproduced: the attention interval lies above {_t('SHARPER')} and the accuracy interval inside "
           f"±{_t('SAME_ACC')}, from at least {_t('MIN_SEEDS')} seeds; not reproduced: the whole attention interval "
           f"lies below {_t('SHARPER')} (no rise); partly: otherwise (a rise with an accuracy change, an interval "
           "that straddles its threshold, or too few seeds); not tested: no ratio above 1 with a change, or the "
           f"prediction does not need the head's attention (uniform attention loses less than {_t('NECESSITY_SHARE')} "
           "of the above-chance accuracy)")


def r3_decoupled(d_attention: Sequence[Change | None], d_accuracy: Sequence[Change | None],
                 necessary: bool | None = None, ratios: Sequence[float] | None = None) -> Verdict:
    """R3 from the paired changes of mean attention on the relevant tokens and of accuracy
    (fractions), one :class:`Change` per ratio above 1 in increasing ratio order (None where
    nothing was compared), read at the highest ratio where both have a change. ``necessary``:
    :func:`head_necessary` (False: not tested; None: unknown). ``ratios`` names the ratios in
    the reason."""
    if necessary is False:
        return Verdict("not tested", R3_RULE, "the prediction does not need the head's attention")
    att, acc = list(d_attention), list(d_accuracy)
    both = [i for i in range(min(len(att), len(acc))) if _has(att[i]) and _has(acc[i])]
    if not both:
        return Verdict("not tested", R3_RULE, "no higher ratio with a change")
    i = both[-1]
    a, c = att[i], acc[i]
    why = f"at {_at(i, ratios, len(att))}: attention {a.text(percent=False)}, accuracy {c.text()}"
    n_min = min(a.n, c.n)
    acc_same = c.lo >= -SAME_ACC and c.hi <= SAME_ACC
    if a.lo >= SHARPER and acc_same and n_min >= MIN_SEEDS:
        return Verdict("reproduced", R3_RULE, why)
    if a.hi < SHARPER:
        return Verdict("not reproduced", R3_RULE, f"{why}; no rise")
    if n_min < MIN_SEEDS:
        cause = f"too few seeds ({n_min} < {_t('MIN_SEEDS')})"
    elif a.lo < SHARPER:
        cause = "undecided: the attention interval straddles the threshold"
    elif c.hi < -SAME_ACC or c.lo > SAME_ACC:
        cause = "attention rises together with an accuracy change"
    else:
        cause = "undecided: the accuracy interval straddles the band"
    return Verdict("partly", R3_RULE, f"{why}; {cause}")


HEADS_RULE = (f"reproduced: at the highest ratio the head-mean attention on the relevant tokens rises by ≥ "
              f"{_t('HEAD_DELTA')} in every layer; partly: in some layers; not reproduced: in none; "
              "not tested: one ratio")


def heads_sharpen(layer_gains: Sequence[float]) -> Verdict:
    """Extension of R2 to a multi-layer encoder, from the change of each layer's head-mean
    attention on the relevant tokens between the lowest and the highest ratio."""
    g = _finite(layer_gains)
    if not g:
        return Verdict("not tested", HEADS_RULE, "one ratio")
    k = sum(x >= HEAD_DELTA for x in g)
    v = "reproduced" if k == len(g) else "partly" if k else "not reproduced"
    return Verdict(v, HEADS_RULE, f"head-mean attention rose in {k}/{len(g)} layers (largest {max(g):+.3f})")


TUNED_RULE = ("reproduced: the claim's rule gives 'reproduced' at the tuned base rate (best validation metric at "
              "ratio 1) of every optimizer; not reproduced: at none of them; partly: at some; not tested: no tuned "
              "base rate could be tested")


def tuned_region(at_tuned: Mapping[str, str]) -> Verdict:
    """A claim's verdict over the base-rate map, from its verdict (by its own rule) at the tuned
    base rate of each optimizer, e.g. ``{"adamw": "reproduced", "sgd": "partly"}``."""
    tested = {o: v for o, v in at_tuned.items() if v != "not tested"}
    if not tested:
        return Verdict("not tested", TUNED_RULE, "no tuned base rate could be tested")
    k = sum(v == "reproduced" for v in tested.values())
    n_not = sum(v == "not reproduced" for v in tested.values())
    v = "reproduced" if k == len(tested) else "not reproduced" if n_not == len(tested) else "partly"
    return Verdict(v, TUNED_RULE, "; ".join(f"{o}: {x}" for o, x in at_tuned.items()))


RULE_TEXT = {"T1": T1_RULE, "T2": T2_RULE, "T3": T3_RULE, "T4": T4_RULE, "T5": T5_RULE, "T6": T6_RULE,
             "S1": S1_RULE, "S2": S2_RULE, "S3": S3_RULE, "R1": R1_RULE, "R2": R2_RULE, "R3": R3_RULE}
RULES = {"T1": t1_reduction, "T2": t2_rescaling, "T3": t3_growth, "T4": t4_line, "T5": t5_sharpening,
         "T6": t6_factorized_qk, "S1": s1_ladder, "S2": s2_ladder, "S3": s3_ratio_sharpens,
         "R1": r1_performance_stable, "R2": r2_interpretability, "R3": r3_decoupled}


def combine(measurements: Sequence[Mapping[str, Any]]) -> tuple[str, str]:
    """One verdict and its reason from several chapters' rows on a claim: ``not run`` when there
    are none, ``not tested`` when nothing was tested, the common verdict when the tested ones
    agree; when they disagree, ``partly``, and the reason names every chapter's verdict (and
    reason), untested ones included, so that no chapter's negative is hidden."""
    if not measurements:
        return "not run", "no chapter in this build reported this claim"
    tested = [m for m in measurements if m.get("verdict") != "not tested"]
    if not tested:
        return "not tested", "no chapter could make the comparison"
    verdicts = {m.get("verdict") for m in tested}
    if len(verdicts) == 1:
        return tested[0]["verdict"], "" if len(tested) == 1 else f"{len(tested)} chapters agree"
    return "partly", "chapters disagree: " + " · ".join(
        f"{m.get('chapter')}: {m.get('verdict')}" + (f" ({m['reason']})" if m.get("reason") else "")
        for m in measurements)
