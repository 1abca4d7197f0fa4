"""`graphcap` command line: `inspect` (capture manifests), `specs` (built-in capture specs), `bench` (graphcap.bench).

One parser tree: `bench`'s options are graphcap.bench.options'. `inspect` and `specs` never import torch. Every expected failure (a bad manifest or spec, a missing path, bad usage)
is one line on stderr, `graphcap: error: ...`, and exit status 2 - never a traceback.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType

from graphcap.bench import options as bench_options
from graphcap.bench.options import OptionError
from graphcap.bench.options import add_arguments as add_bench_arguments
from graphcap.errors import GraphcapInputError
from graphcap.manifest import (Manifest, ManifestError, Parallel, Serving, default_manifest_dir, list_manifests,
                               manifest_path, read_manifest)

PROG = "graphcap"


class CliError(Exception):
    """An expected failure: printed as one line and exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse would print the usage too: keep it to one line
        raise CliError(f"{message} (see '{self.prog} --help')")


def build_parser() -> argparse.ArgumentParser:
    from graphcap import __version__

    p = _Parser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    i = sub.add_parser("inspect", help="show capture manifests", description=(
        "Show what was captured: per batch bucket, status, capture time, graph pool memory, replays, eager "
        "fallbacks and padding waste. The manifests of one server's ranks (tensor, pipeline or data parallel) are "
        "shown together, with where they disagree. PATH is a manifest or a directory of them (default: "
        f"{_default_dir_help()})."))
    i.add_argument("path", nargs="?", metavar="MANIFEST_OR_DIR")
    i.add_argument("--json", action="store_true", help="print a JSON list of manifests (padding_waste included)")

    s = sub.add_parser("specs", help="list capture specs", description="List the built-in capture specs, or the "
                       "spec files given (which are validated: a bad one is an error naming file, field and reason).")
    s.add_argument("spec", nargs="*", help="spec files or built-in names (default: all built-in specs)")

    b = sub.add_parser("bench", help="draft iterations/s: graphcap against the sglang-style and torch.compile "
                       "baselines", description=_bench_description())
    add_bench_arguments(b)
    return p


def _default_dir_help() -> str:
    return "$GRAPHCAP_MANIFEST_DIR, else $XDG_CACHE_HOME/graphcap/manifests or ~/.cache/graphcap/manifests"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        try:
            args = build_parser().parse_args(argv)
        except SystemExit as e:  # --help / --version
            return _exit_code(e)
        if args.command == "inspect":
            return cmd_inspect(args.path, as_json=args.json)
        if args.command == "specs":
            return cmd_specs(args.spec)
        if args.command == "bench":
            return cmd_bench(args, argv)
        raise CliError("missing command: one of inspect, specs, bench (see 'graphcap --help')")
    except (CliError, GraphcapInputError, OptionError) as e:  # a bad manifest, spec or option
        _error(str(e))
        return 2
    except BrokenPipeError:  # `graphcap inspect | head`
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except OSError as e:  # a path the system refuses (permissions, name too long, ...): one line, no traceback
        _error(f"{e.filename}: {e.strerror}" if e.filename else str(e))
        return 2


def _error(message: str) -> None:
    print(f"{PROG}: error: {' '.join(message.split())}", file=sys.stderr)  # one line, whatever the message holds


def _exit_code(e: SystemExit) -> int:
    if e.code is None or isinstance(e.code, int):
        return e.code or 0
    print(e.code, file=sys.stderr)
    return 1


# ---------------------------------------------------------------------------------------------------------------
# inspect


