"""`graphcap bench`'s options: the arguments (added to the `graphcap` parser's `bench` command: one argparse tree)
and the frozen `BenchConfig` they resolve to. Imports no torch at module level: `graphcap --help` stays fast."""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from graphcap.spec import CaptureSpec, SpecError, load_spec

# Measured modes, cheapest-to-build baseline first; graphcap last. Seven variants of graphcap are asked for by name
# only, to price a choice in one run: graphcap-per-bucket (one compile per bucket instead of one for all, the
# default), graphcap-skinny-gemm (every projection through graphcap's skinny GEMM at every batch, instead of the
# shape classes and batches it measured faster at), graphcap-skinny-4rows (every projection through it up to 4
# rows, cuBLAS above),
# graphcap-inlined-layers (every draft layer inlined into one graph instead of a nested compile region per layer:
# DraftLoop(layer_regions=False)) and graphcap-torch-ops (the layer's norms, rotary and gelu-mul as plain torch ops
# Inductor fuses, instead of graphcap's kernels: TORCH_OPS for LAYER_KERNEL_OPS); and graphcap less one kernel-count
# lever each: graphcap-qnorm-kernel (the query's norm + rotary as its own kernel, not in the attention's) and
# graphcap-two-head-proj (post_proj and the centroid scores as two GEMMs, not one).
VARIANTS = ("graphcap-per-bucket", "graphcap-skinny-gemm", "graphcap-skinny-4rows", "graphcap-inlined-layers",
            "graphcap-torch-ops", "graphcap-qnorm-kernel", "graphcap-two-head-proj")
MODES = ("eager-rebuild", "graph-rebuild", "sglang", "compile", "compile-nosync", "compile-plain", "compile-tuned",
         *VARIANTS, "graphcap")
DEFAULT_MODES = tuple(m for m in MODES if m not in VARIANTS)  # what --help lists: the variants are accepted unlisted
# Without CUDA compile-plain and compile-tuned are left out by default: more Inductor C++ compiles (~20 s each on 2
# cores) for modes whose point, the fusion and tuning Inductor does on a GPU, a CPU run cannot show.
CPU_MODES = tuple(m for m in DEFAULT_MODES if m not in ("compile-plain", "compile-tuned"))
DEFAULT_BATCHES = (1, 2, 4, 8, 16, 32, 64)
DEFAULT_CONTEXTS = (256, 1024, 2048, 4096)
# Without CUDA: one bucket (each compiled mode pays an Inductor C++ compile per bucket, ~20-50 s on 2 cores),
# contexts below, at and above the window, enough iterations for a median of real work.
CPU_BATCHES = (4,)
CUDA_ITERS, CUDA_WARMUP, CUDA_REPEATS = 50, 5, 3
CPU_ITERS, CPU_WARMUP, CPU_REPEATS = 20, 2, 3
SERVED_ONLY = ("model_path", "draft_model_path", "new_tokens", "engines", "load_format")  # graphcap.bench.served's
SERVED_REPEATS = 3  # --served's timed pairs per batch (graphcap.bench.served.ServedConfig)


class OptionError(ValueError):
    """A bad option: the CLI prints it as one line and exits 2."""


class OneLineParser(argparse.ArgumentParser):
    """The bench scripts' parser: a bad option is one line on stderr and exit status 2, no usage block (as the
    `graphcap` CLI does)."""

    def error(self, message: str):  # type: ignore[override]
        print(f"{self.prog}: error: {' '.join(message.split())}", file=sys.stderr)
        sys.exit(2)


@dataclass(frozen=True)
class BenchConfig:
    spec: CaptureSpec
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    steps: tuple[int, ...]
    modes: tuple[str, ...]
    iters: int
    warmup: int
    repeats: int
    out: Path | None
    seed: int
    graphcap_backend: str  # DraftGraphs backend of the graphcap mode
    threads: int  # torch intra-op threads on a CPU (0: leave torch's default)
    command: str  # as typed, for the report


