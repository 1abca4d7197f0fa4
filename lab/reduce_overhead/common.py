"""What the standalone reproductions share: the CUDA check that skips cleanly, the CUDA-graph tree's counters, and
the JSON record. Plain torch, no sglang, no graphcap."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch


def parser(doc: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="write the result record (JSON) here")
    ap.add_argument("--iters", type=int, default=200, help="served calls")
    ap.add_argument("--seed", type=int, default=0)
    return ap


def skip_without_cuda(name: str) -> None:
    """Exit 0 with one line where there is no CUDA: these reproductions need CUDA graphs."""
    if not torch.cuda.is_available():
        print(f"SKIP {name}: needs CUDA (torch {torch.__version__} sees no GPU)")
        sys.exit(0)


def tree_counters() -> dict:
    """The CUDA-graph tree manager's counters on the current device (None before any reduce-overhead call)."""
    from torch._inductor import cudagraph_trees as ct
    from torch._dynamo.utils import counters

    m = ct.get_manager(torch.cuda.current_device(), create_if_none_exists=False)
    out = {"cudagraph_skips": counters["inductor"]["cudagraph_skips"]}
    if m is not None:
        out.update(warmed_up_functions=len(m.warmed_up_functions), re_records=m.debug_fail_counter,
                   checkpoints=m.debug_checkpointing_counter, tree_stream=m.stream.cuda_stream)
    return out


def finish(record: dict, out: str | None) -> int:
    """Print the verdict line and the record; 1 where the hypothesis showed (stale data, mismatch), else 0."""
    print(json.dumps(record, indent=1, default=repr))
    print(("REPRODUCED: " if record["reproduced"] else "not reproduced: ") + record["verdict"])
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(record, indent=1, default=repr))
    return 1 if record["reproduced"] else 0
