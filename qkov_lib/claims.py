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


def _region(holds: Sequence[str], fails: Sequence[str], unit: str = "") -> str:
    """``for a, b; not for c`` from the places where a claim holds and where it fails (``unit``
    prefixes each list, e.g. ``"for "`` or ``"at "``)."""
    out = (unit or "for ") + ", ".join(holds)
    return out + (f"; not {unit or 'for '}" + ", ".join(fails) if fails else "")


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


def _t(name: str) -> str:
    return threshold_text(name)


# --- theory -------------------------------------------------------------------------------
T1_RULE = (f"reproduced: reduced loss and gradients equal autograd within {_t('TOL_GRAD')} AND the ODE tracks "
           f"full-model GD within {_t('TOL_OVERLAY')}; holds where: only one of the two (the region names which); "
           "not reproduced: neither")


def t1_reduction(loss_err: float, grad_err: float, overlay_err: float) -> Verdict:
    """T1 from the largest reduced-vs-autograd gaps (loss, gradient) and the largest ODE-vs-GD gap."""
    if len(_finite([loss_err, grad_err, overlay_err])) < 3:
        return Verdict("not tested", T1_RULE, "a gap is missing or not finite")
    exact = max(loss_err, grad_err) <= TOL_GRAD
    tracks = overlay_err <= TOL_OVERLAY
    why = f"gradient gap {max(loss_err, grad_err):.1e}, ODE-vs-GD gap {overlay_err:.3g}"
    if exact and tracks:
        return Verdict("reproduced", T1_RULE, why, effect=why)
    if exact or tracks:
        region = ("for the reduced loss and gradients (exact); the ODE does not track GD within "
                  f"{_t('TOL_OVERLAY')}" if exact else
                  "for the ODE against GD; the reduced gradients differ from autograd beyond "
                  f"{_t('TOL_GRAD')}")
        return Verdict("holds where", T1_RULE, why, region=region, effect=why)
    return Verdict("not reproduced", T1_RULE, why, effect=why)


T2_RULE = (f"reproduced: factor-level autograd equals the ODE with rate 2·eta·sigma within {_t('TOL_VELOCITY')} "
           "(relative); not reproduced: otherwise")


def t2_rescaling(velocity_err: float) -> Verdict:
    """T2 from the largest relative gap between the rescaled ODE and factor-level autograd."""
    if not _finite([velocity_err]):
        return Verdict("not tested", T2_RULE, "no finite velocity gap")
    v = "reproduced" if velocity_err <= TOL_VELOCITY else "not reproduced"
    return Verdict(v, T2_RULE, f"relative gap {velocity_err:.1e}", effect=f"relative gap {velocity_err:.1e}")


T3_RULE = (f"a growth law holds when its fitted exponent in log t is within {_t('SLOPE_TOL')} of the derived one "
           f"(within {_t('LITERAL_TOL')} of 2 for q itself); reproduced: the OV scalar grows like log t for every "
           "parameterization AND the QK scalar q itself like log² t (the summaries' wording); holds where: OV ~ log t "
           "everywhere and exp(q) ~ log² t for some parameterizations (the region names them); not reproduced: OV "
           "does not grow like log t, or neither q nor exp(q) grows like log² t for any parameterization")


def t3_growth(ov_exponents: Sequence[float], q_exponents: Sequence[float],
              exp_q_exponents: Mapping[str, float], t_range: str = "") -> Verdict:
    """T3 from the fitted exponents in log t of the OV scalar (any number), of q (one per
    parameterization) and of exp(q) per parameterization (``{"CACO": 2.01, ...}``). ``t_range``
    names the fit window in the region (e.g. ``"t from 1e6 to 1e8"``)."""
    ov, q = _finite(ov_exponents), _finite(q_exponents)
    eq = {p: float(x) for p, x in exp_q_exponents.items() if x is not None and math.isfinite(float(x))}
    if not ov or not q or not eq:
        return Verdict("not tested", T3_RULE, "no fitted exponents")
    ov_ok = max(abs(x - 1) for x in ov) <= SLOPE_TOL
    literal = any(abs(x - 2) <= LITERAL_TOL for x in q)
    sq = [p for p, x in eq.items() if abs(x - 2) <= SLOPE_TOL]
    why = (f"OV exponents {min(ov):.3f}-{max(ov):.3f}; q exponents up to {max(q):.2f}; exp(q) exponents "
           + ", ".join(f"{p} {x:.2f}" for p, x in eq.items()))
    effect = f"OV exponent {min(ov):.3f}-{max(ov):.3f} (law: 1); largest q exponent {max(q):.2f} (wording: 2)"
    if ov_ok and literal:
        return Verdict("reproduced", T3_RULE, why, effect=effect)
    if ov_ok and sq:
        other = [p for p in eq if p not in sq]
        region = (f"OV ~ log t for every parameterization; exp(q) ~ log² t for {', '.join(sq)}"
                  + (f", not for {', '.join(other)}" if other else "") + "; q itself does not grow like log² t"
                  + (f" ({t_range})" if t_range else ""))
        return Verdict("holds where", T3_RULE, why, region=region, effect=effect)
    return Verdict("not reproduced", T3_RULE, why, effect=effect)


