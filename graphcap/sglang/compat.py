"""What differs between the sglang versions graphcap's plugin serves, found by feature, in one place.

Each function tries sglang 0.5.23's layout, then 0.5.18's, and raises `SglangLayoutError` naming both where neither
is there (an sglang neither layout describes: graphcap must not guess). No version string decides anything here;
the version is read only to refuse an sglang outside `TESTED_SGLANG` at start-up (`config.check_sglang_version`).

What each function stands for (docs/sglang.md, "Supported sglang versions and GPUs"):
- `slot_of`: a request's request-pool row, `req.kv.req_pool_idx` (0.5.23) or `req.req_pool_idx` (0.5.18);
- `swa_evicted_len`: how far its SWA pages are freed, `req.kv.get_evicted_seqlen(SWA)` (0.5.23) or
  `req.kv.swa_evicted_seqlen` (0.5.18, where `req.kv` is None while the request holds no KV);
- `resolution_reader`: a server-arguments field as sglang's resolution left it, and whether resolution finished:
  `resolution_result` / `_resolution_finished` (0.5.23), `resolved_view` / `_declarations_materialized` (0.5.18);
- `gathers_draft_inputs`: sglang's `require_gathered_buffer`, which takes no argument (0.5.23) or the server
  arguments (0.5.18);
- `translates_kv_locations`: whether req_to_token holds virtual ids (the unified pool): the draft runner's
  `kv_index_translator` (0.5.23) or the Triton backend's `_translate_kv_loc` hook (0.5.18);
- `layer_boundary_owners`: the residual-stream bookkeeping Dynamo must not trace (0.5.23's
  `sglang.srt.layers.layer_boundary`; 0.5.18 has none, its layers run plain adds and norms);
- `sglang_window_indices`: sglang's own Triton-backend window gather (`update_sliding_window_buffer`, over a
  `KVIndexTranslator` in 0.5.23, over req_to_token in 0.5.18) - the reference graphcap's window is tested against.

Imports nothing of the plugin (the plugin's modules import this one), and sglang only inside the functions.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import inspect
from collections.abc import Callable
from typing import Any

# The sglang releases the plugin's tests run against (CPU: both real packages; GPU: the engine checks).
TESTED_SGLANG = ("0.5.18", "0.5.23")


class DraftCaptureConfigError(ValueError):
    """A configuration graphcap's plugin cannot serve - a flag, an sglang setting, an environment variable's value;
    names it."""


class SglangLayoutError(DraftCaptureConfigError):
    """The installed sglang keeps something graphcap reads in neither layout it knows; names both."""


def _neither(what: str, new: str, old: str) -> SglangLayoutError:
    return SglangLayoutError(f"graphcap: sglang {sglang_version() or '(version unknown)'} has {what} neither as "
                             f"{new} (sglang 0.5.23) nor as {old} (sglang 0.5.18); graphcap does not know this "
                             f"layout (tested: sglang {', '.join(TESTED_SGLANG)})")


# -----------------------------------------------------------------------------------------------------------------
# The installed version (the start-up check refuses one outside TESTED_SGLANG: config.check_sglang_version)


def sglang_version() -> str | None:
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


# -----------------------------------------------------------------------------------------------------------------
# Requests


def slot_of(req) -> int | None:
    """The request's row in the request pool (None while it holds none)."""
    try:
        return req.kv.req_pool_idx  # 0.5.23: ReqKvInfo, always present
    except AttributeError:
        pass
    try:
        return req.req_pool_idx  # 0.5.18: on the request
    except AttributeError:
        raise _neither("a request's pool row", "req.kv.req_pool_idx", "req.req_pool_idx") from None


def swa_evicted_len(req) -> int | None:
    """How far (absolute position) the request's SWA pages have been freed; None where it holds no KV."""
    kv = getattr(req, "kv", None)
    get = getattr(kv, "get_evicted_seqlen", None)
    if get is not None:  # 0.5.23
        from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

        return int(get(ComponentType.SWA))
    if kv is not None and hasattr(kv, "swa_evicted_seqlen"):  # 0.5.18
        return int(kv.swa_evicted_seqlen)
    if kv is None and hasattr(req, "req_pool_idx"):  # 0.5.18, a request holding no KV: nothing was freed
        return None
    raise _neither("a request's SWA eviction frontier", "req.kv.get_evicted_seqlen(ComponentType.SWA)",
                   "req.kv.swa_evicted_seqlen")


# -----------------------------------------------------------------------------------------------------------------
# Server arguments


def resolution_reader(server_args) -> tuple[Callable[..., Any], bool]:
    """(get(field, default=None), resolved): a field as sglang's argument resolution decided it (or its raw value
    before), and whether the resolution has finished on this record."""
    from sglang.srt.arg_groups import overrides

    result = getattr(overrides, "resolution_result", None)
    if result is not None:  # 0.5.23: declarations stashed on the record, read back per field
        return ((lambda name, default=None: result(server_args, name, default)),
                bool(getattr(server_args, "_resolution_finished", False)))
    view_of = getattr(overrides, "resolved_view", None)
    if view_of is not None:  # 0.5.18: the declarations overlaid on the fields (applied to them once materialized)
        view = view_of(server_args)
        return ((lambda name, default=None: getattr(view, name, default)),
                bool(getattr(server_args, "_declarations_materialized", False)))
    raise _neither("the reader of its resolved arguments", "overrides.resolution_result", "overrides.resolved_view")


