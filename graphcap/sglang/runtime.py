"""graphcap inside sglang's scheduler process: the draft phase of FROZEN_KV_MTP with graphcap's window buffers and
capture engine. Driven by the hooks in `graphcap.sglang.hooks`. CPU tests run the slot bookkeeping, the
window equivalence, the tree inputs and `iterate` against sglang's own code; sglang's engine on a GPU runs all of it
with the assistant's model (docs/results.md, "In sglang's engine").

Per iteration, instead of sglang's `FrozenKVMTPDraftWorker.draft` (`GraphcapDraftRuntime.iterate`):
1. host: rows whose request is new to the row, was retracted, or lost in-window SWA pages are rebuilt
   (`WindowBuffers.reset`: one sync, rebuild iterations only);
2. device: the rows (sglang's `req_pool_indices`), seed tokens and hidden states go straight into the bucket's static
   inputs in one copy - no host-to-device copy, no temporary, no sync;
3. one replay of graphcap's captured iteration: the accepted counts the verifies left per row (scattered by
   `on_accept`) taken and cleared, `window.advance(slots, accepted)`, then the seed step and the other steps of
   sglang's own assistant model, its attention reading graphcap's ring (sliding layers) and `req_to_token` (full
   layers) through graphcap's decode kernel;
4. the chain's tree inputs go to sglang's own `build_tree_kernel_efficient` and `FrozenKVMTPVerifyInput`. The tree
   mask is written into the target backend's preallocated verify mask (or sized from an upper bound), as sglang's
   EAGLE v2 worker does, instead of sizing it from a `seq_lens.sum().item()` sync (`verify_tree_mask`): with the
   triton backend the overlap scheduler hands the draft no host lengths, and that sync made every draft call wait
   for the verify before it.
"""
from __future__ import annotations

import atexit
import contextlib
import logging
import os
import weakref
from collections.abc import Sequence
from types import SimpleNamespace

import torch

from graphcap import manifest as mf
from graphcap.backends import COMPILED_BACKENDS
from graphcap.engine.capture import DraftGraphs
from graphcap.engine.options import CaptureOptions
from graphcap.engine.guards import CaptureError
from graphcap.sglang import linear as sglang_linear
from graphcap.sglang import variants
from graphcap.sglang.compat import DraftCaptureConfigError, gathers_draft_inputs, translates_kv_locations
from graphcap.sglang.config import FLAG, compile_scope_refusal, sglang_parallel
from graphcap.sglang.settings import CHECK_ENV, DraftCaptureOptions, PluginSettings, plugin_settings
from graphcap.sglang.loop import GraphcapDraftAttention, SglangAssistantLoop
from graphcap.sglang.slots import SlotTracker, bind_window, slot_of  # noqa: F401 - bind_window re-exported
from graphcap.engine.iteration import DraftOutput
from graphcap.kernels.gemm.skinny import KERNEL_ROWS
from graphcap.engine.observers import CaptureObserver, LoggingProgress
from graphcap.window import WindowBuffers

log = logging.getLogger("graphcap.sglang")


# -----------------------------------------------------------------------------------------------------------------
# graphcap's capture engine over sglang's tables (the window buffers: slots.bind_window)