def ints(text: str) -> tuple[int, ...]:
    """A comma-separated list of distinct positive integers (argparse names the option in front of the error)."""
    items = [x.strip() for x in text.split(",")]
    if not all(items):
        raise argparse.ArgumentTypeError(f"an empty item in {text!r}: expected comma-separated integers")
    try:
        vals = tuple(int(x) for x in items)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if min(vals) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    twice = sorted({v for v in vals if vals.count(v) > 1})
    if twice:
        raise argparse.ArgumentTypeError(f"{', '.join(map(str, twice))} given twice in {text!r}")
    return vals


def _default(with_cuda: object, without: object) -> str:
    """A default that may depend on the machine, stated once."""
    return f"default {with_cuda}" if with_cuda == without else f"default {with_cuda} with CUDA, {without} without"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--spec", default=None,
                   help="capture spec file or built-in name (default: gemma4-31b-assistant with CUDA, tiny without)")
    p.add_argument("--batch", type=ints, default=None,
                   help=f"batch sizes, e.g. 1,2,4,8 (default: 1..64 within the spec's buckets with CUDA, "
                        f"{','.join(map(str, CPU_BATCHES))} without)")
    p.add_argument("--context", type=ints, default=None, help="context lengths at the start of each measured run "
                   f"(default: {','.join(map(str, DEFAULT_CONTEXTS))}, those the spec's max_context leaves room for)")
    p.add_argument("--steps", type=ints, default=None, help="draft steps (default: the spec's)")
    p.add_argument("--modes", default=None,
                   help=f"comma-separated subset of {','.join(DEFAULT_MODES)} (default: all with CUDA, all but "
                        f"{' and '.join(m for m in DEFAULT_MODES if m not in CPU_MODES)} without; graphcap's variants, "
                        "each undoing one of its choices to price it, are accepted too, unlisted here: "
                        "graphcap.bench.options.VARIANTS)")
    p.add_argument("--iters", type=int, default=None,
                   help=f"measured iterations per run ({_default(CUDA_ITERS, CPU_ITERS)})")
    p.add_argument("--warmup", type=int, default=None,
                   help=f"iterations before the measured ones, per run ({_default(CUDA_WARMUP, CPU_WARMUP)})")
    p.add_argument("--repeats", type=int, default=None,
                   help=f"interleaved rounds over the modes ({_default(CUDA_REPEATS, CPU_REPEATS)}); --served: "
                   f"timed pairs of a short and a long run per batch, the median kept (default {SERVED_REPEATS})")
    p.add_argument("--graphcap-backend", default=None, help="DraftGraphs backend of the graphcap mode (default: the "
                   "spec's with CUDA; 'eager' without: Inductor's CPU code says nothing about a GPU)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads without CUDA (default 1: the tiny "
                   "spec's ops are too small to split, and a thread pool on a shared machine times its barriers; "
                   "0 leaves torch's default)")
    p.add_argument("--out", type=Path, default=None, help="directory for bench.json, bench.csv, bench.md, bench.png "
                   "(--served: served.json, the engines' logs and draft traces); default none: the table is printed, "
                   "nothing is written")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights, target state and inputs (default 0)")
    s = p.add_argument_group("the served draft (--served: sglang's own engine, on a CUDA GPU with sglang installed)")
    s.add_argument("--served", action="store_true", help="time the draft the plugin serves in sglang's engine, against "
                   "stock sglang's and no speculation (graphcap.bench.served); --batch, --context, --steps, --repeats, "
                   "--out and --seed apply")
    s.add_argument("--model-path", default=None, help="the target model, as sglang's --model-path takes it")
    s.add_argument("--draft-model-path", default=None,
                   help="its MTP assistant (sglang's --speculative-draft-model-path)")
    s.add_argument("--new-tokens", type=int, default=None, help="new tokens per request in the long run (default 128)")
    s.add_argument("--engines", default=None, help="comma-separated subset of nospec,sglang,graphcap (default: all)")
    s.add_argument("--load-format", default=None, help="sglang's --load-format, e.g. dummy (random weights)")


