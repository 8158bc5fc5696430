"""Kernel module of the ``fa3`` backend: FlashAttention-3 ``flash_attn_with_kvcache`` over the paged cache.

Imported only when the backend is built. The kernel function is taken from
``sgl_kernel.flash_attn`` (sgl-kernel's FA3 build, the one SGLang calls) or,
failing that, from ``flash_attn_interface`` (upstream flash-attn-3); both
are imported inside ``load_kernel`` so this module itself needs only torch.

On the core's ``PagedBackend`` (``new_kv_source = "cache"``): per forward,
``build_metadata`` makes the page table, cache lengths and query offsets once
(``attnplug_fa3.metadata``); the base writes each layer's new K/V at
``out_cache_loc`` (restoring the rows after a ``save_kv_cache=False`` forward
or a raising kernel) and ``compute_extend`` makes one kernel call, for every
mode, that reads prefix and new tokens from the cache.

MLA (docs/mla.md): the absorbed form in every mode, as SGLang's ``FlashAttentionBackend`` calls FA3 for
MLA: the latent buffer split into two strided views, ``k_cache`` = its rope part ``[pages, page_size, 1,
qk_rope]`` and ``v_cache`` = its ``c_kv`` part ``[pages, page_size, 1, kv_lora_rank]``, the query split
likewise (``q`` = ``q_pe``, ``qv`` = the absorbed ``q_nope``); FA3 scores ``q·k + qv·v``. FA3's ``qv`` is
a Hopper, fp16/bf16, ``head_size <= 64`` feature (hopper/flash_api.cpp): see ``mla_reasons``.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from attnplug import PagedBackend
from attnplug.errors import BackendUnavailableError, NotSupportedError
from attnplug import ForwardMode

from attnplug.kvcache import quantize
from attnplug.probes import installed_library, version_key

from . import CAPABILITIES, FLASH_ATTN_3, FP8_HEAD_DIM_MULTIPLE, MIN_SGL_KERNEL_SINKS, NAME, SGL_KERNEL, SINKS_SMS
from .metadata import FA3Metadata, build_metadata, window_size

Kernel = Callable[..., Any]

#: Every library function this backend calls (the contract tier binds each recorded call against
#: the real signature of each version in ``tests/contracts/signatures.json``).
LIBRARY_CALLS = ("sgl_kernel.flash_attn.flash_attn_with_kvcache",)
#: sgl-kernel's FA3 checks ``sinks.scalar_type() == BFloat16`` ("sinks must have dtype bfloat16").
SINKS_DTYPE = torch.bfloat16
#: fp8 KV: FA3's fp8 path takes q in the cache's format too. The query is quantized with scale 1 (as
#: the cache quantizes: round, saturated to the format's range), so its descale factor is 1.
Q_SCALE = 1.0
#: FA3's descale factors are float32 ``[batch, num_kv_heads]`` tensors (hopper/flash_api.cpp:
#: ``CHECK_SHAPE(k_descale, batch_size, num_heads_k)``, read through ``data_ptr<float>()`` with both
#: strides, so a broadcast view of one value serves). ``batch`` is the query batch: the rows of
#: ``cu_seqlens_q`` (one per request, or one per draft token on the tree path).
DESCALE_DTYPE = torch.float32
#: MLA through ``qv=``: FA3 takes it on SM90 only, for a q/k head size (the rope part) of at most 64 and a V
#: head size (``kv_lora_rank``) of at most 512 ("Q/K <= 64 and V <= 512"), both multiples of 8, fp16/bf16 only
MLA_SMS = (90,)
MLA_MAX_ROPE, MLA_MAX_RANK, MLA_ALIGN = 64, 512, 8


def mla_reasons(layer: Any, ctx: Any) -> list[str]:
    """Why FA3's ``qv`` MLA mode cannot serve MLA ``layer`` under ``ctx`` (shapes, GPU, latent dtype)."""
    m, out = layer.mla, []
    if m.qk_rope_head_dim > MLA_MAX_ROPE or m.qk_rope_head_dim % MLA_ALIGN:
        out.append(f"MLA qk_rope_head_dim={m.qk_rope_head_dim} (FA3's qv= takes q/k head sizes of at most "
                   f"{MLA_MAX_ROPE}, multiples of {MLA_ALIGN})")
    if m.kv_lora_rank > MLA_MAX_RANK or m.kv_lora_rank % MLA_ALIGN:
        out.append(f"MLA kv_lora_rank={m.kv_lora_rank} (FA3 takes a V head size of at most {MLA_MAX_RANK}, a "
                   f"multiple of {MLA_ALIGN}, beside q/k <= {MLA_MAX_ROPE})")
    host = getattr(ctx, "host", None)
    sm = host.sm() if host is not None and host.platform == "cuda" else None
    if sm is not None and sm not in MLA_SMS:
        out.append(f"MLA layer: FA3's qv= (and a V head size other than the q/k one) runs on Hopper "
                   f"(SM{'/'.join(map(str, MLA_SMS))}) only; this GPU is SM{sm}")
    kv = getattr(ctx, "kv_cache_dtype", "") or ""
    if kv.startswith("float8"):
        out.append(f"MLA layer with kv_cache_dtype={kv}: FA3's qv= is fp16/bf16 only")
    return out


