"""The user-scale harness's engines, each in a child process (bench/sglang_user_scale.py --child): started, stopped
at its time with every process it started (sglang's scheduler and detokenizer), started again after a death on the
cases it left, and the cases a stopped child finished read back from its log. A harness stopped itself (`timeout`'s
SIGTERM at a GPU call's step limit, under `served.exit_on_term`) stops its engine first and keeps what it finished
(`Stopped`)."""
from __future__ import annotations

import json
import os
import sys
import time

from graphcap.bench.served import run_stoppable


class Stopped(SystemExit):
    """The harness was stopped while an engine ran: the engine and its processes are gone, `result` holds the cases it
    finished (a crash record, `stopped`), for the parent to write before it exits."""

    def __init__(self, code: int, result: dict):
        super().__init__(code)
        self.result = result


def finished_cases(log: str) -> list[dict]:
    """The cases a child printed before it stopped (one JSON object per line, `batch` and `context` in each)."""
    out = []
    for line in log.splitlines():
        if line.startswith("{") and '"batch"' in line:
            try:
                case = json.loads(line)
            except ValueError:
                continue
            if isinstance(case, dict) and "batch" in case and "context" in case:
                out.append(case)
    return out


def spawn(script: str, cfg: dict, work: str, timeout: float, tag: str | None = None) -> dict:
    """One engine child (`script --child CONFIG --child-out OUT`) over `cfg`'s cases, its files named by `tag`
    (default the engine): its output, or a crash record with the cases it printed before it stopped (`timed_out`:
    stopped at `timeout`, not dead)."""
    tag = tag or cfg["engine"]
    cfg_path, out_path = os.path.join(work, f"{tag}-config.json"), os.path.join(work, f"{tag}.json")
    json.dump(cfg, open(cfg_path, "w"))
    t = time.perf_counter()
    with open(os.path.join(work, f"{tag}.log"), "w") as log:
        try:
            rc, timed_out = run_stoppable([sys.executable, script, "--child", cfg_path, "--child-out", out_path],
                                          log, timeout)
        except SystemExit as e:  # the harness stopped: the child is already gone
            text = open(os.path.join(work, f"{tag}.log"), errors="replace").read()
            print(f"== {tag}: stopped with the harness after {time.perf_counter() - t:.0f} s", flush=True)
            raise Stopped(e.code, {"config": cfg, "crashed": True, "timed_out": False, "stopped": True,
                                   "log_tail": text[-2500:], "cases": finished_cases(text)}) from None
    rc = "timeout" if timed_out else rc
    if rc != 0 or not os.path.exists(out_path):
        text = open(os.path.join(work, f"{tag}.log"), errors="replace").read()
        tail, done = text[-2500:], finished_cases(text)
        print(f"== {tag}: failed ({rc}) after {time.perf_counter() - t:.0f} s, {len(done)} cases finished\n{tail}",
              flush=True)
        return {"config": cfg, "crashed": True, "timed_out": rc == "timeout", "log_tail": tail, "cases": done}
    print(f"== {tag}: ok in {time.perf_counter() - t:.0f} s", flush=True)
    return json.load(open(out_path))


def spawn_restarting(script: str, cfg: dict, work: str, timeout: float, restarts: int = 0) -> dict:
    """One engine over its cases (`spawn`). Where it died - not stopped at its timeout - before its last case, it is
    started again on the cases it did not finish, at most `restarts` times and within `timeout` seconds in all: a
    crash in one case (torch's profiler at a profile's stop, in stock sglang's W8A8 engine) then costs a start, not
    the rest of the sweep. A start that died before finishing any case is not repeated: what kills an engine before
    its first case (sglang refusing a KV pool the card cannot hold, a bad setting) kills every start, and each start
    costs minutes of a GPU call; the result says so (`not_restarted`). Each death stays in the result's `restarts`
    (cases finished before it, its log's tail), so a crash is never hidden; the result's `crashed` is the last
    start's."""
    t0 = time.perf_counter()
    res = last = spawn(script, cfg, work, timeout)
    deaths: list[dict] = []
    while res.get("crashed") and not res.get("timed_out") and len(deaths) < restarts:
        if not last.get("cases"):
            res["not_restarted"] = "died before its first case: a start that finishes nothing would die again"
            break
        finished = {(c["batch"], c["context"]) for c in res["cases"]}
        left = [c for c in cfg["cases"] if (c[0], c[1]) not in finished]
        remaining = timeout - (time.perf_counter() - t0)
        if not left or remaining <= 1:
            break
        deaths.append({"after_cases": len(res["cases"]), "log_tail": res["log_tail"][-800:]})
        keys = {(c[0], c[1]) for c in left}
        profiled = [p for p in cfg["profile_cases"] if (p[0], p[1]) in keys]
        try:
            again = spawn(script, {**cfg, "cases": left, "profile_cases": profiled}, work, remaining,
                          tag=f"{cfg['engine']}-restart{len(deaths)}")
        except Stopped as e:  # the cases of every start so far, and the deaths before
            e.result = {**e.result, "config": cfg, "cases": res["cases"] + e.result["cases"], "restarts": deaths}
            raise
        last = {**again, "cases": again.get("cases", [])}
        res = {**again, "config": cfg, "cases": res["cases"] + last["cases"]}
    if deaths:
        res["restarts"] = deaths
    return res
