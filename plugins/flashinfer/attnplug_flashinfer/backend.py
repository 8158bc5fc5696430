"""Kernel module of the ``flashinfer`` backend (imported only when the backend is built).

What it calls (flashinfer-python >= 0.5.0, NHD layout, the cache passed as the
``(k_cache, v_cache)`` tuple of ``[num_pages, page_size, kv_heads, dim]`` views
of attnplug's per-layer slot buffers):

* decode: ``BatchDecodeWithPagedKVCacheWrapper.plan(kv_indptr, kv_indices,
  kv_last_page_len, H, Hkv, D, page_size, window_left=, logits_soft_cap=,
  q_data_type=, kv_data_type=, sm_scale=)`` then ``run(q, (k, v))`` (an fp8 cache adds
  ``k_scale=``/``v_scale=``, the layer's scales);
* extend / draft-extend / mixed: ``BatchPrefillWithPagedKVCacheWrapper.plan(
  qo_indptr, …, causal=True)`` over prefix + new tokens, then ``run``;
* target-verify: a prefill wrapper of its own, pinned to ``backend="fa2"``,
  planned with ``custom_mask`` (prefix visible, draft-to-draft from
  ``spec_custom_mask``; the window folded in).

On the core's ``PagedBackend`` (``new_kv_source = "cache"``): the base writes
each layer's new K/V before the wrapper runs and restores the rows after a
``save_kv_cache=False`` forward. ``build_metadata`` makes the layout once per
forward (``metadata.build_layout``); each distinct (window, soft-cap, scale, heads)
combination is planned once per forward on first use and reused by every
layer that shares it. CUDA graphs: decode and target-verify wrappers are
built with ``use_cuda_graph=True`` over fixed buffers, one wrapper per batch
size and distinct layer configuration of ``BuildContext.layers`` (models
whose layers differ in window or soft-cap), and re-planned on replay.
"""

from __future__ import annotations

from typing import Any

import torch

from attnplug import PagedBackend
from attnplug.errors import AttnplugError
from attnplug import ForwardMode

from . import CAPABILITIES, NAME
from . import metadata as md

#: Workspace for split-k partial results (FlashInfer recommends 128 MiB; SGLang uses more for Qwen).
WORKSPACE_BYTES = 256 << 20

#: Every library call this backend makes (constructor, plan, run of each wrapper); the contract
#: tier binds each recorded call against the real signatures (installed package and
#: ``tests/contracts/signatures.json``).
MLA_CALLS = tuple(f"flashinfer.mla.BatchMLAPagedAttentionWrapper.{m}" for m in ("__init__", "plan", "run"))
LIBRARY_CALLS = tuple(
    f"flashinfer.{w}.{m}"
    for w in ("BatchDecodeWithPagedKVCacheWrapper", "BatchPrefillWithPagedKVCacheWrapper")
    for m in ("__init__", "plan", "run")
) + MLA_CALLS
#: the latent shape flashinfer's MLA kernels are instantiated for (DeepSeek-V2/V3): ckv 512, kpe 64
MLA_DIMS = (512, 64)
#: ``BatchMLAPagedAttentionWrapper(backend=)``: flashinfer picks FA3 on SM90, FA2 elsewhere
MLA_BACKEND = "auto"

#: The prefill wrappers' ``backend=``. ``"auto"`` picks FlashInfer's FA3 kernels on SM90, which
#: (a) before flashinfer 0.6.4 do not check dtypes, so bf16/fp16 queries over an fp8 cache build an
#: invalid kernel, and (b) ignore ``fixed_split_size``/``disable_split_kv``. So the FA2 kernels are
#: pinned whenever the KV cache is fp8 or the run must be deterministic.
PINNED_BACKEND = "fa2"
#: Every decode wrapper's ``backend=`` (as SGLang passes; valid from 0.5.0 through 0.7.4). Tensor-core
#: decode (fp8 KV, determinism, large GQA groups) runs the prefill kernel, and ``"auto"`` resolves it
#: to FA3 on SM90 (every dtype in 0.6.0-0.6.3, fp8 in every release): the invalid fp8 kernel again, and
#: ``disable_split_kv`` silently dropped. The CUDA-core decode kernel ignores the argument.
DECODE_BACKEND = "fa2"
#: The target-verify wrapper's ``backend=``: its own wrapper, pinned. Before 0.6.5 an ``"auto"`` wrapper
#: keeps the backend its first plan resolved, so a verify (custom mask) sharing the extend's wrapper
#: would run FA3's kernel with a custom mask on SM90 (``cudaErrorNotSupported``).
VERIFY_BACKEND = "fa2"