def gathers_draft_inputs(server_args) -> bool:
    """sglang's `require_gathered_buffer()`: the draft's inputs are gathered across ranks (attention DP, a MoE
    all-to-all / dense-TP layout)."""
    from sglang.srt.utils import require_gathered_buffer

    takes = [p for p in inspect.signature(require_gathered_buffer).parameters.values()
             if p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if not takes:  # 0.5.23: reads the published runtime context
        return bool(require_gathered_buffer())
    if len(takes) == 1:  # 0.5.18: reads the server arguments
        return bool(require_gathered_buffer(server_args))
    raise _neither(f"require_gathered_buffer{inspect.signature(require_gathered_buffer)}", "require_gathered_buffer()",
                   "require_gathered_buffer(server_args)")


# -----------------------------------------------------------------------------------------------------------------
# The draft worker


def translates_kv_locations(worker) -> bool:
    """Whether req_to_token holds virtual ids translated through page tables (the unified pool,
    --enable-unified-memory), which graphcap's window buffers cannot read."""
    translator = getattr(worker.draft_model_runner, "kv_index_translator", None)
    if translator is not None:  # 0.5.23
        return bool(translator.is_translating)
    backend = worker.draft_attn_backend
    if hasattr(backend, "_translate_kv_loc"):  # 0.5.18: the Triton backend's v2p hook, None without the pool
        return backend._translate_kv_loc is not None
    raise _neither("the unified pool's marker", "draft_model_runner.kv_index_translator",
                   "the Triton backend's _translate_kv_loc")


LAYER_BOUNDARY_PACKAGE = "sglang.srt.layers.layer_boundary"


def layer_boundary_owners(entries) -> list[tuple[object, str, str]]:
    """(owner, attribute, dotted name) of each of `entries` ((module, class or None, attribute)), the residual-stream
    bookkeeping sglang 0.5.23's layers call; [] where sglang has no layer-boundary package (0.5.18: its layers add
    and normalise in place, nothing Dynamo cannot trace). A missing entry of a package that exists is named."""
    try:
        importlib.import_module(LAYER_BOUNDARY_PACKAGE)
    except ModuleNotFoundError as e:
        if e.name == LAYER_BOUNDARY_PACKAGE:
            return []
        raise
    owners = []
    for module_name, cls_name, attr in entries:
        owner = importlib.import_module(module_name)
        if cls_name is not None:
            owner = getattr(owner, cls_name, None)
        where = ".".join(p for p in (module_name, cls_name, attr) if p)
        if owner is None or attr not in vars(owner):
            raise SglangLayoutError(f"graphcap: sglang {sglang_version()} has {LAYER_BOUNDARY_PACKAGE} but no {where} "
                                    "to run eagerly under torch.compile (written against sglang 0.5.23's layer "
                                    "boundary)")
        owners.append((owner, attr, where))
    return owners


# -----------------------------------------------------------------------------------------------------------------
# sglang's own window gather (the reference for graphcap's window buffers)


def sglang_window_indices(req_to_token, swa_pool, slots, seq_lens, window: int, page_size: int):
    """sglang's Triton backend's sliding-window gather for `slots` at `seq_lens`: (indptr [B + 1], SWA-pool ids),
    the last min(seq_len, window) locations of each row translated through `swa_pool`'s full_to_swa mapping."""
    import torch
    from sglang.srt.layers.attention.triton_backend import update_sliding_window_buffer

    bs = int(slots.shape[0])
    indptr = torch.zeros(req_to_token.shape[0] + 1, dtype=torch.int32, device=req_to_token.device)
    params = inspect.signature(update_sliding_window_buffer).parameters
    if "translator" in params:  # 0.5.23: req_to_token behind a KVIndexTranslator (plan None: a static pool)
        from sglang.srt.mem_cache.kv_index_translator import KVIndexTranslator

        translator = KVIndexTranslator(req_to_token=req_to_token, token_to_kv_pool_allocator=object(),
                                       token_to_kv_pool=swa_pool, page_size=page_size, device=req_to_token.device)
        out = update_sliding_window_buffer(indptr, translator, None, slots, window, seq_lens, bs,
                                           req_to_token.device, swa_pool)
    elif "req_to_token" in params:  # 0.5.18
        out = update_sliding_window_buffer(indptr, req_to_token, window, seq_lens, slots, bs, req_to_token.device,
                                           swa_pool)
    else:
        raise _neither(f"update_sliding_window_buffer{inspect.signature(update_sliding_window_buffer)}",
                       "update_sliding_window_buffer(indptr, translator, plan, ...)",
                       "update_sliding_window_buffer(indptr, req_to_token, ...)")
    return out[0], out[1]
