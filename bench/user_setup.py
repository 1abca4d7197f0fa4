"""Issue 42's record (docs/results/user-setup-h200.json) from the partial records of `scripts/gpu-check.sh
user-setup`: the user's setup - sglang 0.5.18 and 0.5.23, 1, 2 and 3 draft steps, graphcap's kernels on the device's
own paths (sm90 on the H200) and on an A100's (sm80) - checked and timed in sglang's own engine.

The stage runs `bench/sglang_engine.py --check --time-batch B --kernel-paths native,sm80` once per (sglang version,
steps); each run writes a partial record: stock sglang's engine once, graphcap's once per kernel paths, each with
what its own process ran (sglang version, kernel paths) or what broke. The matrix may be split over several device
calls (the stage's USER_SETUP_* knobs): this script merges any number of partial records into one:

    {"what", "commit", "machine", "cases": [{"sglang", "steps", "kernel_paths", "backend", "requests",
     "tokens_equal", "drafts_compared", "drafts_equal", "crashes", "fallbacks", "draft_ms_sglang",
     "draft_ms_graphcap", "error"}], "missing" (only where a matrix cell has no case), "not_lowered_for_sm80"
     (only where an sm80 engine ran but Triton's cache holds no kernel compiled for capability 80)}

One case per graphcap engine, its counts summed over the check's batches. tokens_equal / drafts_equal: requests whose
output tokens, and (request, k-th draft call) pairs whose draft tokens, equal stock sglang's (null where there was
nothing to compare: an engine failed or did not run); crashes: 1 if graphcap's engine failed, 0 if it ran, null if it
did not run; error: null, or per engine that failed or did not run (graphcap, sglang: stock) the phase (start, run,
not run), the line that says what broke and the log's last lines. A cell run twice (two partial records) is an error,
unless one of the two failed or did not run (the later of two such
runs is kept). Partial records of different commits are refused.

Usage: python bench/user_setup.py --out docs/results/user-setup-h200.json PARTIAL.json... [--commit C]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

SGLANG = ("0.5.23", "0.5.18")  # issue 42's matrix, in the record's order
STEPS = (1, 2, 3)
KERNEL_PATHS = ("sm90", "sm80")
CASE_KEYS = ("sglang", "steps", "kernel_paths", "backend", "requests", "tokens_equal", "drafts_compared",
             "drafts_equal", "crashes", "fallbacks", "draft_ms_sglang", "draft_ms_graphcap", "error")
SAME_MACHINE = ("gpu", "torch", "triton")  # partial records that disagree on these were not one machine's
TAIL_LINES = 12


class CombineError(ValueError):
    """Partial records that cannot make one record; names the files and what is wrong."""


def engine_error(info: dict) -> dict | None:
    """What broke in one engine (None if it ran): the phase, the line naming the error, the log's last lines."""
    if info.get("not_run"):
        return {"phase": "not run", "message": info["not_run"]}
    if not info.get("crashed"):
        return None
    tail = [ln for ln in (info.get("log_tail") or "").splitlines() if ln.strip()][-TAIL_LINES:]
    return {"phase": "run" if info.get("started") else "start",
            "message": info.get("error") or "no exception line in the engine's log (see log_tail)",
            "log_tail": "\n".join(tail)}


def kernel_paths_label(info: dict, machine: dict) -> str:
    """sm90 / sm80 as graphcap.kernels.arch named the GPU in the engine's process; for an engine that failed before
    saying, the forced paths it was asked for, or the device's own from its compute capability."""
    if info.get("kernel_paths"):
        return info["kernel_paths"]
    asked = info.get("kernel_paths_asked") or "native"
    if asked != "native":
        return asked
    cc = machine.get("compute_capability")
    return f"sm{cc.replace('.', '')}" if cc else "native"


def _ran(info: dict) -> bool:
    return not info.get("crashed") and not info.get("not_run")


