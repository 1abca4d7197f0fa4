"""Capture specs: one TOML file per model/draft pair, loaded into frozen dataclasses.

The file's schema is declared once, on the dataclasses themselves (pydantic validates them: types, bounds, allowed
values, unknown keys); the relations between fields are checked after. Every problem is a `SpecError` whose message
names the file, the field (dotted path) and the reason, so a user editing a spec never sees a KeyError from deep
inside the loader.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, ValidationError, with_config

from graphcap.backends import GRAPH_BACKENDS, SPEC_DEFAULT_BACKEND
from graphcap.errors import GraphcapInputError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

SPEC_DIR = Path(__file__).resolve().parent / "capture_specs"
LAYER_TYPES = ("sliding", "full")
DTYPES = ("float32", "float16", "bfloat16")
HEAD_KINDS = ("full", "centroid")

# Field types of the schema. Strict: TOML's `16` and `"16"` and `true` are different things, and only the first is
# an integer.
Positive = Annotated[int, Strict(), Field(ge=1)]
NonNegative = Annotated[int, Strict(), Field(ge=0)]
Name = Annotated[str, Strict(), Field(min_length=1)]
_STRICT = ConfigDict(extra="forbid")


class SpecError(GraphcapInputError):
    """A capture spec is malformed. `str(err)` is `<file>: <field>: <reason>`."""


@with_config(_STRICT)
@dataclass(frozen=True)
class AttentionShape:
    kv_heads: Positive
    head_dim: Positive


@with_config(_STRICT)
@dataclass(frozen=True)
class TargetShape:
    hidden: Positive
    layers: Positive
    sliding_per_full: Positive  # Gemma 4: five sliding layers per full-attention layer


@with_config(_STRICT)
@dataclass(frozen=True)
class DraftShape:
    hidden: Positive
    layers: Annotated[tuple[Literal[LAYER_TYPES], ...], Field(min_length=1)]  # "sliding" / "full" per draft layer
    heads: Positive  # query heads, every layer
    intermediate: Positive  # gated MLP width
    vocab: Positive
    head: Literal[HEAD_KINDS] = "full"  # "full": full-vocab LM head; "centroid": Gemma 4 assistant's clustered head
    centroids: NonNegative = 0  # 0 unless head == "centroid"
    centroid_top_k: NonNegative = 0  # clusters kept per step, 0 unless head == "centroid"


@with_config(_STRICT)
@dataclass(frozen=True)
class CaptureSettings:
    steps: Positive  # draft steps per iteration
    top_k: Positive  # 1: a chain; trees are not supported
    buckets: Annotated[tuple[Positive, ...], Field(min_length=1)]  # batch sizes captured, strictly increasing
    max_slots: Positive  # request-pool rows (sglang's max_running_requests)
    max_context: Positive  # req_to_token row width
    backend: Literal[GRAPH_BACKENDS] = SPEC_DEFAULT_BACKEND  # graphcap.backends describes each


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


class _Window(BaseModel):
    model_config = _STRICT
    size: Positive
    page_size: Positive


class _Attention(BaseModel):
    model_config = _STRICT
    sliding: AttentionShape
    full: AttentionShape


class _SpecFile(BaseModel):
    """The file's layout (its tables); `CaptureSpec` flattens `window` and `attention`."""
    model_config = _STRICT
    name: Name
    model: Name
    draft_model: Name
    dtype: Literal[DTYPES]
    target: TargetShape
    window: _Window
    draft: DraftShape
    attention: _Attention
    capture: CaptureSettings


def load_spec(path: str | Path) -> CaptureSpec:
    """Load and validate a capture spec. `path` is a file, or the name of a built-in spec (`tiny`, ...)."""
    p = resolve_spec_path(path)
    source = str(p)
    try:
        text = p.read_text()
    except OSError as e:
        builtin = f" (built-in specs: {', '.join(f.stem for f in builtin_specs())})" if not p.exists() else ""
        raise SpecError(source, "<file>", f"cannot read: {e.strerror or e}{builtin}") from None
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
    """Validate a spec's TOML content (a dict) into a `CaptureSpec`; every problem is a `SpecError`."""
    try:
        f = _SpecFile.model_validate(data)
    except ValidationError as e:
        raise SpecError.from_validation(source, e) from None
    problem = _relations(f)
    if problem:
        raise SpecError(source, *problem)
    return CaptureSpec(f.name, f.model, f.draft_model, f.window.size, f.window.page_size, f.dtype, f.target, f.draft,
                       f.attention.sliding, f.attention.full, f.capture, source)


def _relations(f: _SpecFile) -> tuple[str, str] | None:
    """The first (field, reason) whose value is valid alone but not beside the others; None when all agree."""
    d, c = f.draft, f.capture
    if d.head == "centroid":
        if d.centroids < 1:
            return "draft.centroids", "must be >= 1 when head = \"centroid\""
        if d.vocab % d.centroids:
            return "draft.centroids", f"must divide vocab {d.vocab}, got {d.centroids}"
        if not 1 <= d.centroid_top_k <= d.centroids:
            return "draft.centroid_top_k", f"must be in [1, centroids={d.centroids}], got {d.centroid_top_k}"
    elif d.centroids or d.centroid_top_k:
        return "draft.centroids", "only meaningful with head = \"centroid\""
    for lt in LAYER_TYPES:
        kv_heads = getattr(f.attention, lt).kv_heads
        if d.heads % kv_heads:
            return f"attention.{lt}.kv_heads", f"must divide draft.heads={d.heads}, got {kv_heads}"
        head_dim = getattr(f.attention, lt).head_dim
        if head_dim % 2:
            return f"attention.{lt}.head_dim", f"must be even (rotary turns pairs of halves), got {head_dim}"
    if c.top_k != 1:
        return "capture.top_k", f"only 1 (a chain draft) is supported, got {c.top_k}"
    if any(b <= a for a, b in zip(c.buckets, c.buckets[1:])):
        return "capture.buckets", f"must be strictly increasing, got {list(c.buckets)}"
    if c.buckets[-1] > c.max_slots:
        return "capture.buckets", f"largest bucket {c.buckets[-1]} exceeds capture.max_slots={c.max_slots}"
    return None
