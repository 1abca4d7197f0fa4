"""The bench's records: one `BenchRow` per (batch, context, steps, mode), and the `BenchResult` of a run. A value
that could not be measured here is None, with the reason beside it (`*_how`, `notes`)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class BenchRow:
    batch: int
    context: int
    steps: int
    mode: str
    window: int
    wall_ms: float  # median per iteration: the call and the sync that ends it
    wall_p90_ms: float
    host_ms: float  # median time until the call returned
    gpu_ms: float | None  # median CUDA-event time of the call; None without CUDA
    iter_per_s: float  # 1000 / wall_ms
    syncs_per_iter: int | None
    syncs_how: str  # how they were counted, or why not
    kernels_per_iter: int | None
    kernels_how: str
    capture_s: float  # compile/record time of the mode for this steps value (all its buckets)
    samples: int
    floor_ms: float | None = None  # bandwidth floor (CUDA: copy bandwidth measured in the run)
    x_floor: float | None = None
    x_eager_rebuild: float | None = None  # graphcap's speed-up over each baseline (graphcap's row only)
    x_graph_rebuild: float | None = None
    x_sglang: float | None = None
    x_compile: float | None = None
    x_compile_nosync: float | None = None
    x_compile_plain: float | None = None
    x_compile_tuned: float | None = None
    x_per_bucket: float | None = None  # over graphcap itself compiled once per bucket (graphcap-per-bucket)
    x_skinny_gemm: float | None = None  # over graphcap with its skinny GEMM (graphcap-skinny-gemm): < 1, it wins
    x_inlined_layers: float | None = None  # over graphcap with its layers inlined (graphcap-inlined-layers)
    x_torch_ops: float | None = None  # over graphcap with the layer's small ops as torch ops (graphcap-torch-ops)
    x_skinny_4rows: float | None = None  # over graphcap with every shape's skinny GEMM up to 4 rows only
    x_qnorm_kernel: float | None = None  # over graphcap with the query's norm + rotary as its own kernel
    x_two_head_proj: float | None = None  # over graphcap with post_proj and the centroid scores as two GEMMs
    util_pct: float | None = None  # NVML, mean over the measured iterations
    power_w: float | None = None
    sm_mhz: float | None = None
    note: str = ""  # what this mode ran here, where it differs from its description (e.g. a CPU's twins)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


SPEEDUP_FIELDS = {"eager-rebuild": "x_eager_rebuild", "graph-rebuild": "x_graph_rebuild", "sglang": "x_sglang",
                  "compile": "x_compile", "compile-nosync": "x_compile_nosync",
                  "compile-plain": "x_compile_plain", "compile-tuned": "x_compile_tuned",
                  "graphcap-per-bucket": "x_per_bucket",
                  "graphcap-skinny-gemm": "x_skinny_gemm", "graphcap-inlined-layers": "x_inlined_layers",
                  "graphcap-torch-ops": "x_torch_ops", "graphcap-skinny-4rows": "x_skinny_4rows",
                  "graphcap-qnorm-kernel": "x_qnorm_kernel", "graphcap-two-head-proj": "x_two_head_proj"}


@dataclass(frozen=True)
class BenchResult:
    environment: dict[str, Any]
    config: dict[str, Any]
    rows: tuple[BenchRow, ...]
    captures_s: dict[str, dict[str, float]]  # steps -> mode -> seconds
    copy_gb_s: float | None
    notes: tuple[str, ...]
    wall_s: float  # the whole run, imports excluded

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["rows"] = [r.as_dict() for r in self.rows]
        return d
