"""sglang's HTTP server as its users start it: `python -m sglang.launch_server` (what `sglang serve` runs) with
sglang's defaults - radix cache, chunked prefill, the overlap scheduler, the decode CUDA-graph batch sizes it picks
for the GPU - and only what a Gemma 4 MTP deployment sets: triton attention, page size 64, the speculative flags,
and graphcap's flag on one of them. `Server` starts one in a process group of its own, waits until it answers
`/health` (sglang's own warm-up request done), and stops it with everything it started.

The few settings that differ from sglang's defaults are named in `ServerConfig` and said in every record
(`ServerConfig.departures`): reporting flags (per-request cached-token counts, Prometheus metrics) that change no
scheduling, and, unless asked for, sglang's breakable prefill CUDA graphs. Those are off for the user's own
checkpoint anyway: sglang (0.5.18 and 0.5.23) turns them off for a multimodal architecture on neither of its
prefill-graph allowlists, which Gemma4ForConditionalGeneration is; the stand-in checkpoints are text-only
Gemma4ForCausalLM, which would get them. (They capture the target's prefill, which graphcap does not touch.)

The parent side imports neither torch nor sglang.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from graphcap.bench.served import failure
from graphcap.sglang.settings import CHECK_ENV, DRAFT_CAPTURE_ENV, MANIFEST_FLUSH_ENV, TRACE_ENV

KINDS = ("nospec", "sglang", "graphcap")  # no speculation, stock sglang's MTP, MTP with the flag
LAUNCHER = (sys.executable, "-m", "sglang.launch_server")  # takes `sglang serve`'s arguments


class ServerFailed(RuntimeError):
    """A server that exited, or did not answer in time; the message is the line of its log that says why."""


@dataclass(frozen=True)
class ServerConfig:
    kind: str  # one of KINDS
    model_path: str
    draft_model_path: str | None = None  # None for nospec
    steps: int = 3
    port: int = 30000
    prefill_graphs: bool = False  # on for a text-only model; off, as for the user's multimodal one (module doc)
    check: bool = False  # graphcap's check mode (GRAPHCAP_SGLANG_CHECK=1): every draft checked against sglang
    extra_args: tuple[str, ...] = ()  # more sglang flags (a smaller KV pool for the faults, say)
    env: tuple[tuple[str, str], ...] = ()
    name: str = ""  # for logs and records; default the kind

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"server kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.kind != "nospec" and not self.draft_model_path:
            raise ValueError(f"a {self.kind} server needs the draft model's path")
        if self.check and self.kind != "graphcap":
            raise ValueError("the check mode is graphcap's: only a graphcap server takes it")

    @property
    def label(self) -> str:
        return self.name or self.kind

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def departures(self) -> list[str]:
        """Every setting this server runs with that sglang's defaults would not give it."""
        out = ["--enable-cache-report (cached tokens per request in the OpenAI API's usage)",
               "--enable-metrics (sglang's Prometheus counters at /metrics)"]
        if not self.prefill_graphs:
            out.append("--disable-prefill-cuda-graph (what sglang picks itself for the user's Gemma4ForConditional"
                       "Generation checkpoint - a multimodal arch on neither prefill-graph allowlist - and not for the "
                       "text-only Gemma4ForCausalLM stand-in)")
        out += [f"{a}" for a in self.extra_args if a.startswith("--")]
        return out


def server_command(cfg: ServerConfig, manifest_dir: str | Path | None = None,
                   launcher: tuple[str, ...] = LAUNCHER) -> list[str]:
    """The command line a user types (through `python -m sglang.launch_server`, which takes `sglang serve`'s
    arguments), for `cfg`; `launcher` replaces the program (a stand-in server for tests)."""
    cmd = [*launcher, "--model-path", cfg.model_path, "--host", "127.0.0.1",
           "--port", str(cfg.port), "--attention-backend", "triton", "--page-size", "64",
           "--enable-cache-report", "--enable-metrics"]
    if not cfg.prefill_graphs:
        cmd.append("--disable-prefill-cuda-graph")
    if cfg.kind != "nospec":
        cmd += ["--speculative-algorithm", "NEXTN", "--speculative-draft-model-path", str(cfg.draft_model_path),
                "--speculative-num-steps", str(cfg.steps), "--speculative-eagle-topk", "1",
                "--speculative-num-draft-tokens", str(cfg.steps + 1)]
    if cfg.kind == "graphcap":
        cmd.append("--enable-draft-graph-capture")
        if manifest_dir is not None:
            cmd += ["--draft-graph-manifest-dir", str(manifest_dir)]
    return cmd + list(cfg.extra_args)