T4_RULE = (f"reproduced: the line is exact (residual ≤ {_t('LINE_EXACT')}) for a fixed number n of common tokens "
           f"AND within {_t('LINE_APPROX')} (relative) for the mixture over n; holds where: exact at fixed n, "
           "approximate beyond that for the mixture; not reproduced: not even for fixed n")


def t4_line(residual_single: float, residual_mixture: float) -> Verdict:
    """T4 from the largest residual off the straight line for fixed n and for the mixture over n."""
    if not _finite([residual_single]):
        return Verdict("not tested", T4_RULE, "no residual")
    exact = residual_single <= LINE_EXACT
    mix_ok = bool(_finite([residual_mixture])) and residual_mixture <= LINE_APPROX
    why = f"residual {residual_single:.1e} for fixed n, {residual_mixture:.1%} for the mixture"
    if exact and mix_ok:
        return Verdict("reproduced", T4_RULE, why, effect=why)
    if exact:
        return Verdict("holds where", T4_RULE, why, effect=why,
                       region=f"exactly at fixed n (residual {residual_single:.1e}); approximately for mixtures "
                              f"over n (relative residual up to {residual_mixture:.1%})")
    return Verdict("not reproduced", T4_RULE, why, effect=why)


SHARPER_LOGIT = _threshold("SHARPER_LOGIT", 0.1, "nats", "smallest rise of the log-odds of the attention on the "
                                                       "relevant token, log(a / (1 - a)), that counts as 'sharper' "
                                                       "(near saturation: the fall of the log common-token mass)")


def log_odds(attention: float) -> float:
    """``log(a / (1 - a))`` of an attention mass ``a`` on the relevant token (``1 - a``: the mass
    on common tokens), clipped to [1e-12, 1 - 1e-12]; in nats. It keeps moving where ``a`` saturates
    (a common-token mass falling 10x raises it by log 10), which a difference of ``a`` does not."""
    a = min(max(float(attention), 1e-12), 1.0 - 1e-12)
    return math.log(a) - math.log1p(-a)


def interval_call(c: "Change", threshold: float) -> str:
    """``"holds"`` when the 95 % seed interval of ``c`` lies at or above ``threshold``, ``"fails"``
    when it lies below, ``"undecided"`` when it straddles it or is unbounded (fewer than 2 seeds)."""
    return "holds" if c.bounded and c.lo >= threshold else "fails" if c.hi < threshold else "undecided"


T5_RULE = ("T5 compares the common-token mass across ratios at matched training loss. ODE: at every matched loss "
           "level reached at every ratio, the mass falls strictly as the ratio rises. Full model: the per-seed fall of "
           "the log common-token mass from the lowest to the highest ratio has a 95 % seed interval (2 seeds or more) "
           f"at or above {_t('SHARPER_LOGIT')}. A parameterization passes when both hold and fails when either is "
           "contradicted (the ODE mass ends higher at the highest ratio than at the lowest, or the whole interval "
           "lies below the threshold). Reproduced: every parameterization passes. Holds where: some pass (named). "
           "Not reproduced: every one fails. Inconclusive: otherwise (an interval straddles the threshold or has "
           "one seed). Not tested: fewer than two ratios")


