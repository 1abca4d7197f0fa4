"""docs/results/server-*.json from bench/sglang_server.py's outputs: one current record of the server question, its
rows in issue 52's schema (graphcap.bench.server_cases), each harness run named and replaced as a whole.

    python3 bench/server_record.py --record docs/results/server-h100.json --run c=LOGS/server.json \\
        --pair c=user-scale-w8a8 --gpu-check c="SERVER_PAIR=... scripts/gpu-check.sh server"

A run's commit and GPU come from the environment file gpu-check wrote beside its server.json (env-server.txt).
Rows of runs not named stay as they are; the record's other keys (what, launch, client, notes) too. A row leaves out
what its run did not measure.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from graphcap.atomic import write_atomic
from graphcap.bench.options import OneLineParser
from graphcap.bench.server_cases import case_rows, server_facts


def layout(v, indent: int = 0, row: bool = False) -> str:
    """JSON with each container that holds no dict and no list of containers on one line (a run's list), and each
    list item whose containers hold only scalars too (a case, its small tables inside), the rest one key a line: a
    record that reads and diffs by row."""
    def nested(x) -> bool:
        return isinstance(x, dict) or isinstance(x, list) and any(isinstance(y, (dict, list)) for y in x)

    def values(x):
        return x.values() if isinstance(x, dict) else x
    if not isinstance(v, (dict, list)) or not any(nested(x) for x in values(v)) or row and not any(
            isinstance(x, (dict, list)) and any(nested(y) for y in values(x)) for x in values(v)):
        return json.dumps(v)
    pad = " " * (indent + 1)
    items = ([f"{pad}{json.dumps(k)}: {layout(x, indent + 1)}" for k, x in v.items()] if isinstance(v, dict)
             else [pad + layout(x, indent + 1, row=True) for x in v])
    o, c = "{}" if isinstance(v, dict) else "[]"
    return o + "\n" + ",\n".join(items) + "\n" + " " * indent + c


def named(values: list[str], flag: str) -> dict[str, str]:
    out = {}
    for v in values:
        name, sep, rest = v.partition("=")
        if not sep or not name or not rest:
            raise ValueError(f"{flag} wants NAME=VALUE, got {v!r}")
        out[name] = rest
    return out


def read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except ValueError as e:  # the file named: json's message says only where in it
        raise ValueError(f"{path}: not JSON ({e})") from None


def run_facts(server_json: Path) -> dict:
    env = server_json.parent / "env-server.txt"
    facts: dict = {}
    if env.exists():
        text = env.read_text()
        try:
            e = json.loads(text[:text.index("\n}") + 2])
            facts = {"commit": e.get("commit"), "gpu": e.get("device")}  # versions: the record's machine
        except ValueError:
            pass
    return facts


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--record", type=Path, required=True)
    ap.add_argument("--run", action="append", default=[], metavar="NAME=SERVER_JSON")
    ap.add_argument("--pair", action="append", default=[], metavar="NAME=PAIR")
    ap.add_argument("--gpu-check", action="append", default=[], metavar="NAME=COMMAND")
    a = ap.parse_args(argv)
    try:
        runs, pairs, checks = named(a.run, "--run"), named(a.pair, "--pair"), named(a.gpu_check, "--gpu-check")
        missing = [n for n in runs if n not in pairs]
        if missing:
            raise ValueError(f"--pair missing for run {', '.join(missing)}")
        outputs = {n: read_json(Path(p)) for n, p in runs.items()}
        for n, out in outputs.items():
            if not isinstance(out, dict) or not isinstance(out.get("servers"), dict):
                raise ValueError(f"run {n}: {runs[n]} is no bench/sglang_server.py output (no \"servers\")")
        record = read_json(a.record) if a.record.exists() else {}
        if not isinstance(record, dict):
            raise ValueError(f"{a.record}: not a JSON object")
    except (OSError, ValueError) as e:
        print(f"server_record: {e}", file=sys.stderr)
        return 2
    kept = [r for r in record.get("cases", []) if r.get("run") not in runs]
    described = dict(record.get("runs", {}))
    for n, out in outputs.items():
        described[n] = {**described.get(n, {}), **run_facts(Path(runs[n])), "pair": pairs[n],
                        "order": [k for k, v in out["servers"].items() if "command" in v],
                        **({"gpu_check": checks[n]} if n in checks else {}),
                        "servers": {label: {**described.get(n, {}).get("servers", {}).get(label, {}),
                                            **server_facts(sv)}
                                    for label, sv in out["servers"].items() if "command" in sv}}
    rows = sorted(kept + [r for n, out in outputs.items() for r in case_rows(out, run=n, pair=pairs[n])],
                  key=lambda r: str(r.get("run")))  # stable: each run's rows in the harness's order
    record.update(runs=dict(sorted(described.items())), cases=rows)  # the other keys as they were
    write_atomic(a.record, (layout(record) + "\n").encode(), 0o644)  # never a half record
    print(f"{a.record}: {len(rows)} cases ({len(rows) - len(kept)} from {', '.join(outputs)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