def cases_of(partial: dict, source: str) -> list[dict]:
    """One case per graphcap engine of a partial record (a bench/sglang_engine.py --check output)."""
    chk = partial.get("check")
    if not chk or "stock" not in chk:
        raise CombineError(f"{source}: not a partial record of the user-setup stage (no check part with the stock "
                           "engine's entry; bench/sglang_engine.py --check writes one)")
    stock, machine = chk["stock"], partial.get("machine") or {}
    asked_version = partial.get("expect_sglang") or partial.get("sglang")
    out = []
    for key, info in chk["engines"].items():
        rows = [c for c in chk["cases"] if c.get("engine", c["backend"]) == key]
        compared = _ran(stock) and not info.get("not_run") and bool(rows)
        errors = {who: e for who, e in (("graphcap", engine_error(info)), ("sglang", engine_error(stock))) if e}

        def total(k: str) -> int | None:
            return sum(r[k] for r in rows) if compared else None

        out.append({
            "sglang": info.get("sglang") or stock.get("sglang") or asked_version,
            "steps": info.get("steps") or partial["steps"], "kernel_paths": kernel_paths_label(info, machine),
            "backend": info["backend"], "requests": chk["requests"],
            "tokens_equal": total("tokens_equal"), "drafts_compared": total("drafts_compared"),
            "drafts_equal": total("drafts_equal"),
            "crashes": None if info.get("not_run") else int(bool(info.get("crashed"))),
            "fallbacks": (info.get("manifest") or {}).get("fallbacks"),
            "draft_ms_sglang": stock.get("draft_ms"), "draft_ms_graphcap": info.get("draft_ms"),
            "error": errors or None, "_source": source,
            "_rank": 2 if _ran(info) else 0 if info.get("not_run") else 1})  # ran > failed > not run
    return out


def _cell(case: dict) -> tuple:
    return case["sglang"], case["steps"], case["kernel_paths"], case["backend"]


def _order(case: dict) -> tuple:
    def rank(value, known):
        return (known.index(value), "") if value in known else (len(known), str(value))

    return (rank(case["sglang"], SGLANG), case["steps"], rank(case["kernel_paths"], KERNEL_PATHS), case["backend"])


def merge_machine(partials: list[tuple[str, dict]], versions: list[str]) -> dict:
    """The machine all partial records ran on (driver or Python may differ between two calls: then both are listed);
    the sglang versions that ran."""
    out: dict = {}
    for key in ("gpu", "driver", "compute_capability", "python", "torch", "triton"):
        seen = {}
        for source, p in partials:
            v = (p.get("machine") or {}).get(key)
            if v is not None:
                seen.setdefault(v, source)
        if len(seen) > 1 and key in SAME_MACHINE:
            raise CombineError(f"partial records of different machines ({key}: "
                               + ", ".join(f"{v} in {s}" for v, s in seen.items()) + ")")
        out[key] = next(iter(seen)) if len(seen) == 1 else (sorted(seen) or None)
    out["sglang"] = sorted(set(versions), key=lambda v: (SGLANG.index(v) if v in SGLANG else len(SGLANG), v))
    return out


def describe(partials: list[tuple[str, dict]]) -> str:
    p = partials[0][1]
    chk = p["check"]
    timed = (f"draft_ms: the median GPU time of the worker's draft call (CUDA events around it) over the last three "
             f"quarters of the full-batch calls of one timed run, {p.get('time_batch')} requests of "
             f"{p.get('context')}-token prompts and {p.get('new')} new tokens each, after the checks in the same "
             "engine (graphcap's per-draft length check, a sync, is off in these engines)" if p.get("time_batch")
             else "draft_ms: not timed (the engines ran graphcap's per-draft length check, a sync)")
    return (
        "Issue 42's matrix in sglang's own engine on the H200 (scripts/gpu-check.sh user-setup: bench/sglang_engine.py "
        "--check --time-batch per sglang version and draft steps, merged by bench/user_setup.py): sglang 0.5.23 and "
        "0.5.18 (each its own packages: 0.5.18 from a --target directory in front of PYTHONPATH, with transformers "
        "5.12.1 and a flashinfer stand-in), speculative_num_steps 1, 2, 3 with num_draft_tokens steps + 1, NEXTN "
        "(sglang resolves FROZEN_KV_MTP), topk 1, --attention-backend triton, page size 64, decode CUDA graphs for "
        "batches 1-64, --max-running-requests 64, radix cache and prefill graphs off, on the tiny structured Gemma 4 "
        "pair (bench/sglang_checkpoint.py --size tiny). Stock sglang's engine once per (version, steps); graphcap's "
        "(--enable-draft-graph-capture, backend cudagraph) once per kernel paths: sm90 the H200's own, sm80 an A100's "
        "(GRAPHCAP_KERNEL_PATHS=sm80 and TRITON_OVERRIDE_ARCH=sm80 in that engine's processes: planners plan for an "
        "A100's shared memory and 108 SMs, every Triton kernel lowers for capability 80 - mma.sync, no wgmma - while "
        "ptxas still assembles the H200's SASS; kernel_paths is what graphcap.kernels.arch named the GPU in the "
        "engine's process). The H200 cannot show an A100's speed: its memory bandwidth, cache sizes and clocks are "
        "the H200's, so sm80's draft_ms says only that the A100 paths run and what they cost here. Check: batches "
        f"{', '.join(map(str, chk.get('check_batches') or []))} ({chk['requests']} requests, prompts both sides of "
        "the 1024-token window, mixed max_new_tokens; the 96-request batch over --max-running-requests queues); "
        "tokens and drafts compared with stock sglang of the same version and steps, summed over the batches. "
        f"{timed}; draft_ms_sglang is stock sglang's (the device's own paths) for both kernel paths. sgl_kernel is "
        "graphcap's stand-in (tests/support) in every engine.")