def t5_sharpening(common_by_ratio: Mapping[str, Sequence[Sequence[float]]],
                  full_fall: Mapping[str, "Change | None"]) -> Verdict:
    """T5 from, per parameterization, the ODE's common-token mass at increasing ratios, one series
    per matched training-loss level (``common_by_ratio``), and the full model's per-seed fall of
    the log common-token mass from the lowest to the highest ratio (``full_fall``: a
    :class:`Change` in nats, positive when the mass shrank; None when not measured)."""
    series = {p: [s for s in (_finite(x) for x in v) if len(s) >= 2] for p, v in common_by_ratio.items()}
    series = {p: v for p, v in series.items() if v}
    full = {p: c for p, c in full_fall.items() if c is not None and math.isfinite(c.mean)}
    if not series and not full:
        return Verdict("not tested", T5_RULE, "fewer than two ratios")
    call: dict[str, str] = {}
    for p in dict.fromkeys([*series, *full]):
        calls = []
        if p in series:
            calls.append("holds" if all(all(b < a for a, b in zip(s, s[1:])) for s in series[p]) else
                         "fails" if any(s[-1] >= s[0] for s in series[p]) else "undecided")
        if p in full:
            calls.append(interval_call(full[p], SHARPER_LOGIT))
        call[p] = "holds" if all(x == "holds" for x in calls) else "fails" if "fails" in calls else "undecided"
    holds = [p for p, x in call.items() if x == "holds"]
    v = ("reproduced" if len(holds) == len(call) else "holds where" if holds else
         "not reproduced" if all(x == "fails" for x in call.values()) else "inconclusive")
    region = f"for {', '.join(holds)}; not for {', '.join(p for p in call if p not in holds)}" if v == "holds where" else ""
    effect = "; ".join(f"{p} {c.text(percent=False)}" for p, c in full.items())
    n_ode = sum(call_ok for call_ok in (all(all(b < a for a, b in zip(s, s[1:])) for s in ss) for ss in series.values()))
    reason = (f"ODE common mass falls strictly with the ratio at every matched loss for {n_ode}/{len(series)}; "
              "full model, fall of the log common-token mass (nats): " + (effect or "not measured") + "; "
              + ", ".join(f"{p} {x}" for p, x in call.items()))
    return Verdict(v, T5_RULE, reason, region=region,
                   effect=f"fall of the log common-token mass, lowest to highest ratio: {effect}" if effect else "")


T6_RULE = ("a factorized QK circuit is sharper than a collapsed one (FACO vs CACO and FAFO vs CAFO) in a "
           "comparison when its margin is positive; reproduced: in every comparison made (ODE horizons and full-model "
           "runs); holds where: in some (the region names them); not reproduced: in none; not tested: no comparison")


def _named_finite(values: Sequence[float] | Mapping[str, float], prefix: str, start: int) -> dict[str, float]:
    """The finite values of a mapping, or of a sequence named ``<prefix> <i>`` from ``start``."""
    named = dict(values) if isinstance(values, Mapping) else {f"{prefix} {i + start}": x for i, x in enumerate(values)}
    return {k: float(x) for k, x in named.items() if x is not None and math.isfinite(float(x))}


def _where_counted(values: Mapping[str, float], holds: Callable[[float], bool], rule: str, why: str,
                   effect: str) -> Verdict:
    """Reproduced when every named value ``holds``, holds where some do (the region names them),
    not reproduced when none does."""
    ok = [k for k, x in values.items() if holds(x)]
    if len(ok) == len(values):
        return Verdict("reproduced", rule, why, effect=effect)
    if ok:
        return Verdict("holds where", rule, why, region=_region(ok, [k for k in values if k not in ok], "in "),
                       effect=effect)
    return Verdict("not reproduced", rule, why, effect=effect)


def t6_factorized_qk(margins: Sequence[float] | Mapping[str, float]) -> Verdict:
    """T6 from sharpness margins (factorized-QK attention minus collapsed-QK attention, or the
    collapsed one's common mass minus the factorized one's), one per comparison; a mapping names
    each comparison (its key) so that a region can say where it holds."""
    m = _named_finite(margins, "comparison", 1)
    if not m:
        return Verdict("not tested", T6_RULE, "no comparison")
    why = f"factorized QK sharper in {sum(x > 0 for x in m.values())}/{len(m)} comparisons"
    return _where_counted(m, lambda x: x > 0, T6_RULE, why, f"margins {min(m.values()):+.3g} to {max(m.values()):+.3g}")


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


