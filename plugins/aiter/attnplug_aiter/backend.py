"""Kernel module of the ``aiter`` backend (imported only when the backend is built).

What it calls (aiter >= 0.1.10 on gfx942/gfx950):

* extend / draft-extend / mixed / causal target-verify:
  ``aiter.mha_batch_prefill_func(q, k, v, cu_seqlens_q, kv_indptr,
  kv_page_indices, max_seqlen_q, max_seqlen_k, softmax_scale=,
  logits_soft_cap=, causal=True, window_size=, kv_last_page_lens=,
  sink_ptr=)`` with ``k``/``v`` the layer's ``[num_slots, kv_heads, dim]``
  buffers (page size 1, token-level indices);
* decode: ``aiter.paged_attention_ragged(out, workspace, q, k, v, scale,
  kv_indptr, kv_page_indices, kv_last_page_lens, block_size=1,
  max_num_partitions, None, "auto", "NHD", logits_soft_cap, k_scale,
  v_scale)`` with the cache viewed ``[num_slots, 1, kv_heads, dim]``; a
  sliding window trims the listed keys. Layers with sinks decode through
  ``mha_batch_prefill_func`` (``paged_attention_ragged`` takes no sinks);
* target-verify with a tree mask: one one-query row per draft token listing
  the keys it may see, through the decode kernel (or the prefill kernel,
  ``causal=False``, for a layer with sinks).

On the core's ``PagedBackend`` (``new_kv_source = "cache"``): the base writes
each layer's new K/V before the kernel and restores the rows after a
``save_kv_cache=False`` forward, so the rows always list cache slots.
CUDA graphs: decode only, over fixed ``kv_indptr``/``kv_indices`` buffers.

MLA (docs/mla.md): absorbed decode through ``aiter.mla.mla_decode_fwd(q, kv_buffer, o, qo_indptr,
kv_indptr, kv_indices, kv_last_page_lens, max_seqlen_q, sm_scale=)`` as SGLang's aiter backend calls it:
the latent buffer viewed ``[num_slots, 1, 1, 576]`` (page size 1, token-level rows), ``o`` preallocated
``[B, H, 512]``. bf16 only, 16 or 128 heads, the 512 + 64 latent (v0.1.10's ``asm_mla.cu``).
"""

from __future__ import annotations

from typing import Any

import torch

from attnplug import PagedBackend
from attnplug.errors import AttnplugError
from attnplug import ForwardMode

from . import CAPABILITIES, MIN_LIBRARY_VERSION, NAME
from . import metadata as md


def create(ctx: Any) -> tuple[str, "AiterBackend"]:
    """Factory named by the descriptor: ``(effective_name, backend)``."""
    return NAME, AiterBackend(ctx)


#: Every library function this backend calls (bound against the real signatures by the contract tier).
LIBRARY_CALLS = ("aiter.mha_batch_prefill_func", "aiter.paged_attention_ragged", "aiter.mla.mla_decode_fwd")
#: MLA: the latent shape aiter's MLA decode kernels (asm ``.co`` files) are built for
MLA_DIMS = (512, 64)
#: MLA: the query heads (per KV head) whose bf16 decode kernels write ``o`` in v0.1.10. 32 and 64 exist too,
#: but with one KV split ``mla_decode_fwd`` returns their output in its float32 ``logits`` and leaves ``o``
#: unwritten (aiter/mla.py, v0.1.10), so they are refused rather than read from a second place.
MLA_HEADS = (16, 128)
#: MLA: the only query/latent dtype of the non-fp8 kernels (``Q.dtype() == BFloat16`` in asm_mla.cu)
MLA_DTYPE = "bfloat16"
#: ``mha_batch_prefill_func`` converts ``sink_ptr`` to float32 (one value per query head).
SINKS_DTYPE = torch.float32


def library_provider(distributions: tuple[str, ...]) -> tuple[str, str] | None:
    """``(distribution, version)`` of the one of ``distributions`` whose files hold the module ``aiter``."""
    from attnplug.probes import module_provider

    from . import MODULE

    return module_provider(MODULE, distributions)


def _import_aiter() -> Any:
    """The ``aiter`` module of the ``amd-aiter`` distribution, its version checked against the floor.
    The version is read from the distribution that provides the module, never from ``aiter``."""
    from . import LIBRARY

    owner = library_provider((LIBRARY,))
    if owner is None:
        from attnplug.errors import BackendUnavailableError

        other = library_provider(("aiter",))
        why = (f"module 'aiter' comes from the distribution 'aiter' {other[1]}, an unrelated async-iterator "
               f"package, not from {LIBRARY}" if other else f"no installed {LIBRARY} distribution provides "
               f"the module 'aiter'")
        raise BackendUnavailableError(NAME, [why], f"pip uninstall aiter; build {LIBRARY} >= "
                                      f"{MIN_LIBRARY_VERSION} from https://github.com/ROCm/aiter")
    import aiter  # the real library: only here, only at build (its floor: Registry.build, the support query)

    return aiter