def capture_graphs(window: WindowBuffers, fn, *, buckets: Sequence[int], example_inputs, static_tensors, backend: str,
                   manifest_dir: str | None, name: str, steps: int, parallel: mf.Parallel | None = None,
                   flush_every_s: float = PluginSettings.manifest_flush_s) -> DraftGraphs:
    """Capture `fn` per bucket. Every process writes a manifest of its own, its ranks in the file and in the file's
    name (`parallel`, None: `sglang_parallel()`, sglang's runtime context): `...-tp1.json` under tensor parallelism,
    `...-dp1-tp0.json` with data-parallel replicas too, the plain single-GPU name where nothing is split (or sglang
    says nothing). A bucket that fails on one rank only is then in that rank's file, and `graphcap inspect` over the
    directory says where the ranks disagree. Progress goes to the server's log (`graphcap.sglang`), and the counters
    since the last timed flush are written when the scheduler process exits (the plugin registers that here: the
    library registers no exit hooks). `flush_every_s`: seconds between manifest writes (the runtime passes
    $GRAPHCAP_MANIFEST_FLUSH_S's)."""
    parallel = sglang_parallel() if parallel is None else parallel
    # Not a capture spec (sglang's model defines the draft): a stand-in with the fields a manifest records.
    spec = SimpleNamespace(name=name, hash=f"w{window.window}-s{steps}", source="sglang", window=window.window,
                           capture=SimpleNamespace(steps=steps), parallel=parallel)
    path = mf.manifest_path(manifest_dir or mf.default_manifest_dir(), name, spec.hash, backend, parallel)
    options = CaptureOptions(backend=backend, buckets=tuple(buckets), manifest_path=path, flush_every_s=flush_every_s)
    graphs = DraftGraphs(fn, example_inputs=example_inputs, static_tensors=static_tensors,
                         padding_slot=window.padding_slot, options=options, spec=spec,
                         observers=[LoggingProgress(log)])
    graphs.capture()
    atexit.register(_flush_at_exit, weakref.ref(graphs))  # weak: a replaced DraftGraphs is not kept alive
    return graphs


def _flush_at_exit(ref: weakref.ref) -> None:
    graphs = ref()
    if graphs is not None and graphs.captured:
        try:
            graphs.flush()
        except OSError as e:  # never turn interpreter exit into a traceback
            log.warning("graphcap: could not write manifest %s at exit: %s", graphs.manifest_path, e)


class SaveVariants(CaptureObserver):
    """At each manifest flush (and so at exit), the kernel variants compiled while serving into the variants file."""

    def __init__(self, vlog: variants.VariantLog, path) -> None:
        self.vlog, self.path = vlog, path

    def on_flush(self, manifest: mf.Manifest) -> None:
        self.vlog.save(self.path)


def check_lengths(window: WindowBuffers, batch, host_slots: list[int]) -> None:
    """GRAPHCAP_SGLANG_CHECK=1, after the replay: graphcap's window lengths and every host length that goes on to
    sglang (`batch.seq_lens_sum`, `batch.seq_lens_cpu`, where the scheduler set them), and the rows replayed, must
    agree with `batch.seq_lens`, and every row's window ring must equal a rebuild from sglang's req_to_token and SWA
    mapping as they are now (`WindowBuffers.mismatches`). One sync (plus the host mirror's read); raises naming each
    field that disagreed."""
    seq_lens, rows_dev = batch.seq_lens, batch.req_pool_indices
    ours = window.seq_lens.index_select(0, rows_dev.to(window.device)).to(seq_lens.device, seq_lens.dtype)
    n_bad, first_bad = (t.to(seq_lens.device, seq_lens.dtype) for t in window.mismatches(rows_dev))
    theirs, lens, rows, n_bad, first_bad = torch.stack(
        [seq_lens, ours, rows_dev.to(seq_lens.device, seq_lens.dtype), n_bad, first_bad]).tolist()
    bad = []
    stale = [f"row {r}: {n} positions, the newest at {p}" for r, n, p in zip(rows, n_bad, first_bad) if n]
    if stale:
        bad.append("graphcap's window ring differs from req_to_token / full_to_swa as sglang holds them now ("
                   + "; ".join(stale) + ")")
    if rows != list(host_slots):
        bad.append(f"batch.req_pool_indices {rows} != the requests' req_pool_idx {list(host_slots)}")
    if lens != theirs:
        bad.append(f"graphcap's window lengths {lens} != batch.seq_lens {theirs}")
    cpu = getattr(batch, "seq_lens_cpu", None)
    if cpu is not None and cpu.tolist() != theirs:
        bad.append(f"batch.seq_lens_cpu {cpu.tolist()} != batch.seq_lens {theirs}")
    host_sum = getattr(batch, "seq_lens_sum", None)
    if host_sum is not None and host_sum != sum(theirs):
        bad.append(f"batch.seq_lens_sum {host_sum} != sum(batch.seq_lens) = {sum(theirs)}")
    if bad:
        raise RuntimeError(f"graphcap ({CHECK_ENV}=1), rows {list(host_slots)}: " + "; ".join(bad))