S1_RULE = ("at each training-loss level of the matched-loss ladder, a pair of parameterizations differs when the 95 % "
           f"seed interval of its per-seed DTAP total-variation distance lies at or above {_t('DTAP_TV')}, is the "
           "same when it lies below, and is undecided otherwise; reproduced: no pair-level is the same and most "
           "pair-levels differ; holds where: some pair-levels differ and some are the same (the region names the "
           "pairs that are the same); not reproduced: every decided pair-level is the same; inconclusive: no "
           "pair-level decided, or as many undecided as differ; not tested: no level reached by two parameterizations")


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
    n = {x: flat.count(x) for x in ("differ", "same", "undecided")}
    parts = [f"loss {lv:g}: {sum(c == 'differ' for c in d.values())} of {len(d)} pairs differ, "
             f"{sum(c == 'same' for c in d.values())} the same" for lv, d in sorted(calls.items(), reverse=True)]
    tvs = [c.mean for pairs in levels.values() for c in pairs.values() if math.isfinite(c.mean)]
    effect = (f"{n['differ']} of {len(flat)} pair-levels differ, {n['undecided']} undecided; mean TV distance "
              f"{min(tvs):.2f}-{max(tvs):.2f}" if tvs else "")
    same = [f"{a}-{b} at loss {lv:g}" for lv, d in sorted(calls.items(), reverse=True) for (a, b), c in d.items()
            if c == "same"]
    if not same and n["differ"] > n["undecided"]:
        v = Verdict("reproduced", S1_RULE, "; ".join(parts), effect=effect)
    elif n["differ"] and same:
        v = Verdict("holds where", S1_RULE, "; ".join(parts), effect=effect,
                    region=f"{n['differ']} of {len(flat)} pair-levels differ; the same: {', '.join(same)}")
    elif same and not n["differ"]:
        v = Verdict("not reproduced", S1_RULE, "; ".join(parts), effect=effect)
    else:
        v = Verdict("inconclusive", S1_RULE, "; ".join(parts), effect=effect)
    return v


S2_ODE_TIE = _threshold("S2_ODE_TIE", 0.01, "nats", "largest gap in log-odds of the attention on the distinct token "
                                                    "between the second and the third parameterization that counts "
                                                    "as a tie in the reduced ODE (S2 phase map)")
S2_WORDS = {"A": "summary A's pair (CACO, FACO)", "B": "summary B's pair (CAFO, CACO)", "neither": "neither pair",
            "tie": "a tie", "not tested": "not tested"}
S2_SHORT = {"A": "(CACO, FACO)", "B": "(CAFO, CACO)", "neither": "neither pair", "tie": "a tie"}

S2_RULE = ("read over a map of eta_QK/eta_OV x init scale x number of common tokens x training loss. At each cell the "
           "top two are the two parameterizations with the most attention on the distinct token, unless the second "
           f"and third are equal: in the reduced ODE (every cell) within {_t('S2_ODE_TIE')} of log-odds, in the full "
           "model (a few cells, several seeds) when the 95 % seed interval of their per-seed attention difference "
           "holds 0 (a tie; fewer than two seeds: not tested). A decided full-model cell confirms a summary when its "
           "top two are that summary's pair. Reproduced: one summary's pair is the ODE's top two at every cell and "
           "every full-model cell confirms it; holds where: some full-model cell confirms a summary (the region is "
           "where the ODE has each summary's pair); not reproduced: no ODE cell has either pair and every full-model "
           "cell decides for neither; inconclusive: otherwise (ties, or an ODE region no full-model cell confirms; "
           "the reason says how many seeds would separate a tie); not tested: no ODE cell or no full-model cell with "
           "two seeds. Where a faster QK moves FAFO (toward FACO or CACO, step by step along the ratio axis) is "
           "reported with the verdict, not decided on")


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


def _seeds_to_separate(gap: Change) -> str:
    """About how many seeds would make ``gap``'s 95 % interval exclude 0, at its mean and spread."""
    if not gap.bounded or gap.mean == 0:
        return "no finite number of seeds at this mean"
    n = math.ceil(gap.n * (gap.half_width / abs(gap.mean)) ** 2) + 1
    return f"about {n} seeds"