def load_kernel() -> tuple[str, Kernel]:
    """``(distribution, flash_attn_with_kvcache)``: sgl-kernel's FA3 first, then upstream flash-attn-3."""
    errors = []
    try:
        from sgl_kernel.flash_attn import flash_attn_with_kvcache  # type: ignore[import-not-found]

        return SGL_KERNEL, flash_attn_with_kvcache
    except ImportError as exc:
        errors.append(f"sgl_kernel.flash_attn: {type(exc).__name__}: {exc}")
    try:
        from flash_attn_interface import flash_attn_with_kvcache  # type: ignore[import-not-found,no-redef]

        return FLASH_ATTN_3, flash_attn_with_kvcache
    except ImportError as exc:
        errors.append(f"flash_attn_interface: {type(exc).__name__}: {exc}")
    raise BackendUnavailableError(NAME, errors, "install sgl-kernel (or the upstream flash-attn-3 Hopper build)")


def create(ctx: Any) -> tuple[str, "FA3Backend"]:
    """Factory named by the descriptor: ``(effective_name, backend)``."""
    return NAME, FA3Backend(ctx)


class FA3Backend(PagedBackend):
    """FlashAttention-3 over the canonical paged cache (pages viewed ``[num_pages, page_size, kv_heads, dim]``)."""

    sinks_dtype = SINKS_DTYPE  # PagedBackend.device_sinks converts each layer's sinks once

    capabilities = CAPABILITIES
    backend_name = NAME
    new_kv_source = "cache"  # one call reads prefix and new tokens through the page table
    reads_page_table = True  # pages, not slots: the base refuses a req_to_token that is not page-aligned

    def __init__(self, ctx: Any, *, kernel: Kernel | None = None, provider: str | None = None) -> None:
        if kernel is None:
            provider, kernel = load_kernel()
        super().__init__(ctx)
        self.provider = provider or "injected"
        self.kernel = kernel
        #: ``(distribution, version)`` of the installed sgl-kernel family, from the host record
        host = getattr(ctx, "host", None)
        self.library = installed_library(host, SGL_KERNEL) if host is not None else None
        self.page_size = ctx.page_size
        #: FA3 picks a split count per batch shape unless told; 1 keeps a request's output batch-invariant
        self.num_splits = 1 if ctx.config.deterministic else 0
        self._graph: dict[str, torch.Tensor] | None = None
        #: per layer: the ``(k_scale, v_scale)`` last seen and a float32 ``[3]`` device tensor holding
        #: ``(Q_SCALE, k_scale, v_scale)`` (made once per layer and scale pair, never per forward)
        self._descales: dict[int, tuple[tuple[float, float], torch.Tensor]] = {}

    # -- description -----------------------------------------------------
    def backend_reasons(self, layer: Any, ctx: Any) -> list[str]:
        if getattr(layer, "mla", None) is not None:
            return mla_reasons(layer, ctx if ctx is not None else self.ctx)
        # the installed build's limits hold at every forward (ctx None: the build context's dtypes)
        reasons = self._library_reasons(layer, ctx if ctx is not None else self.ctx)
        if ctx is not None:
            # (a 16-bit cache in another dtype than q: the core's kv_cache_dtype_follows_model)
            kv = ctx.kv_cache_dtype
            sm = ctx.host.sm() if ctx.host is not None else None
            if kv.startswith("float8") and sm is not None and sm != 90:
                reasons.append(f"kv_cache_dtype={kv}: FA3's fp8 path runs on Hopper (SM90) only; this GPU is SM{sm}")
        return reasons

    def _library_reasons(self, layer: Any, ctx: Any) -> list[str]:
        """What the installed kernel build cannot do for ``layer`` (sinks floor, fp8 head dims)."""
        reasons: list[str] = []
        host = getattr(ctx, "host", None) or getattr(self.ctx, "host", None)
        sm = host.sm() if host is not None and host.platform == "cuda" else None
        if layer.uses_sinks and sm is not None and sm not in SINKS_SMS:
            # sgl-kernel applies sinks in its SM90 kernel only; elsewhere they would be ignored, silently
            reasons.append(f"attention sinks: sgl-kernel's FA3 applies them on Hopper "
                           f"(SM{'/'.join(map(str, SINKS_SMS))}) only; this GPU is SM{sm}, where the output "
                           f"would silently omit them")
        if layer.uses_sinks and self.provider == FLASH_ATTN_3:
            reasons.append("attention sinks need sgl-kernel's FA3 build (flash_attn_interface has no sinks=)")
        elif layer.uses_sinks and self.library is not None \
                and version_key(self.library[1]) < version_key(MIN_SGL_KERNEL_SINKS):
            reasons.append(f"attention sinks need {SGL_KERNEL} >= {MIN_SGL_KERNEL_SINKS} (sinks= of "
                           f"flash_attn_with_kvcache); found {self.library[0]} {self.library[1]}")
        kv = getattr(ctx, "kv_cache_dtype", "") or ""
        if kv.startswith("float8") and layer.head_dim % FP8_HEAD_DIM_MULTIPLE:
            reasons.append(f"head_dim={layer.head_dim} with kv_cache_dtype={kv}: FA3's fp8 path needs head dims "
                           f"that are multiples of {FP8_HEAD_DIM_MULTIPLE}")
        return reasons

    # -- metadata ----------------------------------------------------------
    def build_metadata(self, batch: Any) -> FA3Metadata:
        return build_metadata(batch, self.cache)

    # -- CUDA graphs ---------------------------------------------------------
    def init_cuda_graph_state(self, max_batch_size: int, max_num_tokens: int) -> None:
        """Static buffers the captured kernels read: page table, cache lengths, query offsets."""
        pages = (self.ctx.max_context_len + self.page_size - 1) // self.page_size
        dev = self.cache.device
        self._graph = {  # the metadata fields the captured kernels read, by name (see graph_metadata)
            "page_table": torch.zeros(max_batch_size, pages, dtype=torch.int32, device=dev),
            "cache_seqlens": torch.zeros(max_batch_size, dtype=torch.int32, device=dev),
            "cu_seqlens_q": torch.zeros(max_batch_size + 1, dtype=torch.int32, device=dev),
        }
        self.prepare_sinks()

    def init_forward_metadata_capture_cuda_graph(self, batch: Any) -> None:
        self.prepare_sinks()  # outside the captured region: no host-to-device copy while capturing
        self._graph_metadata(batch)

    def init_forward_metadata_replay_cuda_graph(self, batch: Any) -> None:
        self._graph_metadata(batch)

    def _graph_metadata(self, batch: Any) -> None:
        if batch.forward_mode is ForwardMode.TARGET_VERIFY and batch.spec_custom_mask is not None:
            raise NotSupportedError(NAME, ["CUDA-graph capture of target-verify with a custom draft mask "
                                           "(its row count and width vary); run it eagerly"])
        self.graph_metadata(batch, self._graph)

    # -- fp8 KV ---------------------------------------------------------------
    def descale_arguments(self, layer_id: int, batch_rows: int, num_kv_heads: int) -> dict[str, torch.Tensor]:
        """``q_descale``/``k_descale``/``v_descale`` for an fp8 cache: the layer's per-tensor scales
        (``PagedKVCache.kv_scales``) broadcast to FA3's ``[batch, num_kv_heads]`` float32 form.

        FA3 multiplies the softmax scale (and the soft-cap threshold) by ``q_descale * k_descale``
        and the output by ``v_descale`` in the kernel, so ``softmax_scale`` stays the layer's own."""
        scales = self.cache.kv_scales(layer_id)
        memo = self._descales.get(layer_id)
        if memo is None or memo[0] != scales:
            # filled in place by device kernels (no host copy, legal under CUDA-graph capture); a
            # changed scale is written into the same storage, which a captured graph keeps reading
            t = memo[1] if memo is not None else torch.empty(3, dtype=DESCALE_DTYPE, device=self.cache.device)
            for i, value in enumerate((Q_SCALE, *scales)):
                t[i].fill_(value)
            memo = self._descales[layer_id] = (scales, t)
        t = memo[1]
        shape = (batch_rows, num_kv_heads)
        return {name: t[i].view(1, 1).expand(shape) for i, name in enumerate(("q_descale", "k_descale", "v_descale"))}

    # -- forward -------------------------------------------------------------
    def _paging(self, meta: FA3Metadata, layer: Any) -> tuple[int, dict[str, Any]]:
        """The page size the cache is viewed with and the kernel's paging arguments (MHA and MLA alike): a
        custom draft mask's one-query rows over page size 1 (``meta.tree_for`` the layer's window), else the
        forward's page table, causal."""
        if meta.uses_tree:
            t = meta.tree_for(getattr(layer, "sliding_window", None) if getattr(layer, "mla", None) is None else None)
            ps, table, seqlens, cu_q, max_q, causal = 1, t.page_table, t.cache_seqlens, t.cu_seqlens_q, 1, False
        else:
            ps, table, seqlens, cu_q = meta.page_size, meta.page_table, meta.cache_seqlens, meta.cu_seqlens_q
            max_q, causal = meta.max_seqlen_q, True
        return ps, {"cache_seqlens": seqlens, "page_table": table, "cu_seqlens_q": cu_q, "max_seqlen_q": max_q,
                    "softmax_scale": layer.scaling, "causal": causal, "num_splits": self.num_splits}

    def compute_extend(self, q: torch.Tensor, k: Any, v: Any, layer: Any, batch: Any,
                       meta: FA3Metadata) -> torch.Tensor:
        """Every mode: the new K/V are in the cache already (``new_kv_source = "cache"``)."""
        kb, vb = self.cache.get_kv(layer.layer_id)
        Hkv, D, Dv = layer.num_kv_heads, layer.head_dim, layer.v_head_dim
        ps, paging = self._paging(meta, layer)
        # a custom draft mask's rows had the window applied when they were built
        window = (-1, -1) if meta.uses_tree else window_size(layer.sliding_window)
        extra: dict[str, Any] = {}
        qk = q
        if self.cache.quantized:  # fp8 KV: q in the cache's format (unscaled), the scales as descales
            qk = quantize(q, Q_SCALE, kb.dtype)
            extra.update(self.descale_arguments(layer.layer_id, paging["cu_seqlens_q"].numel() - 1, Hkv))
        if layer.sinks is not None:
            extra["sinks"] = self.device_sinks(layer)
        out = self.kernel(q=qk, k_cache=kb.view(-1, ps, Hkv, D), v_cache=vb.view(-1, ps, Hkv, Dv), window_size=window,
                          softcap=float(layer.logit_cap or 0.0), **paging, **extra)
        if isinstance(out, tuple):  # return_softmax_lse variants
            out = out[0]
        return out.view(q.shape[0], layer.num_heads, layer.v_head_dim).to(q.dtype)

    # -- MLA (docs/mla.md): the absorbed form through qv= ------------------------------------------
    def compute_mla(self, q: torch.Tensor, latent: Any, layer: Any, batch: Any, meta: FA3Metadata) -> torch.Tensor:
        """Absorbed MLA, every mode (the base wrote this forward's latent rows first): the latent buffer
        viewed ``[pages, page_size, 1, 576]`` and split into ``k_cache`` (rope part) and ``v_cache`` (``c_kv``),
        ``q`` = the query's rope part, ``qv`` = its absorbed nope part, page table / lengths / query offsets
        as for MHA (a custom draft mask: one-query rows over page size 1). Output ``[T, H, kv_lora_rank]``."""
        r = layer.mla.kv_lora_rank
        buf = self.cache.get_kv(layer.layer_id)[0]
        ps, paging = self._paging(meta, layer)
        pages = buf.view(-1, ps, 1, buf.shape[-1])
        out = self.kernel(q=q[..., r:], k_cache=pages[..., r:], v_cache=pages[..., :r], qv=q[..., :r], **paging)
        if isinstance(out, tuple):  # return_softmax_lse variants
            out = out[0]
        return out.view(q.shape[0], layer.num_heads, r).to(q.dtype)