def growth_tokens(warmup: int, iters: int, steps: tuple[int, ...]) -> int:
    """Most tokens a row can gain in one measured run: warm-up, the counting iterations (syncs, kernels), the
    measured ones, each accepting up to steps + 1. Rows are allocated this much past the context."""
    return (warmup + 2 + iters) * (max(steps) + 1)


def config_from_args(a: argparse.Namespace, cuda: bool, command: str = "graphcap bench") -> BenchConfig:
    """Resolve the defaults that depend on the machine and the spec; OptionError names what is wrong."""
    from graphcap.backends import ALL_BACKENDS, COMPILED_BACKENDS, GRAPH_BACKENDS

    served_only = [f"--{k.replace('_', '-')}" for k in SERVED_ONLY if getattr(a, k, None) is not None]
    if served_only:
        raise OptionError(f"{', '.join(served_only)}: options of --served (the draft timed in sglang's engine)")
    try:
        spec = load_spec(a.spec or ("gemma4-31b-assistant" if cuda else "tiny"))
    except SpecError as e:
        raise OptionError(f"--spec: {e}") from None
    modes = tuple(m.strip() for m in a.modes.split(",")) if a.modes is not None else \
        (DEFAULT_MODES if cuda else CPU_MODES)
    if not all(modes):
        raise OptionError(f"--modes: an empty item in {a.modes!r}; expected some of {', '.join(DEFAULT_MODES)}")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise OptionError(f"--modes: unknown mode {unknown[0]!r}; expected some of {', '.join(DEFAULT_MODES)} "
                          f"(or graphcap's variants: {', '.join(VARIANTS)})")
    if len(set(modes)) != len(modes):
        raise OptionError(f"--modes: {a.modes!r} names a mode twice")
    skipped = {m: mode_unavailable(m, cuda) for m in modes}
    if all(skipped.values()):
        runs_here = [m for m in DEFAULT_MODES if not mode_unavailable(m, cuda)]
        raise OptionError(f"--modes {','.join(modes)}: none of them runs on this machine ("
                          + "; ".join(f"{m}: {why}" for m, why in skipped.items())
                          + f"); these do: {', '.join(runs_here)}")
    iters = a.iters if a.iters is not None else (CUDA_ITERS if cuda else CPU_ITERS)
    warmup = a.warmup if a.warmup is not None else (CUDA_WARMUP if cuda else CPU_WARMUP)
    repeats = a.repeats if a.repeats is not None else (CUDA_REPEATS if cuda else CPU_REPEATS)
    for option, value, least in (("--iters", iters, 1), ("--repeats", repeats, 1), ("--warmup", warmup, 0)):
        if value < least:
            raise OptionError(f"{option} must be >= {least}, got {value}")
    backend = a.graphcap_backend or (spec.capture.backend if cuda else "eager")
    if backend not in ALL_BACKENDS:
        raise OptionError(f"--graphcap-backend: {backend!r} is not one of {', '.join(ALL_BACKENDS)}")
    if not cuda and backend in GRAPH_BACKENDS:
        raise OptionError(f"--graphcap-backend: {backend!r} records CUDA graphs and this machine has no CUDA; "
                          "use compile or eager")
    if "graphcap-per-bucket" in modes and backend not in COMPILED_BACKENDS:
        raise OptionError(f"--modes graphcap-per-bucket: one compile per bucket against graphcap's one for all; "
                          f"backend {backend!r} compiles nothing (--graphcap-backend: one of "
                          f"{', '.join(COMPILED_BACKENDS)})")
    steps = a.steps or (spec.capture.steps,)
    room = spec.capture.max_context - growth_tokens(warmup, iters, steps)
    default_b = DEFAULT_BATCHES if cuda else CPU_BATCHES
    batches = a.batch or tuple(b for b in default_b if b <= spec.capture.buckets[-1])
    if a.context:
        contexts = a.context
    else:
        contexts = tuple(c for c in DEFAULT_CONTEXTS if c <= room) or tuple(
            c for c in _window_contexts(spec) if c <= room)
    if not contexts or max(contexts) > room:
        raise OptionError(no_room(spec, max(a.context) if a.context else min(_window_contexts(spec)), warmup, iters,
                                  steps, context_given=bool(a.context)))
    if max(batches) > spec.capture.max_slots:
        raise OptionError(f"--batch {max(batches)} exceeds max_slots {spec.capture.max_slots} of spec {spec.name}")
    if a.threads < 0:
        raise OptionError("--threads must be >= 0")
    return BenchConfig(spec, tuple(batches), tuple(contexts), tuple(steps), modes, iters, warmup, repeats, a.out,
                       a.seed, backend, a.threads, command)