def s2_phase(ode: Mapping[tuple, str], full: Mapping[tuple, tuple[str, Change]], axes: Sequence[str],
             fafo_moves: Mapping[str, int] | None = None) -> Verdict:
    """The book's S2 verdict from the phase map: ``ode`` maps each cell (a tuple of values named by
    ``axes``, e.g. ratio, init scale, n, training loss) to the reduced ODE's top two
    (:func:`s2_top_two`); ``full`` maps the full-model cells to (their top two, the per-seed
    attention gap between the second and the third as a :class:`Change`). ``fafo_moves`` counts
    where a faster QK moves FAFO along the ratio axis (:func:`s2_fafo_move` calls) for the reason."""
    if not ode:
        return Verdict("not tested", S2_RULE, "no cell of the map was integrated")
    decided = {c: (k, g) for c, (k, g) in full.items() if k != "not tested"}
    if not decided:
        return Verdict("not tested", S2_RULE, f"no full-model cell with two seeds ({len(full)} cells run)")
    everywhere = list(ode)
    by = {k: [c for c, v in ode.items() if v == k] for k in ("A", "B", "neither", "tie")}
    confirm = {k: [c for c, (v, _) in decided.items() if v == k] for k in S2_PAIRS}
    split = {c: v for c, (v, _) in decided.items() if v != "tie"}  # cells whose 2nd and 3rd separate
    agree = sum(ode.get(c) == v for c, v in split.items())
    fmt = lambda c: "(" + ", ".join(f"{a} {v:g}" if isinstance(v, (int, float)) else f"{a} {v}"  # noqa: E731
                                    for a, v in zip(axes, c)) + ")"
    reason = ("ODE: " + ", ".join(f"{S2_WORDS[k]} at {len(v)}" for k, v in by.items() if v) + f" of {len(ode)} cells; "
              "full model: " + "; ".join(f"{fmt(c)} {S2_WORDS[k]}" for c, (k, _) in full.items())
              + f"; the full model agrees with the ODE at {agree} of the {len(split)} cells where its 2nd and 3rd "
              "separate")
    if fafo_moves:
        reason += "; a faster QK moves FAFO " + ", ".join(f"toward {k} {n}×" if k in ("FACO", "CACO") else f"{k} {n}×"
                                                           for k, n in fafo_moves.items())
    sep = [g for k, g in decided.values() if k != "tie"]
    eff = sep or [g for _, g in decided.values()]
    lo, hi = min(eff, key=lambda g: g.mean), max(eff, key=lambda g: g.mean)
    txt = lambda g: (f"{g.mean:+.3g} ± {g.half_width:.2g} over {g.n} seeds" if g.bounded  # noqa: E731
                     else g.text(percent=False))  # three significant digits: saturated cells have tiny gaps
    effect = (f"attention gap between the 2nd and the 3rd at {len(eff)} full-model cell{'s' if len(eff) > 1 else ''}: "
              + (txt(lo) if lo is hi else f"{txt(lo)} to {txt(hi)}"))
    one = [k for k in S2_PAIRS if len(by[k]) == len(ode)]
    if one and len(decided) == len(full) and all(v == one[0] for v, _ in decided.values()):
        return Verdict("reproduced", S2_RULE, f"{S2_WORDS[one[0]]} at every cell; {reason}", effect=effect)
    if any(confirm.values()):
        deep = s2_settled(ode, axes)
        parts = [f"{S2_SHORT[k]} {s2_region(by[k], everywhere, axes)}"
                 + (f", at every cell from loss {deep[0]:g} down" if deep and deep[1] == k else "")
                 + (f", confirmed by the full model at {len(confirm[k])} cell{'s' if len(confirm[k]) > 1 else ''}"
                    if confirm[k] else ", in the ODE only") for k in S2_PAIRS if by[k] or confirm[k]]
        if by["neither"]:
            parts.append(f"neither pair {s2_region(by['neither'], everywhere, axes)}")
        return Verdict("holds where", S2_RULE, reason, region="; ".join(parts), effect=effect)
    ties = [(c, g) for c, (k, g) in decided.items() if k == "tie"]
    if not by["A"] and not by["B"] and not ties and len(decided) == len(full):
        return Verdict("not reproduced", S2_RULE, reason, effect=effect)
    need = "; ".join(f"{fmt(c)} would need {_seeds_to_separate(g)}" for c, g in ties)
    unconfirmed = [k for k in S2_PAIRS if by[k]]
    why = (f"; a tie at {len(ties)} full-model cell{'s' if len(ties) > 1 else ''}: {need}" if ties else "") + (
        "; no full-model cell confirms the ODE's region of " + " or ".join(S2_WORDS[k] for k in unconfirmed)
        if unconfirmed else "")
    return Verdict("inconclusive", S2_RULE, reason + why, effect=effect)


MatchedCells = Mapping[tuple[float, Any], Mapping[str, Sequence["Change | None"]]]
"""Paired changes at matched training loss: (loss level, ratio or parameterization) -> name ->
``(log-odds change, loss change, accuracy change)`` (:class:`Change` values; loss or accuracy None
when the rule does not read it)."""