_TREE_INPUTS: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # (batch, steps, device) -> constant inputs


def chain_tree_inputs(draft_tokens: torch.Tensor):
    """(parent_list, top_scores_index, draft_tokens) exactly as sglang's `draft_forward` + `organize_draft_results`
    produce them for a chain (topk == 1): parents -1, 0, 1, ... (none for one step), every token selected in order.
    The two index tensors are contiguous and row-major - sglang's tree kernel checks their strides in every dimension
    of size > 1 (an `expand`ed view with stride 0 along the batch is refused) - and constants per batch size, made
    once; the draft tokens are passed as sglang's draft makes them (sglang copies them with torch.cat)."""
    b, steps = draft_tokens.shape
    dev = draft_tokens.device
    key = (b, steps, dev)
    const = _TREE_INPUTS.get(key)
    if const is None:
        parents = torch.arange(-1, steps - 1, device=dev) if steps > 1 else torch.empty(0, dtype=torch.long, device=dev)
        const = _TREE_INPUTS[key] = (parents.repeat(b, 1), torch.arange(steps, device=dev).repeat(b, 1))
    return const[0], const[1], draft_tokens.contiguous()


def verify_tree_mask(target_backend, bs: int, host_seq_lens_sum: int | None, default_mode, context_len: int):
    """(tree_mask_buf, mode, fill_prefix_mask, seq_lens_sum) for sglang's `build_tree_kernel_efficient`, without a
    device-to-host sync - sglang's EAGLE v2 draft tail (`eagle_worker_common`), which sglang's FROZEN_KV_MTP worker
    does not use: it sums `seq_lens` with `.item()` every iteration. The tree kernel writes each request's rows at
    offsets it computes on the GPU from `seq_lens`, and every reader (the target verify's mask_indptr, its graph's
    copy) does the same, so the mask may be larger than the batch needs: it goes straight into the target backend's
    preallocated verify mask where the batch fits it (`seq_lens_sum` then only 0), else it is allocated from the
    host's exact sum when the scheduler has one, or from `bs * context_len` (the backend's own bound where it has
    one, as sglang's EAGLE v2 takes it)."""
    verify_mask = getattr(target_backend, "verify_mask", None)
    if verify_mask is None:
        buf, mode, fill = None, default_mode, True
    else:
        mode, fill = verify_mask.mode, verify_mask.is_read
        buf = verify_mask.buffer if verify_mask.fits(bs) else None
    if host_seq_lens_sum is not None:
        return buf, mode, fill, int(host_seq_lens_sum)
    if buf is not None or mode.name == "QLEN_ONLY":  # preallocated, or sized from bs alone
        return buf, mode, fill, 0
    return buf, mode, fill, bs * int(getattr(target_backend, "max_context_len", None) or context_len)


# -----------------------------------------------------------------------------------------------------------------
# Per draft worker


