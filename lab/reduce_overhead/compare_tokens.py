"""Two engine_case.py summaries compared: did both finish, are their greedy tokens equal (else the first request and
position that differ), and did the first one do CUDA-graph tree work after start-up (its probe's late-tree-work
events, its log's sealed-tree errors). Writes the verdict as JSON; exit 0 either way (the verdict is the result).

Usage: python lab/reduce_overhead/compare_tokens.py CASE.json REFERENCE.json --out VERDICT.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def first_difference(a: list[list[int]], b: list[list[int]]) -> dict | None:
    """The first (request, position) where two token lists differ, with both tokens; None where they are equal."""
    if len(a) != len(b):
        return {"request": None, "why": f"{len(a)} outputs against {len(b)}"}
    for i, (x, y) in enumerate(zip(a, b)):
        for j, (s, t) in enumerate(zip(x, y)):
            if s != t:
                return {"request": i, "position": j, "case": s, "reference": t}
        if len(x) != len(y):
            return {"request": i, "position": min(len(x), len(y)), "why": f"{len(x)} tokens against {len(y)}"}
    return None


def compare(case: dict, ref: dict) -> dict:
    both = bool(case.get("finished")) and bool(ref.get("finished"))
    diff = first_difference(case.get("tokens") or [], ref.get("tokens") or []) if both else None
    late = [e for e in (case.get("probe", {}).get("last_events") or []) if e.get("event") == "late-tree-work"]
    sealed_error = "LateTreeWork" in (case.get("log_tail") or "")
    return {"what": "reduce-overhead with sglang's target graphs captured again after graphcap's trees, against "
                    "stock sglang's draft on the same requests",
            "case_finished": bool(case.get("finished")), "reference_finished": bool(ref.get("finished")),
            "case_cuda_errors": case.get("cuda_errors", []), "requests": len(case.get("tokens") or []),
            "tokens": sum(len(t) for t in case.get("tokens") or []),
            "equal": both and diff is None, "first_difference": diff,
            "late_tree_work": bool(late) or sealed_error, "draft_calls": case.get("probe", {}).get("draft_calls"),
            "manifests": case.get("manifests"), "tree_log": case.get("tree_log")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("case")
    ap.add_argument("reference")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    try:
        case, ref = (json.loads(Path(p).read_text()) for p in (a.case, a.reference))
    except (OSError, ValueError) as e:
        print(f"compare_tokens: cannot read a summary: {e}", file=sys.stderr)
        return 2
    res = compare(case, ref)
    Path(a.out).write_text(json.dumps(res, indent=1))
    print(f"finished {res['case_finished']}/{res['reference_finished']}, tokens equal: {res['equal']} "
          f"({res['requests']} requests, {res['tokens']} tokens; first difference {res['first_difference']}), "
          f"late tree work: {res['late_tree_work']}, draft calls {res['draft_calls']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