def cmd_inspect(path: str | None, as_json: bool = False) -> int:
    if path is None:
        directory = default_manifest_dir()
        files = list_manifests(directory)
        if not files:
            print("[]" if as_json else f"no manifests in {directory}")
            return 0
    else:
        p = Path(path)
        if p.is_dir():  # named by the user, so one without manifests is a mistake, as a missing file is
            files = list_manifests(p)
            if not files:
                raise CliError(f"{p}: holds no capture manifests (files named <spec>-<hash>-<backend>.json)")
        elif p.exists():
            files = [p]
        else:
            raise CliError(f"{p}: no such file or directory")

    manifests: list[tuple[Path, Manifest]] = []
    errors: list[ManifestError] = []
    for f in files:
        try:
            manifests.append((f, read_manifest(f)))
        except ManifestError as e:  # show the readable ones, then one line per unreadable one
            errors.append(e)
    if manifests and as_json:
        print(json.dumps([m.to_dict(derived=True) for _, m in manifests], indent=2))
    elif manifests:
        seen: dict[Path, Manifest | None] = {**{Path(e.source): None for e in errors}, **dict(manifests)}
        print("\n\n".join(format_manifest(group[0][1], group[0][0]) if len(group) == 1 and _single(group[0][1])
                           else format_ranks(group, seen) for group in group_ranks(manifests)))
    for e in errors:
        _error(str(e))
    return 2 if errors else 0


def _single(m: Manifest) -> bool:
    return m.parallel is None or m.parallel.single


def group_ranks(manifests: Sequence[tuple[Path, Manifest]]) -> list[list[tuple[Path, Manifest]]]:
    """The manifests by server - same spec name, hash and backend, and the same world (parallel sizes) - in the
    order read; a single process's manifest is a group of its own."""
    groups: dict[object, list[tuple[Path, Manifest]]] = {}
    for i, (f, m) in enumerate(manifests):
        key = i if _single(m) else (m.spec_name, m.spec_hash, m.backend, m.parallel.world)
        groups.setdefault(key, []).append((f, m))
    return list(groups.values())


def rank_disagreements(group: Sequence[tuple[Path, Manifest]],
                       seen: Mapping[Path, Manifest | None] = MappingProxyType({})) -> list[str]:
    """What the ranks of one server disagree on, one line each: a bucket's status (or presence) that differs, a rank
    of the world with no manifest in the group (`seen`: every file read, None where unreadable, to say why), a rank
    with two. [] when every rank is there with the same buckets."""
    world = group[0][1].parallel
    labels = [m.parallel.label for _, m in group]
    lines = [f"{label}: {labels.count(label)} manifests" for label in dict.fromkeys(labels) if labels.count(label) > 1]
    status = {label: {b.batch_size: b.status for b in m.buckets} for label, (_, m) in zip(labels, group)}
    for size in sorted({b for s in status.values() for b in s}):
        on: dict[str, list[str]] = {}  # status -> ranks
        for label, s in status.items():
            on.setdefault(s.get(size, "absent"), []).append(label)
        if len(on) > 1:
            lines.append(f"bucket {size}: " + "; ".join(f"{st} on {', '.join(ls)}" for st, ls in on.items()))
    dims = [("dp", world.dp_size), ("pp", world.pp_size), ("tp", world.tp_size)]
    if all(m.parallel.dp_rank is not None for _, m in group) or world.dp_size == 1:  # replicas numbered: expected
        directory = group[0][0].parent
        for ranks in itertools.product(*(range(n) for _, n in dims)):
            want = Parallel(**{f"{d}_{k}": v for (d, n), r in zip(dims, ranks) for k, v in (("rank", r), ("size", n))})
            if want.label in labels:
                continue
            m = group[0][1]
            path = manifest_path(directory, m.spec_name, m.spec_hash, m.backend, want)
            if path in seen:
                other = seen[path]
                world_of = other.parallel.describe_world() if other and other.parallel else "one process"
                why = ("unreadable, see the error below" if other is None else
                       f"{path.name} is another run's: {world_of}")
            else:
                why = "not read: inspect the directory to compare it" if path.exists() else f"{path} does not exist"
            lines.append(f"{want.label}: no manifest ({why})")
    return lines


