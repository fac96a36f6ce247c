"""The verdict words of two results folders side by side (two commits, or two seed sets of one commit).

    python benchmarks/compare_words.py A_DIR B_DIR [--labels "6c143fe" "main"] [--effects]

Reads every results file of each folder that reports claims (``metrics["claims"]``) and prints one
markdown row per (chapter, claim): the word in A, the word in B, whether they agree, and, for B, where
the claim holds and is contradicted and which undecided cells how many seeds would decide (the
``region`` and ``reason`` fields the chapter wrote). ``--effects`` adds both effect strings.
Nothing is recomputed: the words are the ones the chapters printed.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def words(folder: Path) -> dict[tuple[str, str], dict]:
    """``{(chapter, claim id): claim row}`` of every results file in ``folder`` (a chapter's second row of
    one claim, e.g. SVA's natural-prefix R1, as ``R1 #2``)."""
    out: dict[tuple[str, str], dict] = {}
    for f in sorted(folder.glob("*.json")):
        try:
            doc = json.loads(f.read_text(encoding="utf-8"))
        except ValueError:
            continue
        for c in (doc.get("metrics") or {}).get("claims") or []:
            chapter, cid = doc.get("chapter", f.stem), c["id"]
            k = 1
            while (chapter, cid if k == 1 else f"{c['id']} #{k}") in out:
                k += 1
            out[(chapter, cid if k == 1 else f"{c['id']} #{k}")] = c
    return out


def cut(text: str, n: int = 400) -> str:
    text = " ".join(str(text or "").split()).replace("|", "/")
    return text if len(text) <= n else text[: n - 1] + "…"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a", type=Path)
    ap.add_argument("b", type=Path)
    ap.add_argument("--labels", nargs=2, default=("A", "B"))
    ap.add_argument("--effects", action="store_true")
    args = ap.parse_args()
    a, b = words(args.a), words(args.b)
    la, lb = args.labels
    head = ["chapter", "claim", la, lb, "same", f"{lb}: where / seeds to decide"]
    if args.effects:
        head += [f"{la}: effect", f"{lb}: effect"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    same = 0
    for key in sorted(set(a) | set(b), key=lambda k: (k[0], k[1])):
        ra, rb = a.get(key, {}), b.get(key, {})
        wa, wb = ra.get("verdict", "—"), rb.get("verdict", "—")
        same += wa == wb
        where = "; ".join(x for x in (cut(rb.get("region"), 300), cut(rb.get("reason"), 300)) if x)
        row = [key[0], key[1], wa, wb, "yes" if wa == wb else "**no**", where]
        if args.effects:
            row += [cut(ra.get("effect")), cut(rb.get("effect"))]
        print("| " + " | ".join(row) + " |")
    print(f"\n{same} of {len(set(a) | set(b))} words the same.")


if __name__ == "__main__":
    main()
