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
* target-verify: the same wrapper planned with ``custom_mask`` (prefix
  visible, draft-to-draft from ``spec_custom_mask``; the window folded in).

On the core's ``PagedBackend`` (``new_kv_source = "cache"``): the base writes
each layer's new K/V before the wrapper runs and restores the rows after a
``save_kv_cache=False`` forward. ``build_metadata`` makes the layout once per
forward (``metadata.build_layout``); each distinct (window, soft-cap, scale, heads)
combination is planned once per forward on first use and reused by every
layer that shares it. CUDA graphs: decode and target-verify wrappers are
built with ``use_cuda_graph=True`` over fixed buffers per batch size and
re-planned on replay.
"""

from __future__ import annotations

from typing import Any

import torch

from attnplug import PagedBackend
from attnplug.errors import AttnplugError
from attnplug import ForwardMode

from . import CAPABILITIES, MIN_LIBRARY_VERSION, NAME
from . import metadata as md

#: Workspace for split-k partial results (FlashInfer recommends 128 MiB; SGLang uses more for Qwen).
WORKSPACE_BYTES = 256 << 20

#: Every library call this backend makes (constructor, plan, run of each wrapper); the contract
#: tier binds each recorded call against the real signatures (installed package and
#: ``tests/contracts/signatures.json``).
LIBRARY_CALLS = tuple(
    f"flashinfer.{w}.{m}"
    for w in ("BatchDecodeWithPagedKVCacheWrapper", "BatchPrefillWithPagedKVCacheWrapper")
    for m in ("__init__", "plan", "run")
)

#: The prefill wrappers' ``backend=``. ``"auto"`` picks FlashInfer's FA3 kernels on SM90, which
#: (a) before flashinfer 0.6.4 do not check dtypes, so bf16/fp16 queries over an fp8 cache build an
#: invalid kernel, and (b) ignore ``fixed_split_size``/``disable_split_kv``. So the FA2 kernels are
#: pinned whenever the KV cache is fp8 or the run must be deterministic (decode always runs FA2).
PINNED_BACKEND = "fa2"


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
    import importlib.metadata as im

    import flashinfer  # noqa: F401  (the real library: only here, only at build)

    try:
        version = im.version("flashinfer-python")
    except im.PackageNotFoundError:
        version = getattr(flashinfer, "__version__", "0")
    md.check_library_version(version, MIN_LIBRARY_VERSION)
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
        self._graph_buffers: dict[str, torch.Tensor] | None = None
        self._graph_wrappers: dict[tuple[int, str], Any] = {}
        self._graph_mode: tuple[int, str] | None = None

    def _decode_tensor_cores(self) -> bool:
        # Tensor-core decode (the prefill kernel) for large GQA groups, fp8 KV, and always when deterministic.
        group = self.ctx.num_heads // max(self.ctx.num_kv_heads, 1)
        return self.deterministic or group >= 4 or self.ctx.kv_cache_dtype.startswith("float8")

    # -- metadata ------------------------------------------------------
    def build_metadata(self, batch: Any) -> "_Plans":
        layout = md.build_layout(batch, self.cache.req_to_token, self.page_size)
        return _Plans(layout, self._graph_wrappers.get(self._graph_mode or (-1, "")))

    def _plan_key(self, layer: Any) -> tuple[Any, ...]:
        return (md.window_left(layer), md.logits_soft_cap(layer), float(layer.scaling),
                layer.num_heads, layer.num_kv_heads, layer.head_dim)

    def _wrapper(self, plans: "_Plans", layer: Any, kind: str, q_dtype: torch.dtype) -> Any:
        """The wrapper planned for ``layer``'s kernel arguments in this forward (planned on first use)."""
        key = (kind,) + self._plan_key(layer)
        if key in plans.planned:
            return plans.planned[key]
        lay = plans.layout
        win, cap, scale = md.window_left(layer), md.logits_soft_cap(layer), float(layer.scaling)
        kv_dtype = self.cache.dtype
        common = dict(window_left=win, logits_soft_cap=cap, sm_scale=scale, q_data_type=q_dtype, kv_data_type=kv_dtype)
        if plans.graph_wrapper is not None:
            wrapper = plans.graph_wrapper
            if plans.planned:
                raise AttnplugError(
                    "flashinfer: a CUDA graph holds one plan per batch size; layers with different "
                    "(window, soft-cap, scale, heads) are not supported under graph capture"
                )
        else:  # one eager wrapper per kernel-argument key, kept across forwards (plans are per forward)
            wrapper = self._eager.get(key)
            if wrapper is None:
                wrapper = self._eager[key] = self._new_wrapper(kind)
        p = lay.paged
        split = split_arguments(self.deterministic)
        if kind == "decode":
            wrapper.plan(p.kv_indptr, p.kv_indices, p.kv_last_page_len, layer.num_heads, layer.num_kv_heads,
                         layer.head_dim, self.page_size, **common, **split)
        elif kind == "prefill":
            if lay.kind == "verify":
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

    def _new_wrapper(self, kind: str) -> Any:
        if kind == "decode":
            return self.fi.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD",
                                                               use_tensor_cores=self._decode_tensor_cores())
        return self.fi.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", backend=self._prefill_backend())

    def _prefill_backend(self) -> str:
        return prefill_backend(self.ctx.kv_cache_dtype, self.deterministic)

    # -- forward -------------------------------------------------------
    def _paged_cache(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.cache.get_kv(layer_id)
        ps = self.page_size
        return k.view(-1, ps, k.shape[1], k.shape[2]), v.view(-1, ps, v.shape[1], v.shape[2])

    def compute_extend(self, q: Any, k: Any, v: Any, layer: Any, batch: Any, plans: "_Plans") -> torch.Tensor:
        """Every mode: the decode or prefill wrapper planned for the layer, over the paged cache that
        already holds this forward's K/V (``new_kv_source = "cache"``)."""
        kind = "decode" if plans.layout.kind == "decode" else "prefill"
        wrapper = self._wrapper(plans, layer, kind, q.dtype)
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
        """Fixed buffers the captured wrappers read: indptrs, page ids, last-page lengths, verify mask."""
        max_pages = max_batch_size * md.num_pages_for(self.ctx.max_context_len, self.page_size)
        dev, i32 = self.device, torch.int32
        self._graph_buffers = {
            "qo_indptr": torch.zeros(max_batch_size + 1, dtype=i32, device=dev),
            "kv_indptr": torch.zeros(max_batch_size + 1, dtype=i32, device=dev),
            "kv_indices": torch.zeros(max_pages, dtype=i32, device=dev),
            "kv_last_page_len": torch.ones(max_batch_size, dtype=i32, device=dev),
            "custom_mask": torch.zeros(max_num_tokens * self.ctx.max_context_len // 8 + 8, dtype=torch.uint8,
                                       device=dev),
            "mask_indptr": torch.zeros(max_batch_size + 1, dtype=i32, device=dev),
        }

    def init_forward_metadata_capture_cuda_graph(self, batch: Any) -> None:
        if self._graph_buffers is None:
            raise AttnplugError("flashinfer: call init_cuda_graph_state before capturing CUDA graphs")
        mode = batch.forward_mode
        if mode not in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY):
            raise AttnplugError(f"flashinfer: CUDA-graph capture covers decode and target_verify, not {mode.value}")
        bs, b = batch.batch_size, self._graph_buffers
        key = (bs, mode.value)
        if key not in self._graph_wrappers:
            if mode is ForwardMode.DECODE:
                wrapper = self.fi.BatchDecodeWithPagedKVCacheWrapper(
                    self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=self._decode_tensor_cores(),
                    paged_kv_indptr_buffer=b["kv_indptr"][: bs + 1], paged_kv_indices_buffer=b["kv_indices"],
                    paged_kv_last_page_len_buffer=b["kv_last_page_len"][:bs])
            else:
                wrapper = self.fi.BatchPrefillWithPagedKVCacheWrapper(
                    self.workspace, "NHD", use_cuda_graph=True, backend=self._prefill_backend(),
                    qo_indptr_buf=b["qo_indptr"][: bs + 1],
                    paged_kv_indptr_buf=b["kv_indptr"][: bs + 1], paged_kv_indices_buf=b["kv_indices"],
                    paged_kv_last_page_len_buf=b["kv_last_page_len"][:bs], custom_mask_buf=b["custom_mask"],
                    mask_indptr_buf=b["mask_indptr"][: bs + 1])
            self._graph_wrappers[key] = wrapper
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
        self._graph_mode = key
        try:
            self.init_forward_metadata(batch)
        finally:
            self._graph_mode = None
        self._plan_for_graph(batch)  # plan() copies the new layout into the captured buffers

    def _plan_for_graph(self, batch: Any) -> None:
        """Plan the graph wrapper now (plan is host work: never inside the captured region)."""
        layers = self.ctx.layers or ()
        layer = layers[0] if layers else _DefaultLayer(self.ctx)
        plans = self.forward_metadata(batch)
        kind = "decode" if batch.forward_mode is ForwardMode.DECODE else "prefill"
        self._wrapper(plans, layer, kind, _torch_dtype(self.ctx.dtype))

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1


class _Plans:
    """Per-forward state: the layout and the wrappers planned for it (by kernel-argument key)."""

    __slots__ = ("layout", "graph_wrapper", "planned")

    def __init__(self, layout: md.ForwardLayout, graph_wrapper: Any) -> None:
        self.layout = layout
        self.graph_wrapper = graph_wrapper
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