def format_ranks(group: Sequence[tuple[Path, Manifest]],
                 seen: Mapping[Path, Manifest | None] = MappingProxyType({})) -> str:
    """One server's ranks: a bucket-by-rank status table, what they disagree on (or that they agree), then each
    rank's manifest as `format_manifest` shows one."""
    from tabulate import tabulate

    group = sorted(group, key=lambda fm: tuple(getattr(fm[1].parallel, f"{d}_rank") or 0 for d in ("dp", "pp", "tp")))
    m0 = group[0][1]
    labels = [m.parallel.label for _, m in group]
    sizes = sorted({b.batch_size for _, m in group for b in m.buckets})
    rows = [[size, *(next((b.status for b in m.buckets if b.batch_size == size), "-") for _, m in group)]
            for size in sizes]
    w = m0.parallel
    lines = [f"{m0.spec_name} (spec {m0.spec_hash}), backend {m0.backend}: {w.describe_world()}, manifests of "
             f"{len(group)} of {w.dp_size * w.pp_size * w.tp_size} ranks", ""]
    lines.append(tabulate(rows, headers=["bucket", *labels], disable_numparse=True,
                          colalign=("right",) + ("left",) * len(labels)) if rows else "(no buckets)")
    disagree = rank_disagreements(group, seen)
    if disagree:
        lines += ["", "ranks disagree:", *(f"  {d}" for d in disagree)]
    else:
        lines += ["", f"ranks agree: every rank has buckets {', '.join(map(str, sizes)) or '(none)'}, each with the "
                  "same status"]
    return "\n\n".join(["\n".join(lines), *(format_manifest(m, f) for f, m in group)])


def format_manifest(m: Manifest, path: str | Path | None = None) -> str:
    from tabulate import tabulate

    rank = m.parallel.label if m.parallel is not None else ""
    lines = [f"{m.spec_name} (spec {m.spec_hash}), backend {m.backend}" + (f", rank {rank}" if rank else "")
             + (", one compile for every bucket (dynamic batch)" if m.dynamic_batch else "")]
    if path is not None:
        lines.append(f"  file:     {path}")
    lines += [
        f"  spec:     {m.spec_source or '-'}",
        f"  device:   {m.device}, driver {m.driver or 'n/a'}",
        f"  versions: torch {m.torch_version}, triton {m.triton_version or 'n/a'}, graphcap {m.graphcap_version}",
        f"  loop:     {m.steps} draft steps, window {m.window}",
        f"  created:  {m.created}, updated {m.updated}",
        *([f"  compile cache: {m.compile_cache}"] if m.compile_cache else []),
        "",
    ]
    rows = [[b.batch_size, b.status, f"{b.capture_s:.2f}", f"{b.pool_bytes / 2**20:.1f}", b.replays, b.fallbacks,
             f"{100 * b.padding_waste:.1f}"] for b in m.buckets]
    headers = ["bucket", "status", "capture s", "pool MiB", "replays", "fallbacks", "padding waste (%)"]
    lines.append(tabulate(rows, headers=headers, disable_numparse=True, colalign=("right", "left") + ("right",) * 5)
                 if rows else "(no buckets)")
    lines += ["", f"oversize fallbacks: {m.oversize_fallbacks} (batches above the largest bucket, run eagerly)"]
    for b in m.buckets:
        if b.status == "failed":
            lines.append(f"failed bucket {b.batch_size}: {b.reason or 'no reason recorded'}")
    lines += [f"note: {n}" for n in m.notes]
    lines += format_serving(m.serving) if m.serving is not None else []
    return "\n".join(lines)


def format_serving(s: Serving) -> list[str]:
    """The manifest's serving section: the window rows' bookkeeping and the Triton kernel variants compiled."""
    lines = ["", f"rows: {s.joins} joins, {s.resets} rebuilt, {s.retracts} retracted, "
                 f"{s.evictions_in_window} in-window SWA evictions",
             f"kernel variants: {s.variants_preloaded} recorded ones compiled at start-up"
             + (f" ({s.variants_preload_failed} could not be)" if s.variants_preload_failed else "")
             + f", {s.variants_at_startup} more before the first draft, {s.variants_while_serving} while serving"]
    lines += [f"  compiled while serving, {c.after_s:.1f} s after the first draft: {c.kernel} "
              f"({1e3 * c.seconds:.0f} ms) {c.variant}" for c in s.late_compiles]
    return lines