class GraphcapDraftRuntime:
    def __init__(self, worker, options: DraftCaptureOptions, window: WindowBuffers, target_pool,
                 settings: PluginSettings | None = None) -> None:
        """`settings`: the environment's (None: this process's, `plugin_settings()`), taken once: the draft path
        reads no environment."""
        self.worker, self.options, self.window, self.target_pool = worker, options, window, target_pool
        self.settings = plugin_settings() if settings is None else settings
        self.check = self.settings.check  # every draft checked against sglang's own state (GRAPHCAP_SGLANG_CHECK)
        self.tracker = SlotTracker(window, checked=self.check)  # a joining request's rebuild: no sync unless checking
        self.steps = int(worker.speculative_num_steps)
        self.graphs: DraftGraphs | None = None
        self.max_bucket = 0
        self.active = False
        self.loop: SglangAssistantLoop | None = None  # set by capture(); tests attach graphs over other functions

    @classmethod
    def for_worker(cls, worker, options: DraftCaptureOptions, settings: PluginSettings | None = None):
        """Check the worker's real configuration: an error naming what graphcap cannot serve, None (with a warning)
        where staying off is safe, else a runtime bound to the target's req_to_token and SWA mapping."""
        from sglang.srt.model_executor.cuda_graph_config import cuda_graph_fully_disabled

        def stays_off(why):
            log.warning("graphcap: %s is set but %s; draft graph capture stays off.", FLAG, why)

        if int(worker.topk) != 1:
            raise DraftCaptureConfigError(f"{FLAG}: --speculative-eagle-topk must be 1, got {worker.topk}")
        backend = worker.draft_attn_backend
        if type(backend).__name__ != "TritonAttnBackend":
            raise DraftCaptureConfigError(
                f"{FLAG}: graphcap's kernels serve sglang's Triton attention layout; the draft runs on "
                f"{type(backend).__name__}. Use --attention-backend triton.")
        if translates_kv_locations(worker):
            raise DraftCaptureConfigError(f"{FLAG}: the unified KV pool (--enable-unified-memory) is not supported")
        if gathers_draft_inputs(worker.server_args):  # backstop: the start-up check refuses attention DP by its flags
            raise DraftCaptureConfigError(
                f"{FLAG}: sglang gathers the draft's inputs across ranks here (attention data parallelism, "
                "--attn-dp-size > 1, or a MoE all-to-all / --moe-dense-tp-size layout); this is not supported")
        window = (getattr(worker.draft_model_runner, "sliding_window_size", None)
                  or getattr(backend, "sliding_window_size", None))
        if not window or window < 1:
            raise DraftCaptureConfigError(f"{FLAG}: the draft model has no sliding window; graphcap serves SWA-hybrid "
                                          "drafts (Gemma 4 assistant)")
        target_pool = worker.target_worker.model_runner.token_to_kv_pool
        full_to_swa = getattr(target_pool, "full_to_swa_index_mapping", None)
        if full_to_swa is None and hasattr(target_pool, "translate_loc_from_full_to_swa"):
            raise DraftCaptureConfigError(f"{FLAG}: the target's SWA pool has no full_to_swa mapping registered")
        if worker.target_worker.device != "cuda":
            stays_off(f"the device is {worker.target_worker.device} (graphcap captures CUDA graphs)")
            return None
        if cuda_graph_fully_disabled():  # backstop: the start-up check refuses this; a record it missed stays off
            stays_off("sglang's cuda_graph_config disables CUDA graphs for decode and prefill")
            return None
        steps = int(worker.speculative_num_steps)
        buffers = bind_window(worker.req_to_token_pool.req_to_token, int(window), full_to_swa, max_accepted=steps + 1)
        return cls(worker, options, buffers, target_pool, settings)

    def capture(self) -> None:
        """Replaces the worker's `_capture_cuda_graphs` (called inside its TP/PP/MoE contexts)."""
        from sglang.srt.model_executor.runner import get_batch_sizes_to_capture

        w = self.worker
        attention = GraphcapDraftAttention(self.window, self.target_pool,
                                           int(w.target_worker.model_runner.model_config.context_len))
        scope, backend = self.settings.compile_scope, self.options.backend
        refusal = compile_scope_refusal(self.settings, self.options)  # the start-up check's, for a record it missed
        if refusal is not None:
            raise DraftCaptureConfigError(refusal)
        loop = SglangAssistantLoop(w, self.window, attention, self.steps)
        buckets = sorted(set(get_batch_sizes_to_capture(w.draft_model_runner, 1)[0]))
        # model scope: sglang's model under torch.compile inside a plain recorded graph of the iteration
        loop.prepare(buckets, compiled=backend in COMPILED_BACKENDS, compile_model=scope == "model",
                     projections=self.options.projections == "graphcap")
        if self.options.projections == "graphcap":
            why = sglang_linear.sglang_routes_bf16_elsewhere()
            log.info("graphcap: the draft's projections: %s", f"sglang's ({why})" if why else
                     f"graphcap's skinny GEMM in {loop.projections_routed} linear layers up to "
                     f"{max(KERNEL_ROWS.values())} rows, sglang's above")
        if scope == "model":
            backend = "cudagraph"
        static = {f"window.{k}": v for k, v in self.window.static_tensors().items()}
        static.update({f"draft.{n}": t for n, t in loop.model.named_parameters()})
        static.update({f"draft.{n}": t for n, t in loop.model.named_buffers() if t is not None})
        static["pending_accepts"] = self.tracker.pending
        for logical, phys in sorted(w.kv_context.physical_layer_ids.items()):
            static[f"target.k{phys}"] = self.target_pool.get_key_buffer(phys)
            static[f"target.v{phys}"] = self.target_pool.get_value_buffer(phys)
        name = "sglang-" + os.path.basename(str(w.server_args.speculative_draft_model_path or "draft").rstrip("/"))
        if scope == "model":
            name += "-model-compiled"
        if self.options.projections != "graphcap":  # `graphcap inspect` tells the two apart by name
            name += f"-{self.options.projections}-projections"
        self.loop = loop
        with loop.context():
            graphs = capture_graphs(self.window, self.tracker.in_iteration(loop), buckets=buckets,
                                    example_inputs=loop.example_inputs,
                                    static_tensors=static, backend=backend, manifest_dir=self.options.manifest_dir,
                                    name=name, steps=self.steps, parallel=sglang_parallel(w),
                                    flush_every_s=self.settings.manifest_flush_s)
        self.attach(graphs)
        graphs.serving = self.serving_record
        # The window rebuild is graphcap's one kernel outside the graphs (a request joins): compiled now, on a row no
        # request holds yet (its length is 0 and stays 0), not at the first join
        self.window.reset([0], [0], checked=False)
        vlog = variants.PROCESS
        if vlog is not None and graphs.manifest_path:  # every variant the last run needed, compiled before serving
            path = variants.variants_path(graphs.manifest_path)
            if vlog.preload(path):
                log.info("graphcap: compiled %d recorded kernel variants at start-up (%s)", vlog.preloaded, path)
            graphs.add_observer(SaveVariants(vlog, path))
            graphs.flush()

    def serving_record(self) -> mf.Serving:
        """The manifest's serving section: the rows' bookkeeping and this process's kernel variants."""
        st = self.tracker.stats
        rec = mf.Serving(joins=st["joins"], resets=st["resets"], retracts=st["retracts"],
                         evictions_in_window=st["evictions_in_window"])
        vlog = variants.PROCESS
        if vlog is not None:
            v, since = vlog.summary(), vlog.serving_since or 0.0
            rec.variants_preloaded, rec.variants_preload_failed = v.preloaded, v.preload_failed
            rec.variants_at_startup, rec.variants_while_serving = v.at_startup, v.while_serving
            rec.late_compiles = [mf.LateCompile(r.kernel, r.variant, round(r.seconds, 4),
                                                round(max(0.0, r.t - since), 3))
                                 for r in v.late]
        return rec

    def _context(self):
        """The loop's sglang forward context (what its compiled code was traced under), or none without a loop."""
        return self.loop.context() if self.loop is not None else contextlib.nullcontext()

    def attach(self, graphs: DraftGraphs) -> None:
        """Serve the draft phase from `graphs` (captured over `tracker.in_iteration(...)`: the iteration takes the
        accepted counts itself). The address guard before every replay only in the check mode (else at each manifest
        flush: graphcap.engine.capture)."""
        self.graphs, self.max_bucket, self.active = graphs, graphs.buckets[-1].batch_size, True
        graphs.replay_checks = self.check

    def iterate(self, batch) -> DraftOutput:
        """graphcap's half of a draft: rebuilds, then one dispatch and one replay, the rows (sglang's device
        `req_pool_indices`), seed tokens and hidden states written into the bucket's static inputs in one copy; the
        captured iteration takes the accepted counts from the pending buffer itself. No host sync. sglang's forward
        context is set only where the replay runs Python (a compiled backend that replays through it, an eager
        fallback). Checked every call, on the host: the inputs' shapes, dtypes and devices (a set lookup after the
        first batch of each kind) and the rows distinct and in range (~1-2 us at batch 8-32). GRAPHCAP_SGLANG_CHECK=1
        adds the device rows against the requests' own and every length (with a sync), and the address guard before
        every replay (else at each manifest flush)."""
        spec_info = batch.spec_info
        tokens, hidden = spec_info.bonus_tokens, spec_info.hidden_states
        slots = batch.req_pool_indices  # the rows, on the device already: nothing rebuilt from host ints
        host_slots = [slot_of(r) for r in batch.reqs]
        if None in host_slots:
            raise CaptureError(f"graphcap draft: a request of the batch has no request-pool row ({host_slots})")
        # Before anything is written, rebuilds and the pending counts included: a clashing row would otherwise reset
        # another request's window. The replayed rows are `slots`; that they equal `host_slots` is sglang's
        # invariant, checked (with a sync) under GRAPHCAP_SGLANG_CHECK.
        self.graphs.check_batch(slots, tokens, hidden, host_slots=host_slots, call="graphcap draft")
        self.tracker.rebuild(batch.reqs, batch.seq_lens, host_slots)
        replay = self.graphs.prepare(len(host_slots))
        if replay is not None:
            replay.write(slots, None, tokens, hidden)
            if replay.pure:
                out = replay()
            else:
                with self._context():
                    out = replay()
        else:  # above the largest bucket: run() runs it eagerly (counted in the manifest)
            with self._context():
                out = self.graphs.run(slots, torch.zeros_like(slots, dtype=torch.int32), tokens, hidden,
                                      host_slots=host_slots)
        if self.check:
            check_lengths(self.window, batch, host_slots)
        return out

    def draft(self, batch, fallback):
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
        from sglang.srt.speculative.eagle_utils import build_tree_kernel_efficient, default_tree_mask_mode
        from sglang.srt.speculative.frozen_kv_mtp_info import FrozenKVMTPVerifyInput

        if self.graphs is None:  # defensive: around_draft calls this only after a successful capture
            return fallback()
        out = self.iterate(batch)
        parent_list, top_scores_index, draft_tokens = chain_tree_inputs(out.tokens)
        batch.return_hidden_states = False
        w = self.worker
        host_sum, host_lens = getattr(batch, "seq_lens_sum", None), getattr(batch, "seq_lens_cpu", None)
        if host_sum is None and host_lens is not None:
            host_sum = int(host_lens.sum())
        runner = w.target_worker.model_runner
        buf, mode, fill, seq_lens_sum = verify_tree_mask(runner.attn_backend, batch.seq_lens.shape[0], host_sum,
                                                         default_tree_mask_mode(), runner.model_config.context_len)
        (tree_mask, position, retrieve_index, retrieve_next_token, retrieve_next_sibling,
         draft_tokens) = build_tree_kernel_efficient(
            batch.spec_info.bonus_tokens, parent_list, top_scores_index, draft_tokens, batch.seq_lens, seq_lens_sum,
            1, self.steps, w.speculative_num_draft_tokens, mode, buf, fill_prefix_mask=fill)
        return FrozenKVMTPVerifyInput(
            draft_token=draft_tokens, custom_mask=tree_mask, positions=position, retrieve_index=retrieve_index,
            retrieve_next_token=retrieve_next_token, retrieve_next_sibling=retrieve_next_sibling,
            retrieve_cum_len=None, spec_steps=self.steps, topk=1, draft_token_num=w.speculative_num_draft_tokens,
            capture_hidden_mode=CaptureHiddenMode.FULL, seq_lens_sum=host_sum, seq_lens_cpu=host_lens)
