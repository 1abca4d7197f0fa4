"""Capture specs: one TOML file per model/draft pair, loaded into frozen dataclasses.

Every problem with a spec is a `SpecError` whose message names the file, the field (dotted path) and the reason,
so a user editing a spec never sees a KeyError from deep inside the loader.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

SPEC_DIR = Path(__file__).resolve().parent / "capture_specs"
LAYER_TYPES = ("sliding", "full")
DTYPES = ("float32", "float16", "bfloat16")
# The backends, listed here only (spec files, DraftGraphs, manifests and the sglang flag all read them).
# GRAPH_BACKENDS record CUDA graphs: what a spec or the sglang flag may pick. ALL_BACKENDS adds the two that record
# none ("compile": Inductor alone, the reference and the CPU path; "eager"): what DraftGraphs runs, a manifest names.
GRAPH_BACKENDS = ("reduce-overhead", "inductor-cudagraph", "cudagraph")
ALL_BACKENDS = GRAPH_BACKENDS + ("compile", "eager")
DEFAULT_BACKEND = "inductor-cudagraph"
HEAD_KINDS = ("full", "centroid")


class SpecError(ValueError):
    """A capture spec is malformed. `str(err)` is `<file>: <field>: <reason>`."""

    def __init__(self, source: str, field: str, reason: str) -> None:
        self.source, self.field, self.reason = source, field, reason
        super().__init__(f"{source}: {field}: {reason}")


@dataclass(frozen=True)
class AttentionShape:
    kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class TargetShape:
    hidden: int
    layers: int
    sliding_per_full: int  # Gemma 4: five sliding layers per full-attention layer


@dataclass(frozen=True)
class DraftShape:
    hidden: int
    layers: tuple[str, ...]  # "sliding" / "full" per draft layer
    heads: int  # query heads, every layer
    intermediate: int  # gated MLP width
    vocab: int
    head: str  # "full": full-vocab LM head; "centroid": Gemma 4 assistant's clustered head
    centroids: int  # 0 unless head == "centroid"
    centroid_top_k: int  # clusters kept per step, 0 unless head == "centroid"


@dataclass(frozen=True)
class CaptureSettings:
    steps: int  # draft steps per iteration
    top_k: int  # 1: a chain; trees are not supported
    buckets: tuple[int, ...]  # batch sizes captured, strictly increasing
    max_slots: int  # request-pool rows (sglang's max_running_requests)
    max_context: int  # req_to_token row width
    backend: str  # "reduce-overhead", "inductor-cudagraph" (Inductor code in torch.cuda.CUDAGraph) or "cudagraph"


@dataclass(frozen=True)
class CaptureSpec:
    name: str
    model: str
    draft_model: str
    window: int  # sliding window W (tokens a sliding layer attends to, the query's own included)
    page_size: int
    dtype: str
    target: TargetShape
    draft: DraftShape
    sliding: AttentionShape
    full: AttentionShape
    capture: CaptureSettings
    source: str = ""  # file it came from; not part of the hash

    @property
    def hash(self) -> str:
        """Content hash (sha256 prefix) of everything but `source`: comments and key order do not change it."""
        body = dataclasses.asdict(self)
        body.pop("source")
        return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]

    def attention(self, layer_type: str) -> AttentionShape:
        return self.sliding if layer_type == "sliding" else self.full

    def torch_dtype(self):  # -> torch.dtype; torch imported lazily so `graphcap specs` stays light
        import torch

        return getattr(torch, self.dtype)


# ---------------------------------------------------------------------------------------------------------------
# Loading and validation


class _Reader:
    """Pulls typed fields out of one TOML table, remembering which keys were used so unknown ones are errors."""

    def __init__(self, source: str, table: dict[str, Any], prefix: str) -> None:
        self.source, self.table, self.prefix, self.used = source, table, prefix, set()

    def _name(self, key: str) -> str:
        return f"{self.prefix}{key}"

    def fail(self, key: str, reason: str) -> SpecError:
        return SpecError(self.source, self._name(key), reason)

    def raw(self, key: str, default: Any = ...) -> Any:
        self.used.add(key)
        if key not in self.table:
            if default is ...:
                raise self.fail(key, "missing")
            return default
        return self.table[key]

    def str(self, key: str, choices: tuple[str, ...] | None = None, default: Any = ...) -> str:
        v = self.raw(key, default)
        if not isinstance(v, str) or not v:
            raise self.fail(key, f"expected a non-empty string, got {v!r}")
        if choices is not None and v not in choices:
            raise self.fail(key, f"unknown value {v!r}; expected one of {', '.join(choices)}")
        return v

    def int(self, key: str, minimum: int = 1, default: Any = ...) -> int:
        v = self.raw(key, default)
        if isinstance(v, bool) or not isinstance(v, int):
            raise self.fail(key, f"expected an integer, got {v!r}")
        if v < minimum:
            raise self.fail(key, f"must be >= {minimum}, got {v}")
        return v

    def int_list(self, key: str) -> tuple[int, ...]:
        v = self.raw(key)
        if not isinstance(v, list) or not v:
            raise self.fail(key, f"expected a non-empty list of integers, got {v!r}")
        for i, x in enumerate(v):
            if isinstance(x, bool) or not isinstance(x, int) or x < 1:
                raise SpecError(self.source, f"{self._name(key)}[{i}]", f"expected a positive integer, got {x!r}")
        return tuple(v)

    def table_of(self, key: str) -> _Reader:
        v = self.raw(key)
        if not isinstance(v, dict):
            raise self.fail(key, f"expected a table, got {v!r}")
        return _Reader(self.source, v, f"{self._name(key)}.")

    def done(self) -> None:
        unknown = sorted(set(self.table) - self.used)
        if unknown:
            raise self.fail(unknown[0], "unknown key")


def load_spec(path: str | Path) -> CaptureSpec:
    """Load and validate a capture spec. `path` is a file, or the name of a built-in spec (`tiny`, ...)."""
    p = resolve_spec_path(path)
    source = str(p)
    try:
        text = p.read_text()
    except OSError as e:
        raise SpecError(source, "<file>", f"cannot read: {e.strerror or e}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise SpecError(source, "<toml>", str(e)) from None
    return parse_spec(data, source)


def resolve_spec_path(path: str | Path) -> Path:
    p = Path(path)
    if not p.exists() and p.suffix == "" and (SPEC_DIR / f"{p.name}.toml").exists():
        return SPEC_DIR / f"{p.name}.toml"
    return p


def builtin_specs() -> list[Path]:
    return sorted(SPEC_DIR.glob("*.toml"))


def parse_spec(data: dict[str, Any], source: str = "<spec>") -> CaptureSpec:
    top = _Reader(source, data, "")
    name, model, draft_model = top.str("name"), top.str("model"), top.str("draft_model")
    dtype = top.str("dtype", DTYPES)

    t = top.table_of("target")
    target = TargetShape(t.int("hidden"), t.int("layers"), t.int("sliding_per_full"))
    t.done()

    w = top.table_of("window")
    window, page_size = w.int("size"), w.int("page_size")
    w.done()

    d = top.table_of("draft")
    layers_raw = d.raw("layers")
    if not isinstance(layers_raw, list) or not layers_raw:
        raise d.fail("layers", f"expected a non-empty list of layer types, got {layers_raw!r}")
    for i, lt in enumerate(layers_raw):
        if lt not in LAYER_TYPES:
            raise SpecError(source, f"draft.layers[{i}]", f"unknown layer type {lt!r}; expected one of {', '.join(LAYER_TYPES)}")
    head = d.str("head", HEAD_KINDS, default="full")
    draft = DraftShape(
        hidden=d.int("hidden"), layers=tuple(layers_raw), heads=d.int("heads"), intermediate=d.int("intermediate"),
        vocab=d.int("vocab"), head=head,
        centroids=d.int("centroids", minimum=0, default=0), centroid_top_k=d.int("centroid_top_k", minimum=0, default=0),
    )
    d.done()
    if head == "centroid":
        if draft.centroids < 1:
            raise SpecError(source, "draft.centroids", "must be >= 1 when head = \"centroid\"")
        if draft.vocab % draft.centroids:
            raise SpecError(source, "draft.centroids", f"must divide vocab {draft.vocab}, got {draft.centroids}")
        if not 1 <= draft.centroid_top_k <= draft.centroids:
            raise SpecError(source, "draft.centroid_top_k", f"must be in [1, centroids={draft.centroids}], got {draft.centroid_top_k}")
    elif draft.centroids or draft.centroid_top_k:
        raise SpecError(source, "draft.centroids", "only meaningful with head = \"centroid\"")

    a = top.table_of("attention")
    shapes = {}
    for lt in LAYER_TYPES:
        s = a.table_of(lt)
        shapes[lt] = AttentionShape(s.int("kv_heads"), s.int("head_dim"))
        s.done()
        if draft.heads % shapes[lt].kv_heads:
            raise SpecError(source, f"attention.{lt}.kv_heads", f"must divide draft.heads={draft.heads}, got {shapes[lt].kv_heads}")
    a.done()

    c = top.table_of("capture")
    cap = CaptureSettings(
        steps=c.int("steps"), top_k=c.int("top_k"), buckets=c.int_list("buckets"), max_slots=c.int("max_slots"),
        max_context=c.int("max_context"), backend=c.str("backend", GRAPH_BACKENDS, default=DEFAULT_BACKEND),
    )
    c.done()
    if cap.top_k != 1:
        raise SpecError(source, "capture.top_k", f"only 1 (a chain draft) is supported, got {cap.top_k}")
    if any(b <= a_ for a_, b in zip(cap.buckets, cap.buckets[1:])):
        raise SpecError(source, "capture.buckets", f"must be strictly increasing, got {list(cap.buckets)}")
    if cap.buckets[-1] > cap.max_slots:
        raise SpecError(source, "capture.buckets", f"largest bucket {cap.buckets[-1]} exceeds capture.max_slots={cap.max_slots}")
    top.done()
    return CaptureSpec(name, model, draft_model, window, page_size, dtype, target, draft, shapes["sliding"], shapes["full"], cap, source)