def matched_call(d_log_odds: "Change", d_loss: "Change | None" = None, d_accuracy: "Change | None" = None) -> str:
    """One paired change at matched training loss: ``"holds"`` when the seed interval of the
    log-odds change lies at or above :data:`SHARPER_LOGIT` and those of the test-loss and
    accuracy changes (if given) inside ±:data:`SAME_LOSS` and ±:data:`SAME_ACC`; ``"fails"`` when
    the log-odds interval lies below the threshold or a loss or accuracy interval lies wholly
    outside its band; ``"undecided"`` otherwise (an interval straddles, or fewer than 2 seeds)."""
    rise = interval_call(d_log_odds, SHARPER_LOGIT)
    bands = [(c, tol) for c, tol in ((d_loss, SAME_LOSS), (d_accuracy, SAME_ACC)) if c is not None]
    if rise == "fails" or any(c.hi < -tol or c.lo > tol for c, tol in bands):
        return "fails"
    inside = all(c.bounded and -tol <= c.lo and c.hi <= tol for c, tol in bands)
    return "holds" if rise == "holds" and inside else "undecided"


def _cells_verdict(rule: str, cells: MatchedCells, what: str, effect_at: tuple[float, Any] | None,
                   notes: Mapping[Any, str] | None = None) -> Verdict:
    """A verdict over matched-loss cells: a cell holds when every one of its changes holds
    (:func:`matched_call`) and fails when one fails. Reproduced: every cell holds; holds where:
    some do (the region names them by ``what`` and loss level); not reproduced: every cell fails;
    inconclusive: otherwise; not tested: no cell. ``effect_at``: the cell whose log-odds changes
    are the effect (default: the deepest level's last key); ``notes``: words the region adds after
    a key (e.g. ``{100.0: "gradient descent unstable there"}``)."""
    cells = {k: {n: c for n, c in v.items() if c and c[0] is not None and math.isfinite(c[0].mean)}
             for k, v in cells.items()}
    cells = {k: v for k, v in cells.items() if v}
    if not cells:
        return Verdict("not tested", rule, "no cell with runs at matched loss on both sides")
    status = {}
    for k, v in cells.items():
        calls = [matched_call(*c) for c in v.values()]
        status[k] = "holds" if all(x == "holds" for x in calls) else "fails" if "fails" in calls else "undecided"
    n = {x: sum(s == x for s in status.values()) for x in ("holds", "fails", "undecided")}
    v = ("reproduced" if n["holds"] == len(status) else "holds where" if n["holds"] else
         "not reproduced" if n["fails"] == len(status) else "inconclusive")
    keys = list(dict.fromkeys(k for _, k in status))

    def where(ok: bool) -> list[str]:
        out = []
        for key in keys:
            lv = sorted((lv for (lv, k), s in status.items() if k == key and (s == "holds") == ok), reverse=True)
            if lv:
                name = f"{key:g}" if isinstance(key, float) else str(key)
                note = f" ({notes[key]})" if notes and key in notes else ""
                out.append(f"{what}{name} at loss {', '.join(f'{x:g}' for x in lv)}{note}")
        return out

    region = ("for " + "; ".join(where(True)) + "; not for " + "; ".join(where(False))) if v == "holds where" else ""
    at = effect_at if effect_at in cells else min(cells, key=lambda k: (k[0], -keys.index(k[1])))
    key = f"{at[1]:g}" if isinstance(at[1], float) else str(at[1])
    effect = (f"log-odds of attention on the distinct token at loss {at[0]:g}, {what}{key}: "
              + "; ".join(f"{name} {c[0].text(percent=False)}" for name, c in cells[at].items()))
    reason = "; ".join(f"loss {lv:g}, {what}{(f'{k:g}' if isinstance(k, float) else k)}: {s}"
                       for (lv, k), s in sorted(status.items(), key=lambda kv: (-kv[0][0], keys.index(kv[0][1]))))
    return Verdict(v, rule, reason, region=region, effect=effect)


S3_RULE = ("decided at matched training loss, on every level of the matched-loss ladder, against the lowest ratio, "
           "paired by seed. A cell (a loss level and a higher ratio) holds when, for every parameterization, the 95 % "
           "seed interval of the change of the log-odds of the attention on the distinct token, log(a / (1 - a)), "
           f"lies at or above {_t('SHARPER_LOGIT')}, and those of the test-loss and accuracy changes lie inside "
           f"±{_t('SAME_LOSS')} and ±{_t('SAME_ACC')}; it fails when one of these intervals lies wholly on the wrong "
           "side. Reproduced: every cell holds. Holds where: some cells hold (named by ratio and loss). Not "
           "reproduced: every cell fails. Inconclusive: otherwise (intervals straddle, or one seed). Not tested: no "
           "higher ratio reached a loss level")