def server_env(cfg: ServerConfig, trace_dir: str | Path | None, base: dict[str, str] | None = None) -> dict[str, str]:
    """The server's environment: the caller's, without graphcap's options (only the flag turns graphcap on), with
    the draft trace where asked, the check mode for a checking graphcap server, and `cfg.env` over it."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if k not in (DRAFT_CAPTURE_ENV, CHECK_ENV)}
    if trace_dir is not None:
        env[TRACE_ENV] = str(trace_dir)
    env[MANIFEST_FLUSH_ENV] = env.get(MANIFEST_FLUSH_ENV, "2")  # counters on disk while it runs
    if cfg.check:
        env[CHECK_ENV] = "1"
    env.update(dict(cfg.env))
    return env


def http_json(url: str, payload: dict | None = None, timeout: float = 30.0) -> tuple[int, object]:
    """(status, body: JSON where it parses, else text) of a GET, or a POST of `payload`; status 0 where nothing
    answered."""
    data = json.dumps(payload).encode() if payload is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return 0, None
    text = raw.decode(errors="replace")
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


@dataclass
class Server:
    """One running server: `start()` (returns once it answers `/health`), `stop()`; a context manager."""

    cfg: ServerConfig
    work: Path
    startup_timeout_s: float = 600.0
    launcher: tuple[str, ...] = LAUNCHER
    proc: subprocess.Popen | None = None
    startup_s: float | None = None
    log_path: Path = field(init=False)
    trace_dir: Path = field(init=False)
    manifest_dir: Path = field(init=False)

    def __post_init__(self) -> None:
        self.work = Path(self.work)
        self.log_path = self.work / f"{self.cfg.label}.log"
        self.trace_dir = self.work / f"trace-{self.cfg.label}"
        self.manifest_dir = self.work / f"manifests-{self.cfg.label}"

    def start(self) -> Server:
        self.work.mkdir(parents=True, exist_ok=True)
        # the traces are this server's alone: a warm machine keeps the work dir, and an earlier server of this label
        # would otherwise count in its compiles, draft calls, prefills and host samples
        shutil.rmtree(self.trace_dir, ignore_errors=True)
        cmd = server_command(self.cfg, self.manifest_dir if self.cfg.kind == "graphcap" else None, self.launcher)
        (self.work / f"{self.cfg.label}.cmd").write_text(" ".join(cmd) + "\n")
        t0 = time.perf_counter()
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                         env=server_env(self.cfg, self.trace_dir), start_new_session=True)
        try:
            while True:
                if self.proc.poll() is not None:
                    raise ServerFailed(f"{self.cfg.label}: exited with status {self.proc.returncode} at start-up: "
                                       f"{self.why()}")
                if time.perf_counter() - t0 > self.startup_timeout_s:
                    raise ServerFailed(f"{self.cfg.label}: no answer to /health within {self.startup_timeout_s:.0f} s")
                if http_json(self.cfg.url + "/health", timeout=5)[0] == 200:
                    break
                time.sleep(1.0)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.perf_counter() - t0
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def responsive(self, timeout_s: float = 10.0, exit_grace_s: float = 5.0) -> bool:
        """Alive and answering /health. One that does not answer is given `exit_grace_s` to finish dying: clients
        see a dying server's connections close before its process has exited."""
        if self.alive() and http_json(self.cfg.url + "/health", timeout=timeout_s)[0] == 200:
            return True
        deadline = time.monotonic() + exit_grace_s
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        return False

    def why(self) -> str:
        """What broke, from the log: its last exception line, else the exit status."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            text = ""
        return failure(text) or (f"exit status {self.proc.returncode}" if self.proc and self.proc.poll() is not None
                                 else "no error in its log")

    def stop(self, grace_s: float = 20.0) -> int | None:
        """SIGTERM to the whole group (sglang's launcher then stops its scheduler, whose exit writes graphcap's
        manifest), SIGKILL after `grace_s`. Returns the launcher's exit status."""
        if self.proc is None:
            return None
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
            if self.proc.poll() is not None:
                break
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                continue
        try:  # what the launcher started and left behind
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return self.proc.wait()

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