def load_mla_kernel() -> Any:
    """``aiter.mla.mla_decode_fwd`` (the module ``aiter`` was checked at build)."""
    import importlib

    return importlib.import_module("aiter.mla").mla_decode_fwd


def mla_reasons(layer: Any, ctx: Any) -> list[str]:
    """Why aiter's MLA decode cannot serve MLA ``layer`` (its kernels' latent, head counts and dtype)."""
    out = layer.mla.latent_reasons(MLA_DIMS, "aiter's MLA decode kernels")
    if layer.num_heads not in MLA_HEADS:
        out.append(f"MLA num_heads={layer.num_heads} (aiter's mla_decode_fwd writes o for "
                   f"{' or '.join(map(str, MLA_HEADS))} heads)")
    dtype = getattr(ctx, "dtype", None) if ctx is not None else None
    if dtype is not None and str(dtype).replace("torch.", "") != MLA_DTYPE:
        out.append(f"MLA with dtype {str(dtype).replace('torch.', '')} (aiter's MLA decode kernels take bfloat16 "
                   f"queries and latent)")
    return out


class AiterBackend(PagedBackend):

    sinks_dtype = SINKS_DTYPE  # PagedBackend.device_sinks converts each layer's sinks once
    capabilities = CAPABILITIES
    backend_name = NAME
    new_kv_source = "cache"  # both kernels read prefix and new tokens through the token-level rows

    def __init__(self, ctx: Any, *, mla_kernel: Any = None) -> None:
        #: ``aiter.mla.mla_decode_fwd`` (imported on the first MLA forward unless given)
        self.mla_kernel = mla_kernel
        md.check_gfx(ctx.host.gfx_arch)
        self.aiter = _import_aiter()
        super().__init__(ctx)
        self.max_num_partitions = md.max_num_partitions(ctx.max_context_len)
        self._ones = torch.ones(1, dtype=torch.float32, device=self.device)  # k_scale / v_scale
        self._workspace: torch.Tensor | None = None
        self._graph: dict[Any, dict[str, torch.Tensor]] | None = None
        self._graph_bs: set[int] = set()

    def backend_reasons(self, layer: Any, ctx: Any) -> list[str]:
        if getattr(layer, "mla", None) is not None:
            return mla_reasons(layer, ctx if ctx is not None else self.ctx)
        if layer.gqa_group_size > md.MAX_GQA_RATIO:  # paged_attention_ragged's dispatch; no capability field says it
            return [f"GQA ratio num_heads/num_kv_heads={layer.gqa_group_size} (supported: 1..{md.MAX_GQA_RATIO})"]
        return []

    # -- metadata ------------------------------------------------------
    def build_metadata(self, batch: Any) -> md.ForwardLayout:
        return md.build_layout(batch, self.cache.req_to_token)

    def _decode_workspace(self, rows: int, num_heads: int, head_dim: int) -> torch.Tensor:
        need = md.workspace_bytes(rows, num_heads, head_dim, self.ctx.max_context_len)
        if self._workspace is None or self._workspace.numel() < need:
            self._workspace = torch.empty(need, dtype=torch.uint8, device=self.device)
        return self._workspace

    # -- forward -------------------------------------------------------
    def compute_extend(self, q: Any, k: Any, v: Any, layer: Any, batch: Any, lay: md.ForwardLayout) -> torch.Tensor:
        """Every mode: the rows list prefix and new tokens, already in the cache (``new_kv_source``)."""
        kc, vc = self.cache.get_kv(layer.layer_id)
        rows = lay.rows(layer.sliding_window)
        q = q.contiguous()
        if lay.kind == "prefill":
            return self._prefill(q, kc, vc, layer, lay.cu_seqlens_q, rows, lay.max_q_len, causal=True)
        if layer.sinks is not None:  # one-query rows through the prefill kernel, which takes sinks
            return self._prefill(q, kc, vc, layer, lay.query_indptr(), rows, 1, causal=False)
        return self._decode(q, kc, vc, layer, rows)

    def _prefill(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, layer: Any, cu_q: torch.Tensor,
                 rows: md.TokenKV, max_q: int, causal: bool) -> torch.Tensor:
        sinks = self.device_sinks(layer)
        return self.aiter.mha_batch_prefill_func(
            q, kc, vc, cu_q, rows.kv_indptr, rows.kv_indices, max_q, rows.max_kv_len,
            softmax_scale=float(layer.scaling), logits_soft_cap=md.logits_soft_cap(layer), causal=causal,
            window_size=md.window_size(layer) if causal else (-1, -1),
            kv_last_page_lens=rows.kv_last_page_lens, sink_ptr=sinks,
        )

    def _decode(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, layer: Any,
                rows: md.TokenKV) -> torch.Tensor:
        n = q.shape[0]
        out = torch.empty(n, layer.num_heads, layer.v_head_dim, dtype=q.dtype, device=q.device)
        ws = self._decode_workspace(n, layer.num_heads, layer.head_dim)
        self.aiter.paged_attention_ragged(
            out, ws, q, kc.view(-1, 1, kc.shape[1], kc.shape[2]), vc.view(-1, 1, vc.shape[1], vc.shape[2]),
            float(layer.scaling), rows.kv_indptr, rows.kv_indices, rows.kv_last_page_lens, 1,
            self.max_num_partitions, None, "auto", "NHD", md.logits_soft_cap(layer), self._ones, self._ones,
        )
        return out

    # -- MLA (docs/mla.md): absorbed decode through aiter.mla.mla_decode_fwd -------------------------
    def compute_mla(self, q: torch.Tensor, latent: Any, layer: Any, batch: Any, lay: md.ForwardLayout) -> torch.Tensor:
        """Absorbed MLA decode (the only MLA claim): ``q [B, H, 576]`` over the latent buffer viewed
        ``[num_slots, 1, 1, 576]`` (the base wrote this forward's rows first), one query per request
        (``qo_indptr`` 0..B), the token-level rows of the MHA decode, ``sm_scale`` = ``layer.scaling``;
        the output is written into ``o [B, H, kv_lora_rank]``."""
        if self.mla_kernel is None:
            self.mla_kernel = load_mla_kernel()
        buf = self.cache.get_kv(layer.layer_id)[0]
        rows = lay.rows(None)
        n = q.shape[0]
        o = torch.empty(n, layer.num_heads, layer.mla.kv_lora_rank, dtype=q.dtype, device=q.device)
        self.mla_kernel(q.contiguous(), buf.view(-1, 1, 1, buf.shape[-1]), o, lay.query_indptr(), rows.kv_indptr,
                        rows.kv_indices, rows.kv_last_page_lens, 1, sm_scale=float(layer.scaling))
        return o

    # -- CUDA (HIP) graphs: decode -----------------------------------------
    def init_cuda_graph_state(self, max_batch_size: int, max_num_tokens: int) -> None:
        """Fixed ``kv_indptr``/``kv_indices`` buffers per sliding window of the model's layers."""
        dev, i32 = self.device, torch.int32
        windows = {layer.sliding_window for layer in self.ctx.layers} or {None}
        self._graph = {
            w: {
                "kv_indptr": torch.zeros(max_batch_size + 1, dtype=i32, device=dev),
                "kv_indices": torch.zeros(max_batch_size * self.ctx.max_context_len, dtype=i32, device=dev),
                "kv_last_page_lens": torch.ones(max_batch_size, dtype=i32, device=dev),
            }
            for w in windows
        }
        self._decode_workspace(max_batch_size, self.ctx.num_heads, self.ctx.head_dim)
        self.prepare_sinks()

    def init_forward_metadata_capture_cuda_graph(self, batch: Any) -> None:
        if self._graph is None:
            raise AttnplugError("aiter: call init_cuda_graph_state before capturing graphs")
        if batch.forward_mode is not ForwardMode.DECODE:
            raise AttnplugError(f"aiter: graph capture covers decode only, not {batch.forward_mode.value}")
        self._graph_bs.add(batch.batch_size)
        self.prepare_sinks()  # outside the captured region: no host-to-device copy while capturing
        self._graph_metadata(batch)

    def init_forward_metadata_replay_cuda_graph(self, batch: Any) -> None:
        if self._graph is None or batch.batch_size not in self._graph_bs:
            raise AttnplugError(f"aiter: no graph was captured for decode batch size {batch.batch_size}")
        self._graph_metadata(batch)

    def _graph_metadata(self, batch: Any) -> None:
        """Build the rows on the host side of the graph and copy them into the captured buffers; the
        forward then finds them memoised (no host work inside the captured region)."""
        self.init_forward_metadata(batch)
        lay: md.ForwardLayout = self.forward_metadata(batch)
        n = batch.batch_size
        assert self._graph is not None
        for w, buf in self._graph.items():
            rows = lay.rows(w)
            buf["kv_indptr"][: n + 1].copy_(rows.kv_indptr)
            buf["kv_indices"][: rows.kv_indices.numel()].copy_(rows.kv_indices)
            # max_kv_len is baked into a captured prefill launch (sinks path): use the context limit
            lay._memo[w] = md.TokenKV(buf["kv_indptr"][: n + 1], buf["kv_indices"],
                                              buf["kv_last_page_lens"][:n], (self.ctx.max_context_len,) * n)