def mode_unavailable(name: str, cuda: bool) -> str | None:
    """Why mode `name` cannot run on this machine, or None where it can: graph-rebuild records CUDA graphs; the
    sglang mode runs sglang's Triton kernels, and so do the compile modes with CUDA (without, graphcap's twins)."""
    if name == "graph-rebuild" and not cuda:
        return "CUDA graphs need CUDA"
    if name == "sglang" or (cuda and name.startswith("compile")):
        from graphcap.bench.sglang_ops import check_available  # imports torch: not at --help's import

        try:
            check_available(cuda)
        except ImportError as e:
            return str(e)
    return None


def _window_contexts(spec: CaptureSpec) -> tuple[int, ...]:
    """The contexts a spec whose max_context holds none of DEFAULT_CONTEXTS is run at: below, at and above its
    window."""
    return tuple(c for c in (spec.window // 2, spec.window, 2 * spec.window) if c >= 1)


def no_room(spec: CaptureSpec, context: int, warmup: int, iters: int, steps: tuple[int, ...],
            context_given: bool) -> str:
    """The error for a run whose rows outgrow the spec's max_context: the growth as the options make it, and the
    value of each option that alone would make it fit."""
    cap, s = spec.capture.max_context, max(steps)
    growth = growth_tokens(warmup, iters, steps)
    what = f"--context {context}" if context_given else f"the smallest default context, {context},"
    free = cap - context  # the growth that fits beside that context
    fits = [f"--{name} <= {value}" for name, value in (
        ("iters", free // (s + 1) - warmup - 2), ("steps", free // (warmup + 2 + iters) - 1),
        ("context", cap - growth)) if value >= 1]
    return (f"spec {spec.name}: {what} plus the {growth} tokens each row grows by in a run ((--warmup {warmup} + 2 "
            f"counted + --iters {iters}) iterations x (--steps {s} + 1) tokens) exceeds its max_context {cap}; "
            + (f"it fits with one of {', '.join(fits)} (the others as given)" if fits else
               "no --iters, --steps or --context makes it fit: a spec with a larger max_context does"))


def buckets_for(cfg: BenchConfig) -> tuple[int, ...]:
    """The buckets the measured batches dispatch to (the smallest spec bucket >= each batch; a batch above every
    bucket gets its own): capturing only these keeps a run's compile time to what it measures."""
    spec_b = cfg.spec.capture.buckets
    return tuple(sorted({next((s for s in spec_b if s >= b), b) for b in cfg.batches}))


def server_compile(spec: CaptureSpec, buckets: tuple[int, ...] | list[int], backend: str,
                   per_bucket: bool = False) -> dict[str, object]:
    """`DraftGraphs.for_loop`'s sizing arguments for a run that captures only `buckets` of `spec`: the one compile
    for every bucket sized for the spec's largest bucket (or a captured one above it) - the code a server capturing
    every bucket runs, since Inductor picks other kernels for a smaller largest bucket. `per_bucket`: one compile per
    bucket instead; a backend that compiles nothing takes no sizing."""
    from graphcap.backends import COMPILED_BACKENDS

    if per_bucket:
        return {"dynamic_batch": False}
    if backend not in COMPILED_BACKENDS:
        return {}
    return {"compile_max_batch": max(*spec.capture.buckets, *buckets)}

