"""A stand-in `sglang` package for the engine harnesses' tests on a CPU: `sglang.Engine` whose outputs, draft-trace
records (graphcap.sglang.trace's format) and decode time follow known formulas, installed in front of PYTHONPATH
so that child processes import it."""
from __future__ import annotations

import os
from pathlib import Path

VOCAB = 977
SLEEP_PER_TOKEN_S = 0.002  # the stand-in's decode time per generated token
STALL_S = 0.3  # FAKE_SGLANG_STALL's one-off stall
PROFILE_PERIOD_US = 4000  # the iteration period of the stand-in's profiler trace
FAKE_SGLANG = '''
import json, math, os, time

from graphcap.sglang.settings import DRAFT_CAPTURE_ENV, TRACE_ENV

class _ModelConfig:
    vocab_size = {vocab}

class _TokenizerManager:
    model_config = _ModelConfig()

def base_ms(graphcap, batch):  # the draft call's GPU time, by engine and batch: the test recomputes it
    return (0.5 if graphcap else 2.0) * (1 + batch / 8)

class Engine:
    def __init__(self, **kw):
        self.kw = kw
        self.mtp = "speculative_algorithm" in kw
        self.graphcap = bool(os.environ.get(DRAFT_CAPTURE_ENV))
        tag = "graphcap" if self.graphcap else ("sglang" if self.mtp else "nospec")
        with open(os.path.join(os.environ["FAKE_SGLANG_LOG"], tag + ".json"), "w") as f:
            json.dump({{"kw": kw, "capture": os.environ.get(DRAFT_CAPTURE_ENV), "trace": os.environ.get(TRACE_ENV),
                       "triton_cache": os.environ.get("TRITON_CACHE_DIR"),
                       "radix_core": os.environ.get("SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND")}}, f)
        if os.environ.get("FAKE_SGLANG_CRASH") == tag:
            raise RuntimeError("fake sglang: CUDA error: an illegal memory access was encountered")
        self.tokenizer_manager = _TokenizerManager()
        self.calls = 0
        # FAKE_SGLANG_STALL="ENGINE:N": that engine's first call past N new tokens stalls STALL_S halfway (a JIT
        # compile at a length first reached)
        stall = os.environ.get("FAKE_SGLANG_STALL", "").split(":")
        self.stall_after = int(stall[1]) if stall[0] == tag else None

    def get_server_info(self):  # FAKE_SGLANG_POOL: the KV pool's tokens, as sglang's max_total_num_tokens
        pool = os.environ.get("FAKE_SGLANG_POOL")
        if not pool:
            return {{}}
        return {{"max_total_num_tokens": int(pool), "swa_full_tokens_ratio": self.kw.get("swa_full_tokens_ratio", 0.8),
                "chunked_prefill_size": self.kw.get("chunked_prefill_size", 8192)}}

    def start_profile(self, output_dir, num_steps, **kw):  # the next generate call writes the trace
        self.profile = (output_dir, num_steps)

    def _write_profile(self, batch):
        # a by-stage decode trace as sglang names it: num_steps forward steps every PROFILE_PERIOD_US
        import gzip
        out, steps = self.profile
        self.profile = None
        step = "VERIFY" if self.mtp else "DECODE"
        events = [{{"cat": "gpu_user_annotation", "name": "step[%s bs=%d]" % (step, batch), "ts": i * {period},
                   "dur": {period} / 2, "ph": "X"}} for i in range(steps)]
        with gzip.open(os.path.join(out, "0-TP-0-DECODE.trace.json.gz"), "wt") as f:
            json.dump({{"traceEvents": events}}, f)

    def generate(self, input_ids, sampling_params, rid):
        new = sampling_params[0]["max_new_tokens"]
        if getattr(self, "profile", None):
            self._write_profile(len(input_ids))
        if len(input_ids[0]) == int(os.environ.get("FAKE_SGLANG_HANG_CONTEXT", -1)):  # a case that never ends
            time.sleep(600)
        # FAKE_SGLANG_DIE="CONTEXT:MARKER": the first engine to reach a prompt of CONTEXT tokens dies there (the
        # marker file tells later engines it has happened), as sglang's scheduler does on an exception
        die = os.environ.get("FAKE_SGLANG_DIE", "").split(":", 1)
        if len(die) == 2 and len(input_ids[0]) == int(die[0]) and not os.path.exists(die[1]):
            open(die[1], "w").close()
            print("Scheduler hit an exception: IndexError: Argument passed to at() was not in the map.", flush=True)
            os._exit(1)
        t0 = time.perf_counter()
        stall = 0.0
        if self.stall_after is not None and new > self.stall_after:
            stall, self.stall_after = {stall}, None
        time.sleep(new * {sleep} + stall)
        verify = math.ceil(new / 2.5)
        if self.mtp and os.environ.get(TRACE_ENV):
            d = os.environ[TRACE_ENV]
            os.makedirs(d, exist_ok=True)
            with open(os.path.join(d, "draft-trace-%d.jsonl" % os.getpid()), "a") as f:
                for i in range(verify):
                    ms = base_ms(self.graphcap, len(rid)) + 0.01 * i
                    f.write(json.dumps({{"rids": list(rid), "seq_lens": None, "draft": [[0]] * len(rid),
                                        "gpu_ms": ms, "host_ms": 0.1,
                                        "t": t0 + (i + 1) * new * {sleep} / (verify + 1)
                                             + (stall if i >= verify // 2 else 0.0)}}) + "\\n")
        outs = []
        for j, p in enumerate(input_ids):
            toks = [(p[-1] + k + 1) % {vocab} for k in range(new)]
            if self.graphcap and j == 0 and os.environ.get("FAKE_SGLANG_DIFF"):
                toks[-1] += 1
            meta = {{"completion_tokens": new, "spec_verify_ct": verify if self.mtp else 0}}
            outs.append({{"output_ids": toks, "meta_info": meta}})
        return outs

    def shutdown(self):
        pass
'''


