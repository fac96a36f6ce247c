"""The paper's claims, in the project's own words, and the rules that turn numbers into verdicts."""

from __future__ import annotations

VERDICTS = ("reproduced", "partly", "not reproduced", "not tested")


def claim(claim_id: str, paper: str, ours: str, verdict: str, chapter: str | None = None) -> dict[str, str]:
    """One row of the reproducibility scorecard: a claim ID (T1..T6, S1..S3, R1..R3 or an
    extension), what the paper says, what we measured (numbers included) and a verdict."""
    if verdict not in VERDICTS:
        raise ValueError(f"verdict must be one of {VERDICTS}, got {verdict!r}")
    return {"id": claim_id, "paper": paper, "ours": ours, "verdict": verdict, "chapter": chapter or ""}