# ---------------------------------------------------------------------------------------------------------------
# specs and bench


def cmd_specs(names: Sequence[str] = ()) -> int:
    from tabulate import tabulate

    from graphcap.spec import builtin_specs, load_spec

    specs = [load_spec(n) for n in (names or builtin_specs())]
    rows = [[s.name, s.model, s.draft_model, s.window, s.page_size, layer_pattern(s.draft.layers), s.capture.steps,
             ",".join(map(str, s.capture.buckets)), s.hash] for s in specs]
    print(tabulate(rows, headers=["name", "model", "draft", "W", "page", "layers", "steps", "buckets", "hash"],
                   disable_numparse=True))
    return 0


def layer_pattern(layers: Sequence[str]) -> str:
    """("sliding", "sliding", "sliding", "full") -> "3S+F" (run lengths, S = sliding, F = full)."""
    runs: list[list] = []
    for lt in layers:
        if runs and runs[-1][0] == lt:
            runs[-1][1] += 1
        else:
            runs.append([lt, 1])
    return "+".join(f"{n if n > 1 else ''}{lt[0].upper()}" for lt, n in runs)


def _bench_description() -> str:
    return ("Draft-phase iterations/s against batch (and context, steps): graphcap against eager-rebuild, "
            "graph-rebuild, sglang (what sglang 0.5.23 launches), compile (that loop under torch.compile "
            "reduce-overhead, sglang's .item() kept), compile-nosync (without it), compile-plain (a hand-written "
            "loop: torch ops Inductor fuses, no sync) and compile-tuned (that loop with gpt-fast's Inductor "
            "setting, coordinate descent tuning), on one target state, modes interleaved: graphcap's reference "
            "draft loop, the library's. Without CUDA: the tiny spec, graphs and sglang's kernels skipped with the "
            "reason, compile-plain and compile-tuned left out unless named. --served: the draft the sglang plugin "
            "serves, timed in sglang's own engine on your model pair against stock sglang's draft and no "
            "speculation (a CUDA GPU and sglang needed).")


def cmd_bench(args: argparse.Namespace, argv: Sequence[str]) -> int:
    if args.served:
        return cmd_bench_served(args, argv)
    try:
        import torch

        from graphcap.bench import runner  # lazily: it imports torch, triton, tqdm
    except ModuleNotFoundError as e:
        raise CliError(f"graphcap bench is unavailable: {e}") from None
    cfg = bench_options.config_from_args(args, torch.cuda.is_available(),
                                         command=" ".join([PROG, *argv]))
    if cfg.out is not None:  # before the run, not after it
        try:
            cfg.out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CliError(f"--out {cfg.out}: {e.strerror or e}") from None
    return runner.main(cfg)


def cmd_bench_served(args: argparse.Namespace, argv: Sequence[str]) -> int:
    import importlib.util

    from graphcap.bench import served

    try:
        cfg = served.config_from_args(args, " ".join([PROG, *argv]))
    except served.ServedBenchError as e:
        raise CliError(str(e)) from None
    if importlib.util.find_spec("sglang") is None:
        raise CliError("graphcap bench --served runs sglang's engine: sglang is not installed here")
    try:
        import torch

        cuda = torch.cuda.is_available()
    except ModuleNotFoundError:
        cuda = False
    if not cuda:
        raise CliError("graphcap bench --served runs sglang's engine, which needs a CUDA GPU; this machine has none "
                       "(graphcap bench without --served times the library's reference loop here)")
    if cfg.out is not None:
        try:
            cfg.out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CliError(f"--out {cfg.out}: {e.strerror or e}") from None
    return served.main(cfg)


if __name__ == "__main__":
    sys.exit(main())