def combine(partials: list[tuple[str, dict]], commit: str | None = None) -> dict:
    if not partials:
        raise CombineError("no partial records given")
    commits = {}
    for source, p in partials:
        if p.get("commit"):
            commits.setdefault(p["commit"], source)
    if commit is None:
        if len(commits) > 1:
            raise CombineError("partial records of different commits: "
                               + ", ".join(f"{c} ({s})" for c, s in commits.items()))
        if not commits:
            raise CombineError("no partial record names its commit (scripts/gpu-lib.sh takes it from .gpu-commit): "
                               "give --commit")
        commit = next(iter(commits))
    cells: dict[tuple, dict] = {}
    for source, p in partials:
        for case in cases_of(p, source):
            have = cells.get(_cell(case))
            if have is not None and have["_rank"] == case["_rank"] == 2:
                raise CombineError(f"sglang {case['sglang']}, steps {case['steps']}, kernel paths "
                                   f"{case['kernel_paths']}, {case['backend']}: in {have['_source']} and {source}; "
                                   "give one of them")
            if have is None or case["_rank"] >= have["_rank"]:  # a rerun replaces a failure or a cell not run
                cells[_cell(case)] = case
    cases = [{k: c[k] for k in CASE_KEYS} for c in sorted(cells.values(), key=_order)]
    backends = sorted({c["backend"] for c in cases})
    missing = [f"sglang {v}, steps {s}, kernel paths {kp}, {be}" for v in SGLANG for s in STEPS
               for kp in KERNEL_PATHS for be in backends if (v, s, kp, be) not in cells]
    unlowered = [f"{source}: {key}" for source, p in partials for key, info in p["check"]["engines"].items()
                 if info.get("triton_kernels_for_paths") == 0 and _ran(info)]
    if unlowered:  # the paths' planners ran, but Triton did not lower for 80: say so beside the cases
        print("user_setup: no Triton kernel compiled for the forced capability in " + ", ".join(unlowered)
              + " (does this Triton read TRITON_OVERRIDE_ARCH?)", file=sys.stderr)
    record = {"what": describe(partials), "commit": commit,
              "machine": merge_machine(partials, [c["sglang"] for c in cases if c["crashes"] is not None]),
              "cases": cases}
    if missing:
        record["missing"] = missing
    if unlowered:
        record["not_lowered_for_sm80"] = unlowered
    return record


def table(record: dict) -> str:
    lines = ["sglang  steps paths backend    tokens    drafts       crash fb  draft ms sglang/graphcap  error"]
    for c in record["cases"]:
        def ratio(k):
            return "-" if c[k] is None else f"{c[k]}/{c['requests' if k == 'tokens_equal' else 'drafts_compared']}"

        def ms(v):
            return "-" if v is None else f"{v:.3f}"

        err = "; ".join(f"{who}: {e['phase']}: {e['message']}" for who, e in (c["error"] or {}).items())
        lines.append(f"{c['sglang']:<7} {c['steps']:<5} {c['kernel_paths']:<5} {c['backend']:<10} "
                     f"{ratio('tokens_equal'):<9} {ratio('drafts_equal'):<12} {c['crashes']!s:<5} "
                     f"{c['fallbacks']!s:<3} {ms(c['draft_ms_sglang']):>8} / {ms(c['draft_ms_graphcap']):<8}  {err}")
    lines += [f"missing: {m}" for m in record.get("missing", [])]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("partials", nargs="+", help="partial records (bench/sglang_engine.py --check outputs)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--commit", default=None, help="the commit, where the partial records do not name it")
    a = ap.parse_args(argv)
    partials = []
    for path in a.partials:
        try:
            partials.append((path, json.loads(Path(path).read_text())))
        except (OSError, json.JSONDecodeError) as e:
            ap.error(f"{path}: {e}")
    try:
        record = combine(partials, a.commit)
    except CombineError as e:
        print(f"user_setup: {e}", file=sys.stderr)
        return 2
    Path(a.out).write_text(json.dumps(record, indent=1) + "\n")
    print(table(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