def install_fake_sglang(tmp_path: Path, monkeypatch) -> Path:
    """Write the stand-in under tmp_path, put it (and the repository) in front of PYTHONPATH; returns the directory
    where each engine writes what it was started with (FAKE_SGLANG_LOG)."""
    root = tmp_path / "fake"
    (root / "sglang").mkdir(parents=True)
    (root / "sglang" / "__init__.py").write_text(FAKE_SGLANG.format(
        vocab=VOCAB, sleep=SLEEP_PER_TOKEN_S, stall=STALL_S, period=PROFILE_PERIOD_US))
    log = tmp_path / "engine-log"
    log.mkdir()
    repo = Path(__file__).resolve().parents[1]
    # in front of the machine's own path, which its children need too (a GPU machine's carried wheels: pydantic)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(root), str(repo), os.environ.get("PYTHONPATH"))
                                                     if p))
    monkeypatch.setenv("FAKE_SGLANG_LOG", str(log))
    return log


def hanging_engine(tmp_path: Path) -> tuple[list[str], Path]:
    """A stand-in engine child that starts a process of its own (as sglang starts its scheduler), writes that
    process's pid to the returned file, then hangs: (its command, the pid file)."""
    import sys

    pid_file = tmp_path / "grandchild.pid"
    script = tmp_path / "hangs.py"
    script.write_text("import subprocess, sys, time\n"
                      "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
                      f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
                      "time.sleep(600)\n")
    return [sys.executable, str(script)], pid_file


def process_gone(pid: int, within_s: float = 5.0) -> bool:
    """Whether `pid` has ended (or is a zombie awaiting its reaper) within `within_s` seconds."""
    import os
    import time

    end = time.monotonic() + within_s
    while time.monotonic() < end:
        try:
            os.kill(pid, 0)
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split()[2] == "Z":
                    return True
        except (ProcessLookupError, FileNotFoundError):
            return True
        time.sleep(0.05)
    return False