def s3_ratio_sharpens(cells: MatchedCells, ratio_lo: float | None = None,
                      effect_at: tuple[float, float] | None = None, unstable: Sequence[float] = ()) -> Verdict:
    """S3 from the paired changes at matched training loss: ``cells`` maps (loss level, ratio) to,
    per parameterization, (log-odds change, test-loss change, accuracy change) from the lowest
    ratio (``ratio_lo``, named in the texts) to that ratio (:class:`Change` values over the seeds
    that reached the level at both). ``unstable``: ratios at which gradient descent was past its
    stable range (the region says so; the rule reads them all the same)."""
    return _cells_verdict(S3_RULE, cells, "ratio " if ratio_lo is None else f"ratio {ratio_lo:g} -> ", effect_at,
                          {float(r): "gradient descent unstable there" for r in unstable})


S3_ROBUST_RULE = ("S3's rule applied to each robustness variant at its matched training loss; reproduced: every "
                  "variant reproduces S3; holds where: some variants reproduce it or hold somewhere (named); not "
                  "reproduced: every tested variant is 'not reproduced'; inconclusive: otherwise; not tested: no "
                  "variant could be tested (a minibatch variant has no full-batch loss to match and is not tested)")


def s3_robustness(per_variant: Mapping[str, Verdict]) -> Verdict:
    """The S3-robustness extension from the :func:`s3_ratio_sharpens` verdict of each variant."""
    tested = {k: v for k, v in per_variant.items() if v.verdict != "not tested"}
    if not tested:
        return Verdict("not tested", S3_ROBUST_RULE, "no variant could be tested")
    full = [k for k, v in tested.items() if v.verdict == "reproduced"]
    some = [k for k, v in tested.items() if v.verdict == "holds where"]
    v = ("reproduced" if len(full) == len(per_variant) else "holds where" if full or some else
         "not reproduced" if all(x.verdict == "not reproduced" for x in tested.values()) else "inconclusive")
    others = [f"{k} ({x.verdict})" for k, x in per_variant.items() if k not in full and k not in some]
    region = ("in " + ", ".join(full + [f"{k} ({tested[k].region})" for k in some]) + "; not in " + ", ".join(others)
              if v == "holds where" else "")
    counts = ", ".join(f"{x} {sum(y.verdict == x for y in per_variant.values())}" for x in VERDICTS
                       if any(y.verdict == x for y in per_variant.values()))
    return Verdict(v, S3_ROBUST_RULE, f"of {len(per_variant)} variants: {counts}", region=region,
                   effect="; ".join(f"{k}: {x.effect}" for k, x in tested.items() if x.effect))


R3_SYNTHETIC_RULE = ("decided at matched training loss, on every level of the matched-loss ladder, from the lowest to "
                     "the highest ratio, paired by seed. A cell (a loss level and a parameterization) holds when the "
                     "95 % seed interval of the change of the log-odds of the attention on the distinct token lies "
                     f"at or above {_t('SHARPER_LOGIT')} while that of the test-accuracy change lies inside "
                     f"±{_t('SAME_ACC')}: the same loss, sharper attention, the same accuracy. It fails when either "
                     "interval lies wholly on the wrong side. Reproduced: every cell holds. Holds where: some cells "
                     "hold (named by parameterization and loss). Not reproduced: every cell fails. Inconclusive: "
                     "otherwise. Not tested: no parameterization reached a loss level at both ratios")


