"""Kernel module of the ``trtllm_mha`` backend: trtllm-gen paged FMHA through flashinfer.

Imported only when the backend is built; ``flashinfer`` itself is imported
inside ``load_kernels``. Decode calls
``flashinfer.decode.trtllm_batch_decode_with_kv_cache``; every extend-shaped
mode calls ``flashinfer.prefill.trtllm_batch_context_with_kv_cache``. Both
read prefix and new tokens from the cache through block tables
(``attnplug_trtllm_mha.metadata``); the core's ``PagedBackend``
(``new_kv_source = "cache"``) writes each layer's new K/V at
``out_cache_loc`` first and restores the rows after a
``save_kv_cache=False`` forward. One zero-initialised workspace buffer (512 MiB by
default, as SGLang uses) is shared by every layer.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from attnplug import PagedBackend
from attnplug.capabilities import support_reasons
from attnplug.errors import AttnplugError, BackendUnavailableError, NotSupportedError
from attnplug.kvcache import quantize

from . import CAPABILITIES, LIBRARY, NAME
from .metadata import TrtllmMetadata, build_metadata, hnd_view, window_left

DEFAULT_WORKSPACE_BYTES = 512 << 20
#: Every library function this backend calls (bound against the real signatures by the contract tier).
LIBRARY_CALLS = ("flashinfer.decode.trtllm_batch_decode_with_kv_cache",
                 "flashinfer.prefill.trtllm_batch_context_with_kv_cache",
                 "flashinfer.decode.trtllm_batch_decode_with_kv_cache_mla")
#: MLA: the latent shape trtllm-gen's MLA kernels exist for, and the page sizes they take
MLA_DIMS = (512, 64)
MLA_PAGE_SIZES = (32, 64)
#: trtllm-gen reads sinks as float32, one per query head.
SINKS_DTYPE = torch.float32
#: fp8 KV: trtllm-gen reads e4m3 queries over an e4m3 cache; the query is quantized with scale 1 (as
#: the cache quantizes: round, saturated), so ``q_scale`` is 1 in the fused bmm scales.
Q_SCALE = 1.0


def bmm_scales(scaling: float, k_scale: float, v_scale: float, q_scale: float = Q_SCALE) -> tuple[float, float]:
    """``(bmm1_scale, bmm2_scale)``: the fused scales trtllm-gen applies to Q·Kᵀ and to P·V.

    bmm1 = q_scale × k_scale × softmax scale (the dequantization of both operands folded into the
    logits' scale), bmm2 = v_scale — the form flashinfer's own wrappers pass on their trtllm-gen
    path (``sm_scale *= q_scale; sm_scale *= k_scale`` then ``bmm1_scale=sm_scale``; bmm2 from
    ``v_scale``). A 16-bit cache has scales 1, leaving the softmax scale and 1."""
    return q_scale * k_scale * scaling, v_scale


def load_kernels() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """``(decode, context)``: flashinfer's trtllm-gen entry points."""
    try:
        from flashinfer.decode import trtllm_batch_decode_with_kv_cache  # type: ignore[import-not-found]
        from flashinfer.prefill import trtllm_batch_context_with_kv_cache  # type: ignore[import-not-found]
    except ImportError as exc:
        raise BackendUnavailableError(NAME, [f"{type(exc).__name__}: {exc}"], f"pip install '{LIBRARY}>=0.6.0'") from exc
    return trtllm_batch_decode_with_kv_cache, trtllm_batch_context_with_kv_cache


def load_mla_kernel() -> Callable[..., Any]:
    """flashinfer's trtllm-gen MLA decode entry point (imported on the first MLA forward only)."""
    try:
        from flashinfer.decode import trtllm_batch_decode_with_kv_cache_mla  # type: ignore[import-not-found]
    except ImportError as exc:
        raise BackendUnavailableError(NAME, [f"{type(exc).__name__}: {exc}"], f"pip install '{LIBRARY}>=0.6.0'") from exc
    return trtllm_batch_decode_with_kv_cache_mla


def create(ctx: Any) -> tuple[str, "TrtllmMHABackend"]:
    """Factory named by the descriptor: ``(effective_name, backend)``."""
    return NAME, TrtllmMHABackend(ctx)


class TrtllmMHABackend(PagedBackend):
    """trtllm-gen FMHA over the canonical paged cache (viewed ``HND``: ``[pages, kv_heads, page_size, dim]``)."""

    sinks_dtype = SINKS_DTYPE  # PagedBackend.device_sinks converts each layer's sinks once

    capabilities = CAPABILITIES
    backend_name = NAME
    new_kv_source = "cache"  # both entry points read prefix and new tokens through the block tables
    reads_page_table = True  # pages, not slots: the base refuses a req_to_token that is not page-aligned

    def __init__(self, ctx: Any, *, kernels: tuple[Callable[..., Any], Callable[..., Any]] | None = None,
                 workspace_bytes: int = DEFAULT_WORKSPACE_BYTES, mla_kernel: Callable[..., Any] | None = None) -> None:
        #: ``trtllm_batch_decode_with_kv_cache_mla`` (loaded on the first MLA forward unless given)
        self.mla_kernel = mla_kernel
        reasons = support_reasons(CAPABILITIES, page_size=ctx.page_size)
        if reasons:
            raise NotSupportedError(NAME, reasons)
        self.decode_kernel, self.context_kernel = kernels or load_kernels()
        super().__init__(ctx)
        self.page_size = ctx.page_size
        #: static upper bound on a request's KV length (what SGLang passes; stable across CUDA-graph replays)
        self.max_seq_len = ctx.max_context_len
        self.workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=self.device)
        self._graph: dict[str, torch.Tensor] | None = None
        #: the fp8 cache's per-layer (k_scale, v_scale) when the graphs were captured (bmm scales are floats,
        #: constants of the captured launches); ``None``: nothing captured yet
        self._captured_scales: tuple[tuple[float, float], ...] | None = None

    # -- metadata ----------------------------------------------------------
    def build_metadata(self, batch: Any) -> TrtllmMetadata:
        return build_metadata(batch, self.cache)

    def init_cuda_graph_state(self, max_batch_size: int, max_num_tokens: int) -> None:
        pages = (self.ctx.max_context_len + self.page_size - 1) // self.page_size
        dev = self.workspace.device
        z = lambda *shape: torch.zeros(*shape, dtype=torch.int32, device=dev)  # noqa: E731
        # the metadata fields the captured kernels read, by name (see graph_metadata)
        self._graph = {"block_tables": z(max_batch_size, pages), "seq_lens": z(max_batch_size),
                       "cum_seq_lens_q": z(max_batch_size + 1), "cum_seq_lens_kv": z(max_batch_size + 1)}
        self.prepare_sinks()

    def init_forward_metadata_capture_cuda_graph(self, batch: Any) -> None:
        self.prepare_sinks()  # outside the captured region: no host-to-device copy while capturing
        now = self._scales_now()
        if self._captured_scales is not None and self._captured_scales != now:
            self._refuse_changed_scales("another graph was captured")
        self._captured_scales = now
        self.graph_metadata(batch, self._graph)

    def init_forward_metadata_replay_cuda_graph(self, batch: Any) -> None:
        if self._captured_scales is not None and self._captured_scales != self._scales_now():
            self._refuse_changed_scales("the CUDA graphs were captured")
        self.graph_metadata(batch, self._graph)

    def _scales_now(self) -> tuple[tuple[float, float], ...]:
        cache = self.cache
        return tuple(cache.kv_scales(i) for i in range(cache.num_layers)) if cache.quantized else ()

    def _refuse_changed_scales(self, since: str) -> None:
        """The captured launches hold ``bmm1_scale``/``bmm2_scale`` computed from the scales of capture time:
        a replay after ``set_kv_scales`` would dequantize with stale scales, so it is refused."""
        then, now = self._captured_scales or (), self._scales_now()
        changed = [f"layer {i}: (k_scale, v_scale) {a} then, {b} now"
                   for i, (a, b) in enumerate(zip(then, now)) if a != b] or [f"{then} then, {now} now"]
        raise AttnplugError(f"{NAME}: the KV scales changed after {since} ({'; '.join(changed)}); the captured "
                            f"kernels keep the bmm scales of capture time. Recapture the graphs after set_kv_scales")

    # -- forward -------------------------------------------------------------
    def compute_extend(self, q: torch.Tensor, k: Any, v: Any, layer: Any, batch: Any,
                       meta: TrtllmMetadata) -> torch.Tensor:
        """Every mode (decode picks the decode entry point): the new K/V are in the cache already."""
        kb, vb = self.cache.get_kv(layer.layer_id)
        kv_cache = (hnd_view(kb, self.page_size), hnd_view(vb, self.page_size))
        query = quantize(q, Q_SCALE, kb.dtype) if self.cache.quantized else q
        bmm1, bmm2 = bmm_scales(float(layer.scaling), *self.cache.kv_scales(layer.layer_id))
        common: dict[str, Any] = dict(
            query=query, kv_cache=kv_cache, workspace_buffer=self.workspace, block_tables=meta.block_tables,
            seq_lens=meta.seq_lens, bmm1_scale=bmm1, bmm2_scale=bmm2,
            window_left=window_left(layer.sliding_window), out_dtype=q.dtype,
        )
        if layer.sinks is not None:
            common["sinks"] = self.device_sinks(layer)
        if meta.decode:
            out = self.decode_kernel(max_seq_len=self.max_seq_len, **common)
        else:
            out = self.context_kernel(
                max_q_len=meta.max_q_len, max_kv_len=self.max_seq_len, batch_size=meta.batch_size,
                cum_seq_lens_q=meta.cum_seq_lens_q, cum_seq_lens_kv=meta.cum_seq_lens_kv, **common,
            )
        return out.view(q.shape[0], layer.num_heads, layer.v_head_dim).to(q.dtype)

    # -- MLA (docs/mla.md): absorbed decode through trtllm_batch_decode_with_kv_cache_mla ------------------------
    def mla_reasons(self, layer: Any, ctx: Any) -> list[str]:
        """The 512 + 64 latent and pages of 32 or 64 (trtllm-gen's MLA kernels)."""
        reasons = layer.mla.latent_reasons(MLA_DIMS, "trtllm-gen's MLA kernels")
        if ctx is not None and ctx.page_size not in MLA_PAGE_SIZES:
            reasons.append(f"page_size={ctx.page_size} with an MLA layer (trtllm_batch_decode_with_kv_cache_mla takes "
                           f"blocks of {' or '.join(map(str, MLA_PAGE_SIZES))})")
        return reasons

    def compute_mla(self, q: torch.Tensor, latent: Any, layer: Any, batch: Any, meta: TrtllmMetadata) -> torch.Tensor:
        """Absorbed MLA decode (the only MLA claim): ``query [B, 1, H, 576]`` over the latent buffer viewed as
        ``[pages, page_size, 576]`` (the base wrote this forward's rows first), block tables and lengths as for
        MHA, ``bmm1_scale`` = softmax scale x the latent scale (fp8: the query quantized to e4m3 with scale 1),
        ``bmm2_scale`` = the latent scale; output ``[B, H, kv_lora_rank]`` in the query dtype."""
        if self.mla_kernel is None:
            self.mla_kernel = load_mla_kernel()
        m = layer.mla
        buf = self.cache.get_kv(layer.layer_id)[0]
        kv_cache = buf.view(-1, self.page_size, buf.shape[-1])
        scale = self.cache.kv_scales(layer.layer_id)[0]
        query = quantize(q, Q_SCALE, buf.dtype) if self.cache.quantized else q
        bmm1, bmm2 = bmm_scales(float(layer.scaling), scale, scale)
        B = q.shape[0]
        out = self.mla_kernel(
            query=query.reshape(B, 1, layer.num_heads, q.shape[-1]), kv_cache=kv_cache,
            workspace_buffer=self.workspace, qk_nope_head_dim=m.qk_nope_head_dim, kv_lora_rank=m.kv_lora_rank,
            qk_rope_head_dim=m.qk_rope_head_dim, block_tables=meta.block_tables, seq_lens=meta.seq_lens,
            max_seq_len=self.max_seq_len, bmm1_scale=bmm1, bmm2_scale=bmm2)
        return out.reshape(B, layer.num_heads, m.kv_lora_rank).to(q.dtype)