def prefill_backend(kv_cache_dtype: str, deterministic: bool) -> str:
    """``backend=`` for the prefill wrappers: ``"fa2"`` for fp8 KV or determinism, else ``"auto"``."""
    return PINNED_BACKEND if deterministic or kv_cache_dtype.startswith("float8") else "auto"


def split_arguments(deterministic: bool) -> dict[str, Any]:
    """``plan`` arguments for batch-invariant output: one KV chunk per request (``disable_split_kv``),
    as SGLang's deterministic mode does. Unlike ``fixed_split_size`` (which flashinfer does not
    guarantee under CUDA graphs) it holds for captured graphs too; it is honoured on the FA2 path,
    which ``prefill_backend`` pins under determinism."""
    return {"disable_split_kv": True} if deterministic else {}


def create(ctx: Any) -> tuple[str, "FlashInferBackend"]:
    """Factory named by the descriptor: ``(effective_name, backend)``."""
    return NAME, FlashInferBackend(ctx)


def _import_flashinfer() -> Any:
    # the library floor (MIN_LIBRARY_VERSION) is checked by Registry.build, through the support query
    import flashinfer  # the real library: only here, only at build

    return flashinfer


class FlashInferBackend(PagedBackend):
    capabilities = CAPABILITIES
    backend_name = NAME
    new_kv_source = "cache"  # the paged wrappers read prefix and new tokens from the cache
    reads_page_table = True  # pages, not slots: the base refuses a req_to_token that is not page-aligned

    def __init__(self, ctx: Any) -> None:
        self.fi = _import_flashinfer()
        super().__init__(ctx)
        self.page_size = ctx.page_size
        self.deterministic = bool(ctx.config.deterministic)
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self._eager: dict[tuple[Any, ...], Any] = {}
        #: CUDA graphs: the fixed buffers per layer configuration (``_plan_key``), made by
        #: ``init_cuda_graph_state`` / at capture (outside the captured region)
        self._graph_buffers: dict[tuple[Any, ...], dict[str, torch.Tensor]] | None = None
        self._graph_limits: tuple[int, int] | None = None
        #: per captured (batch size, mode): one wrapper per distinct layer configuration
        self._graph_wrappers: dict[tuple[int, str], dict[tuple[Any, ...], Any]] = {}
        #: per captured (batch size, mode): the fp8 cache's per-layer (k_scale, v_scale) baked into the graph
        self._graph_scales: dict[tuple[int, str], tuple[tuple[float, float], ...]] = {}
        self._graph_mode: tuple[int, str] | None = None

    def _kv_dtype(self) -> str:
        """The dtype of the cache this backend reads now (the cache handed in, not the build context's field)."""
        from attnplug.dtypes import dtype_name

        return dtype_name(self.cache.dtype)

    def _decode_tensor_cores(self) -> bool:
        # Tensor-core decode (the prefill kernel) for large GQA groups, fp8 KV, and always when deterministic.
        group = self.ctx.num_heads // max(self.ctx.num_kv_heads, 1)
        return self.deterministic or group >= 4 or bool(self.cache.quantized)

    # -- metadata ------------------------------------------------------
    def build_metadata(self, batch: Any) -> "_Plans":
        layout = md.build_layout(batch, self.cache.req_to_token, self.page_size)
        return _Plans(layout, self._graph_wrappers.get(self._graph_mode or (-1, "")))

    def _plan_key(self, layer: Any) -> tuple[Any, ...]:
        return (md.window_left(layer), md.logits_soft_cap(layer), float(layer.scaling),
                layer.num_heads, layer.num_kv_heads, layer.head_dim)

    def _wrapper(self, plans: "_Plans", layer: Any, kind: str, q_dtype: torch.dtype) -> Any:
        """The wrapper planned for ``layer``'s kernel arguments in this forward (planned on first use).
        ``kind``: ``"decode"``, ``"prefill"`` (extend, mixed, draft-extend) or ``"verify"`` (custom mask)."""
        config = self._plan_key(layer)
        key = (kind,) + config
        if key in plans.planned:
            return plans.planned[key]
        lay = plans.layout
        win, cap, scale = md.window_left(layer), md.logits_soft_cap(layer), float(layer.scaling)
        kv_dtype = self.cache.dtype
        common = dict(window_left=win, logits_soft_cap=cap, sm_scale=scale, q_data_type=q_dtype, kv_data_type=kv_dtype)
        if plans.graph_wrappers is not None:  # captured: one wrapper per distinct layer configuration
            wrapper = plans.graph_wrappers.get(config)
            if wrapper is None:
                raise AttnplugError(
                    f"flashinfer: layer {getattr(layer, 'layer_id', '?')}'s configuration (window_left, soft-cap, "
                    f"scale, heads, kv heads, head dim) = {config} was not captured; the graph holds "
                    f"{sorted(plans.graph_wrappers, key=repr)}. List every layer in BuildContext.layers")
        else:  # one eager wrapper per kind, backend choice and kernel-argument key, kept across forwards
            wkey = key + self._wrapper_options(kind)
            wrapper = self._eager.get(wkey)
            if wrapper is None:
                wrapper = self._eager[wkey] = self._new_wrapper(kind)
        p = lay.paged
        split = split_arguments(self.deterministic)
        if kind == "decode":
            wrapper.plan(p.kv_indptr, p.kv_indices, p.kv_last_page_len, layer.num_heads, layer.num_kv_heads,
                         layer.head_dim, self.page_size, **common, **split)
        elif kind == "verify":
            mask = lay.custom_mask(None if win < 0 else win)
            common["window_left"] = -1  # folded into the mask
            wrapper.plan(lay.qo_indptr, p.kv_indptr, p.kv_indices, p.kv_last_page_len, layer.num_heads,
                         layer.num_kv_heads, layer.head_dim, self.page_size, custom_mask=mask, causal=False,
                         **common, **split)
        else:
            wrapper.plan(lay.qo_indptr, p.kv_indptr, p.kv_indices, p.kv_last_page_len, layer.num_heads,
                         layer.num_kv_heads, layer.head_dim, self.page_size, causal=True, **common, **split)
        plans.planned[key] = wrapper
        return wrapper

    def _wrapper_options(self, kind: str) -> tuple[Any, ...]:
        """What a wrapper of ``kind`` is constructed with, read from the cache it serves now."""
        if kind == "decode":
            return (DECODE_BACKEND, self._decode_tensor_cores())
        return (self._prefill_backend(kind),)

    def _new_wrapper(self, kind: str, **graph: Any) -> Any:
        if kind == "decode":
            return self.fi.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_tensor_cores=self._decode_tensor_cores(), backend=DECODE_BACKEND, **graph)
        return self.fi.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", backend=self._prefill_backend(kind),
                                                           **graph)

    def _prefill_backend(self, kind: str = "prefill") -> str:
        if kind == "verify":
            return VERIFY_BACKEND
        return prefill_backend(self._kv_dtype(), self.deterministic)

    @staticmethod
    def _kind(layout_kind: str) -> str:
        return {"decode": "decode", "verify": "verify"}.get(layout_kind, "prefill")

    # -- MLA (docs/mla.md): absorbed form through BatchMLAPagedAttentionWrapper ------------------------
    def mla_reasons(self, layer: Any, ctx: Any) -> list[str]:
        """The 512 + 64 latent the MLA kernels exist for, a latent cache in the model dtype."""
        reasons = layer.mla.latent_reasons(MLA_DIMS, "BatchMLAPagedAttentionWrapper's kernels")
        if ctx is not None and ctx.kv_cache_dtype != ctx.dtype:
            reasons.append(f"kv_cache_dtype={ctx.kv_cache_dtype} with an MLA layer (the MLA wrapper reads a latent "
                           f"cache in the model dtype {ctx.dtype})")
        return reasons

    def mla_forward_reasons(self, layer: Any, batch: Any) -> list[str]:
        """The claim, then what the MLA wrapper cannot express: a target-verify tree mask (it has no custom
        mask; a causal chain of drafts is served with ``causal=True``)."""
        reasons = super().mla_forward_reasons(layer, batch)
        if batch.forward_mode is ForwardMode.TARGET_VERIFY and batch.spec_custom_mask is not None:
            reasons.append("target-verify with a custom (tree) mask on an MLA layer (BatchMLAPagedAttentionWrapper "
                           "has no custom mask; a causal chain of drafts, spec_custom_mask=None, is served)")
        if self.cache.quantized:
            reasons.append(f"an fp8 latent cache ({self._kv_dtype()}): the MLA wrapper reads the model dtype")
        return reasons

    def _mla_wrapper(self, plans: "_Plans", layer: Any, q_dtype: torch.dtype) -> Any:
        """The MLA wrapper planned for this forward (once per forward and (heads, scale) key: every MLA layer
        of a model shares it)."""
        decode = plans.layout.kind == "decode"
        key = ("mla", layer.num_heads, float(layer.scaling), decode)
        if key in plans.planned:
            return plans.planned[key]
        wrapper = self._eager.get(key)
        if wrapper is None:
            wrapper = self._eager[key] = self.fi.mla.BatchMLAPagedAttentionWrapper(self.workspace, backend=MLA_BACKEND)
        lay, p = plans.layout, plans.layout.paged
        kv_len = torch.as_tensor(p.kv_lens, dtype=torch.int32, device=self.device)
        wrapper.plan(lay.qo_indptr, p.kv_indptr, p.kv_indices, kv_len, layer.num_heads, MLA_DIMS[0], MLA_DIMS[1],
                     self.page_size, not decode, float(layer.scaling), q_dtype, self.cache.dtype)
        plans.planned[key] = wrapper
        return wrapper

    def compute_mla(self, q: Any, latent: Any, layer: Any, batch: Any, plans: "_Plans") -> torch.Tensor:
        """Absorbed MLA: ``run(q_nope, q_pe, ckv_cache, kpe_cache, out=)`` over the latent buffer viewed as pages
        ``[pages, page_size, 576]`` and split into its c_kv (first 512) and k_pe (last 64) columns (strided
        views, no copy); the base wrote this forward's latent rows first (``new_kv_source = "cache"``),
        bottom-right causal over prefix + new rows in extend."""
        if plans.graph_wrappers is not None:
            raise AttnplugError(f"flashinfer: MLA layer {layer.layer_id} inside a captured CUDA graph (MLA forwards "
                                f"are eager only: the MLA wrapper is not built over capture buffers)")
        R = MLA_DIMS[0]
        wrapper = self._mla_wrapper(plans, layer, q.dtype)
        buf = self.cache.get_kv(layer.layer_id)[0]
        paged = buf.view(-1, self.page_size, buf.shape[-1])
        q = q.contiguous()
        out = q.new_empty((q.shape[0], layer.num_heads, R))
        wrapper.run(q[..., :R], q[..., R:], paged[..., :R], paged[..., R:], out=out)
        return out

    # -- forward -------------------------------------------------------
    def _paged_cache(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.cache.get_kv(layer_id)
        ps = self.page_size
        return k.view(-1, ps, k.shape[1], k.shape[2]), v.view(-1, ps, v.shape[1], v.shape[2])

    def compute_extend(self, q: Any, k: Any, v: Any, layer: Any, batch: Any, plans: "_Plans") -> torch.Tensor:
        """Every mode: the decode or prefill wrapper planned for the layer, over the paged cache that
        already holds this forward's K/V (``new_kv_source = "cache"``)."""
        wrapper = self._wrapper(plans, layer, self._kind(plans.layout.kind), q.dtype)
        return wrapper.run(q.contiguous(), self._paged_cache(layer.layer_id), **self.scale_arguments(layer.layer_id))

    def scale_arguments(self, layer_id: int) -> dict[str, float]:
        """``run(k_scale=, v_scale=)`` for an fp8 cache: the layer's per-tensor scales as Python floats
        (``Optional[float]`` in both wrappers' ``run`` since 0.5.0). FlashInfer multiplies the softmax
        scale by ``k_scale`` and the output by ``v_scale``, so ``plan(sm_scale=)`` stays the layer's
        own; the query stays fp16/bf16 (no ``q_scale``). A 16-bit cache passes nothing."""
        if not self.cache.quantized:
            return {}
        k_scale, v_scale = self.cache.kv_scales(layer_id)
        return {"k_scale": float(k_scale), "v_scale": float(v_scale)}

    # -- CUDA graphs -----------------------------------------------------
    def init_cuda_graph_state(self, max_batch_size: int, max_num_tokens: int) -> None:
        """Fixed buffers the captured wrappers read (indptrs, page ids, last-page lengths, verify mask), one
        set per distinct layer configuration of ``BuildContext.layers``."""
        self._graph_limits = (max_batch_size, max_num_tokens)
        self._graph_buffers = {}
        for config in self._graph_configs():
            self._graph_buffers_for(config)

    def _graph_buffers_for(self, config: tuple[Any, ...]) -> dict[str, torch.Tensor]:
        assert self._graph_buffers is not None and self._graph_limits is not None
        if config not in self._graph_buffers:
            max_batch_size, max_num_tokens = self._graph_limits
            max_pages = max_batch_size * md.num_pages_for(self.ctx.max_context_len, self.page_size)
            dev, i32 = self.device, torch.int32
            self._graph_buffers[config] = {
                "qo_indptr": torch.zeros(max_batch_size + 1, dtype=i32, device=dev),
                "kv_indptr": torch.zeros(max_batch_size + 1, dtype=i32, device=dev),
                "kv_indices": torch.zeros(max_pages, dtype=i32, device=dev),
                "kv_last_page_len": torch.ones(max_batch_size, dtype=i32, device=dev),
                "custom_mask": torch.zeros(max_num_tokens * self.ctx.max_context_len // 8 + 8, dtype=torch.uint8,
                                           device=dev),
                "mask_indptr": torch.zeros(max_batch_size + 1, dtype=i32, device=dev),
            }
        return self._graph_buffers[config]

    def _graph_layers(self) -> dict[tuple[Any, ...], Any]:
        """One layer per distinct configuration (window, soft-cap, scale, heads): what a graph is planned for."""
        layers = tuple(self.ctx.layers or ()) or (_DefaultLayer(self.ctx),)
        out: dict[tuple[Any, ...], Any] = {}
        for layer in layers:
            if getattr(layer, "mla", None) is not None:  # MLA layers run eager (compute_mla)
                continue
            out.setdefault(self._plan_key(layer), layer)
        return out

    def _graph_configs(self) -> tuple[tuple[Any, ...], ...]:
        return tuple(self._graph_layers())

    def init_forward_metadata_capture_cuda_graph(self, batch: Any) -> None:
        if self._graph_buffers is None:
            raise AttnplugError("flashinfer: call init_cuda_graph_state before capturing CUDA graphs")
        mode = batch.forward_mode
        if mode not in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY):
            raise AttnplugError(f"flashinfer: CUDA-graph capture covers decode and target_verify, not {mode.value}")
        bs = batch.batch_size
        key = (bs, mode.value)
        kind = "decode" if mode is ForwardMode.DECODE else "verify"
        wrappers = self._graph_wrappers.setdefault(key, {})
        for config in self._graph_configs():
            if config in wrappers:
                continue
            b = self._graph_buffers_for(config)
            if kind == "decode":
                graph = dict(use_cuda_graph=True, paged_kv_indptr_buffer=b["kv_indptr"][: bs + 1],
                             paged_kv_indices_buffer=b["kv_indices"],
                             paged_kv_last_page_len_buffer=b["kv_last_page_len"][:bs])
            else:
                graph = dict(use_cuda_graph=True, qo_indptr_buf=b["qo_indptr"][: bs + 1],
                             paged_kv_indptr_buf=b["kv_indptr"][: bs + 1], paged_kv_indices_buf=b["kv_indices"],
                             paged_kv_last_page_len_buf=b["kv_last_page_len"][:bs], custom_mask_buf=b["custom_mask"],
                             mask_indptr_buf=b["mask_indptr"][: bs + 1])
            wrappers[config] = self._new_wrapper(kind, **graph)
        # run(k_scale=, v_scale=) takes Python floats: a captured graph keeps the values it was captured with
        self._graph_scales[key] = self._scales_now()
        self._graph_mode = key
        try:
            self.init_forward_metadata(batch)
        finally:
            self._graph_mode = None
        self._plan_for_graph(batch)

    def init_forward_metadata_replay_cuda_graph(self, batch: Any) -> None:
        key = (batch.batch_size, batch.forward_mode.value)
        if key not in self._graph_wrappers:
            raise AttnplugError(f"flashinfer: no CUDA graph was captured for batch size {key[0]} ({key[1]})")
        self.check_scales_since_capture(key)
        self._graph_mode = key
        try:
            self.init_forward_metadata(batch)
        finally:
            self._graph_mode = None
        self._plan_for_graph(batch)  # plan() copies the new layout into the captured buffers

    def _scales_now(self) -> tuple[tuple[float, float], ...]:
        cache = self.cache
        return tuple(cache.kv_scales(i) for i in range(cache.num_layers)) if cache.quantized else ()

    def check_scales_since_capture(self, key: tuple[int, str]) -> None:
        """Refuse a replay after the fp8 cache's KV scales changed: the captured ``run`` calls hold the
        scales of capture time as constants, so the replay would dequantize with stale scales."""
        then, now = self._graph_scales.get(key, ()), self._scales_now()
        if then != now:
            changed = [f"layer {i}: (k_scale, v_scale) {a} at capture, {b} now"
                       for i, (a, b) in enumerate(zip(then, now)) if a != b] or [f"{then} at capture, {now} now"]
            raise AttnplugError(f"flashinfer: the KV scales changed after the CUDA graph for batch size {key[0]} "
                                f"({key[1]}) was captured ({'; '.join(changed)}); the graph passes the scales of "
                                f"capture time to run(). Recapture the graphs after set_kv_scales")

    def _plan_for_graph(self, batch: Any) -> None:
        """Plan every captured configuration now (plan is host work: never inside the captured region)."""
        plans = self.forward_metadata(batch)
        kind = "decode" if batch.forward_mode is ForwardMode.DECODE else "verify"
        for layer in self._graph_layers().values():
            self._wrapper(plans, layer, kind, _torch_dtype(self.ctx.dtype))

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1


class _Plans:
    """Per-forward state: the layout and the wrappers planned for it (by kernel-argument key)."""

    __slots__ = ("layout", "graph_wrappers", "planned")

    def __init__(self, layout: md.ForwardLayout, graph_wrappers: dict[tuple[Any, ...], Any] | None) -> None:
        self.layout = layout
        #: captured forwards: the graph's wrapper per layer configuration (``None``: eager)
        self.graph_wrappers = graph_wrappers
        self.planned: dict[tuple[Any, ...], Any] = {}


class _DefaultLayer:
    """The layer shape a graph is planned for when the engine did not list its layers."""

    def __init__(self, ctx: Any) -> None:
        self.num_heads, self.num_kv_heads, self.head_dim = ctx.num_heads, ctx.num_kv_heads, ctx.head_dim
        self.v_head_dim, self.sliding_window, self.logit_cap = ctx.v_head_dim, None, None
        self.scaling = ctx.head_dim ** -0.5


def _torch_dtype(name: str) -> torch.dtype:
    from attnplug.dtypes import torch_dtype

    return torch_dtype(name)