def r3_synthetic(cells: Mapping[tuple[float, str], Sequence["Change | None"]],
                 effect_level: float | None = None) -> Verdict:
    """R3-synthetic from the paired changes at matched training loss from the lowest to the highest
    ratio: ``cells`` maps (loss level, parameterization) to (log-odds change, accuracy change)."""
    wrapped = {k: {k[1]: (c[0], None, c[1])} for k, c in cells.items()}
    v = _cells_verdict(R3_SYNTHETIC_RULE, wrapped, "", None)
    lv = effect_level if effect_level is not None else min((k[0] for k in wrapped), default=None)
    at = {k[1]: c for k, c in cells.items() if k[0] == lv and c and c[0] is not None and math.isfinite(c[0].mean)}
    effect = (f"log-odds change at loss {lv:g}: " + "; ".join(f"{p} {c[0].text(percent=False)}" for p, c in at.items())
              if at else "")
    return Verdict(v.verdict, v.rule, v.reason, region=v.region, effect=effect)


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
            "everywhere).")


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
    decided with, and ``seeds`` (:func:`seeds_to_decide`; None when unknown)."""

    cell: str
    change: "Change | None"
    outcome: str
    hw: float
    seeds: int | None

    def text(self, digits: int = 3) -> str:
        """``+0.154 ± 0.030 (n = 8)``: the change with its family interval."""
        c = self.change
        if c is None or not math.isfinite(c.mean):
            return "not measured"
        ci = f" ± {self.hw:.{digits}f}" if math.isfinite(self.hw) else ", no interval"
        return f"{c.mean:+.{digits}f}{ci} (n = {c.n})"


def read_cells(changes: Mapping[str, "Change | None"], est: "Estimand | Mapping[str, Estimand]") -> list[Reading]:
    """Every cell of a claim read by the one rule: ``changes`` maps each cell's name to its change
    (None: not measured, which is undecided and counts as a cell of the family); ``est`` is the
    claim's estimand, or one per cell where the cells read different quantities."""
    m = max(len(changes), 1)
    of = (lambda k: est[k]) if isinstance(est, Mapping) else (lambda k: est)  # noqa: E731
    return [Reading(k, c, outcome(c, of(k), m), family_half_width(c, m) if c is not None else math.nan,
                    seeds_to_decide(c, of(k), m)) for k, c in changes.items()]


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
    """What the undecided cells would take: ``about 12 seeds (AdamW ... ); no finite number (...)``."""
    open_ = [r for r in readings if r.outcome == "undecided"]
    known = sorted((r for r in open_ if r.seeds is not None), key=lambda r: r.seeds)
    parts = [f"{r.seeds} seeds would decide {r.cell}" for r in known]
    parts += [f"no number of seeds up to {MAX_SEEDS} would decide {r.cell}" for r in open_ if r.seeds is None]
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
    effect = "; ".join(f"{r.cell}: {r.text()}" for r in readings)
    reason = f"{len(readings)} cells: " + ", ".join(f"{len(named[o])} {o}" for o in OUTCOMES if named[o])
    seeds = seeds_text(readings)
    return Verdict(w, rule, reason + (f"; {seeds}" if seeds else ""), region=region, effect=effect)


# Each claim's estimand: the change it reads, its direction and its margin (the thresholds above).
ESTIMANDS: dict[str, Estimand] = {
    "T1": Estimand("largest gap between the reduced loss and gradients and autograd's", -1, TOL_GRAD),
    "T2": Estimand("largest relative gap between the ODE with rate 2·eta·|w| and factor-level autograd", -1,
                   TOL_VELOCITY),
    "T3": Estimand("gap between a fitted growth exponent in log t and the derived one", -1, SLOPE_TOL),
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


RULE_TEXT = {"T1": T1_RULE, "T2": T2_RULE, "T3": T3_RULE, "T4": T4_RULE, "T5": T5_RULE, "T6": T6_RULE,
             "S1": S1_RULE, "S2": S2_RULE, "S3": S3_RULE, "R1": ESTIMANDS["R1"].text(),
             "R2": ESTIMANDS["R2"].text(), "R3": ESTIMANDS["R3"].text()}
RULES = {"T1": t1_reduction, "T2": t2_rescaling, "T3": t3_growth, "T4": t4_line, "T5": t5_sharpening,
         "T6": t6_factorized_qk, "S1": s1_ladder, "S2": s2_phase, "S3": s3_ratio_sharpens}


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
_CELL = re.compile(rf"^(?P<cell>.+?): (?:(?P<mean>{_NUM})(?: ± (?P<hw>{_NUM})|, no interval) \(n = \d+\)|not measured)$")


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
    sign, margin = (1 if side.group(1) == "≥" else -1), float(side.group(2))
    slack = 1e-3  # the effect prints 3 decimals: half a unit of the last place each way, and some
    outs = []
    for m in cells:
        if m.group("mean") is None or m.group("hw") is None:
            outs.append("undecided")
            continue
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
            x, hw = float(cells[i].group("mean")), float(cells[i].group("hw"))
            near_lo = abs(sign * (x - hw - margin)) <= slack if sign > 0 else abs(-(x + hw - margin)) <= slack
            near_hi = abs(sign * (x + hw - margin)) <= slack if sign > 0 else abs(-(x - hw - margin)) <= slack
            if pick >> j & 1:
                trial[i] = "holds" if near_lo else "contradicted" if near_hi else trial[i]
        if word(trial) == verdict:
            return None
    return (f"printed '{verdict}', but the intervals printed with it ({'; '.join(parts)}) read as '{loose}' against "
            f"{side.group(0).removeprefix('the claim' + chr(39) + 's side: ')}")
