"""vLLM's attention backend, served by the resolved attnplug pair (imported by vLLM, never by ``import attnplug``).

What vLLM calls, and what each call does here:

* ``AttnplugVllmImpl.__init__`` (once per attention layer, while vLLM builds the
  model, **before any weights load**): the engine's attnplug state is made on the
  first call (:class:`EngineState`: the pair resolved once from
  ``ATTNPLUG_VLLM_ARGS``, the architecture, this host, the model and KV dtypes
  and the block size; logged with the resolution's explanation); the layer's
  ``LayerSpec`` is read from the arguments vLLM passes (per-rank heads and KV
  heads, head size, scale, sliding window, soft-cap, sinks, attention type) and
  checked against the built pair: a layer it cannot serve raises
  ``NotSupportedError`` naming the layer, the half and the reason;
* ``AttnplugVllmMetadataBuilder`` (once per KV-cache group): on the first
  scheduled batch it adopts the KV tensors vLLM allocated for the group's layers
  as one ``PagedKVCache`` in the pair's layout (``KVLayout.wrap``: no copy) and
  builds the pair over it; ``build`` turns vLLM's metadata into one
  ``ForwardBatch`` per scheduled batch (block table -> ``req_to_token``,
  ``slot_mapping`` -> ``out_cache_loc``, computed tokens -> prefix lengths) and
  calls ``init_forward_metadata`` once; every layer of the group shares it;
* ``AttnplugVllmImpl.forward`` (per layer): ``backend.forward(q, k, v, spec, batch)``,
  which writes the new K/V into vLLM's cache and attends.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import logging
import os
import shlex
from typing import Any, ClassVar, cast

import torch
from vllm.config import get_current_vllm_config
from vllm.v1.attention.backend import (
    AttentionBackend, AttentionImpl, AttentionMetadataBuilder, AttentionType, CommonAttentionMetadata, MultipleOf,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from attnplug import (
    AttentionConfig,
    AttnplugError,
    BuildContext,
    ForwardBatch,
    ForwardMode,
    LayerSpec,
    NotSupportedError,
    PagedKVCache,
    default_registry,
)
from attnplug.config import add_attention_args, config_from_args
from attnplug.selector import backend_name_for_mode
from attnplug.dtypes import dtype_name
from attnplug.resolution import trace
from attnplug.resolution.explain import explain_text

from . import ENV_ARGS

__all__ = [
    "AttnplugVllmBackend",
    "AttnplugVllmImpl",
    "AttnplugVllmMetadata",
    "AttnplugVllmMetadataBuilder",
    "EngineState",
    "Group",
    "config_from_env",
    "engine_state",
    "engine_states",
]

logger = logging.getLogger("vllm.attnplug")

#: the latest engines' attnplug states in this process (each vLLM config resolves its own pair: this is
#: a lookup, not a backend choice); the oldest is dropped beyond a few
_ENGINES: list["EngineState"] = []
_KEEP_ENGINES = 4



def config_from_env(environ: Any = None) -> AttentionConfig:
    """attnplug's standard flags from ``ATTNPLUG_VLLM_ARGS`` (an error naming the variable when they do not parse)."""
    raw = (os.environ if environ is None else environ).get(ENV_ARGS, "")
    parser = argparse.ArgumentParser(prog=ENV_ARGS, add_help=False, exit_on_error=False)
    add_attention_args(parser)
    try:
        ns, extra = parser.parse_known_args(shlex.split(raw))
    except (argparse.ArgumentError, ValueError) as exc:
        raise AttnplugError(f"{ENV_ARGS}={raw!r}: {exc}") from None
    if extra:
        raise AttnplugError(f"{ENV_ARGS}={raw!r}: unknown arguments {extra} (attnplug's attention flags only)")
    return config_from_args(ns)


class EngineState:
    """One vLLM engine's attnplug state (per process: each TP rank resolves over its own heads)."""

    def __init__(self, vllm_config: Any, registry: Any = None) -> None:
        self.vllm_config = vllm_config
        self.registry = registry or default_registry()
        mc, cc = vllm_config.model_config, vllm_config.cache_config
        archs = list(getattr(mc, "architectures", None) or [])
        self.arch = archs[0] if archs else None
        self.dtype = mc.dtype
        self.kv_cache_dtype = cc.cache_dtype
        self.block_size = cc.block_size
        self.max_model_len = mc.max_model_len
        self.max_num_seqs = vllm_config.scheduler_config.max_num_seqs
        self.tp_rank = _tp_rank()
        #: global attention-layer index -> LayerSpec, in the order vLLM built the layers
        self.layers: list[LayerSpec] = []
        #: (mode, backend that served it) -> scheduled batches, over every KV-cache group
        self.served: collections.Counter[tuple[str, str]] = collections.Counter()
        self.groups: list[Group] = []
        self._resolve(config_from_env())

    def _resolve(self, config: AttentionConfig) -> None:
        if config.page_size is None:
            config = config.replace(page_size=self.block_size)
        if config.dtype is None:
            config = config.replace(dtype=dtype_name(self.dtype))
        result = trace(config, arch=self.arch, registry=self.registry)
        if result.error is not None:
            raise result.error
        self.resolution = result
        self.config: AttentionConfig = result.config
        self.pair = self.config.attention_backends()
        self.probe_ctx = BuildContext(
            config=self.config, host=self.registry.host, device="cpu", dtype=dtype_name(self.dtype),
            page_size=self.block_size, max_batch_size=self.max_num_seqs, max_context_len=self.max_model_len,
        )
        #: the pair built without a cache, to check each layer at model construction
        self.probe = self.registry.build_pair(self.probe_ctx)
        p, d = self.pair
        logger.info("attnplug serves vLLM attention (rank %d, arch %s): prefill=%s decode=%s, kv layout %s\n%s",
                    self.tp_rank, self.arch, p, d, self.config.kv_layout or "nhd", explain_text(result))

    @property
    def pair_label(self) -> str:
        p, d = self.pair
        return str(p) if p == d else f"{p} (prefill) / {d} (decode)"

    def add_layer(self, impl: "AttnplugVllmImpl", reasons: list[str], make_spec: Any) -> LayerSpec:
        """Record (and check) the next attention layer vLLM builds; refuse it naming the layer and the half."""
        layer_id = len(self.layers)
        spec = None
        if not reasons:
            try:
                spec = make_spec(layer_id)
            except ValueError as exc:
                reasons = [str(exc)]
        if spec is not None:
            reasons = list(self.probe.not_supported_reasons(spec, self.probe_ctx))
        if reasons:
            what = f"layer {layer_id}" + (f" ({spec.describe()})" if spec is not None else "")
            raise NotSupportedError(self.pair_label, [f"{what}: {r}" for r in reasons],
                                    what=f"this model ({self.arch}) in vLLM")
        spec = cast(LayerSpec, spec)  # no reasons: make_spec returned one
        if not self.layers:
            logger.info("attnplug rank %d: layer 0 served as %s (heads/KV heads per rank)", self.tp_rank,
                        spec.describe())
        self.layers.append(spec)
        return spec

    def rebuild(self, config: AttentionConfig) -> None:
        """Serve the same engine through another pair (re-resolved; every layer checked again; each group's
        cache adopted again in the new pair's layout on its next batch). Reset vLLM's prefix cache first:
        blocks cached in one layout mean nothing in another."""
        self._resolve(config)
        for spec in self.layers:
            reasons = self.probe.not_supported_reasons(spec, self.probe_ctx)
            if reasons:
                raise NotSupportedError(self.pair_label, [f"layer {spec.layer_id} ({spec.describe()}): {r}"
                                                          for r in reasons])
        for g in self.groups:
            g.reset()
        self.served.clear()


def _tp_rank() -> int:
    try:
        from vllm.distributed import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:  # no parallel state yet (a bare construction): rank 0
        return 0


def engine_state(vllm_config: Any = None) -> EngineState:
    """The attnplug state of the engine ``vllm_config`` belongs to (made, and the pair resolved, on first use)."""
    vllm_config = vllm_config if vllm_config is not None else get_current_vllm_config()
    for state in _ENGINES:
        if state.vllm_config is vllm_config:
            return state
    state = EngineState(vllm_config)
    _ENGINES.append(state)
    del _ENGINES[:-_KEEP_ENGINES]
    return state


def engine_states() -> list[EngineState]:
    """The states of this process's latest engines, oldest first (``served`` counters, ``rebuild``)."""
    return list(_ENGINES)


# -- vLLM's backend class ----------------------------------------------------------------------------
class AttnplugVllmBackend(AttentionBackend):
    """vLLM's view of attnplug: declarations vLLM checks before building layers. attnplug checks the rest
    (per layer, naming the layer) in ``AttnplugVllmImpl.__init__``."""

    #: the attnplug backend writes the new K/V itself, in the forward
    forward_includes_kv_cache_update: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[Any]] = ["auto"]

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec: Any = None) -> list[int | MultipleOf]:
        return [MultipleOf(16)]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return []  # any: the pair's head dims are checked per layer, by name

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        # one contiguous [blocks, kv_heads, block_size, head + v_head] tensor per layer, which the pair's
        # KVLayout views as its own storage (KVLayout.wrap)
        return (KVCacheLayout.LBHNC,)

    @staticmethod
    def get_name() -> str:
        return "CPU_ATTN"  # the enum member vLLM resolved; the override is what makes it attnplug

    @classmethod
    def supports_sink(cls) -> bool:
        return True

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return True  # refused per layer, by name, when it is not a decoder layer

    @staticmethod
    def get_impl_cls() -> type["AttnplugVllmImpl"]:
        return AttnplugVllmImpl

    @staticmethod
    def get_builder_cls() -> type["AttnplugVllmMetadataBuilder"]:
        return AttnplugVllmMetadataBuilder


@dataclasses.dataclass
class AttnplugVllmMetadata:
    """One scheduled batch of one KV-cache group."""

    batch: ForwardBatch
    group: "Group"
    num_actual_tokens: int


class Group:
    """A KV-cache group: its layers' ``PagedKVCache`` (vLLM's tensors, adopted) and the pair built over it."""

    def __init__(self, state: EngineState, layer_names: list[str], vllm_config: Any) -> None:
        self.state = state
        self.layer_names = list(layer_names)
        self.vllm_config = vllm_config
        fc = vllm_config.compilation_config.static_forward_context
        impls = [fc[n].impl for n in self.layer_names]
        bad = [n for n, i in zip(self.layer_names, impls) if not isinstance(i, AttnplugVllmImpl)]
        if bad:
            raise AttnplugError(f"vLLM layers {bad} are not served by attnplug (their impl is another backend's)")
        #: global layer id -> this group's spec (layer ids renumbered 0..n-1: one cache per group)
        self.specs = {i.spec.layer_id: dataclasses.replace(i.spec, layer_id=j) for j, i in enumerate(impls)}
        self.backend: Any = None
        self.kv_cache: PagedKVCache | None = None
        #: scheduled batches this group's metadata was built for, and attention-layer calls served
        self.builds = 0
        self.layer_calls = 0
        #: per forward mode, the ``EngineState.served`` key of the built backend (cleared with it)
        self.served_keys: dict[Any, tuple[str, str]] = {}

    def reset(self) -> None:
        self.backend, self.kv_cache = None, None
        self.served_keys = {}
        self.builds = self.layer_calls = 0

    def ensure_built(self) -> None:
        if self.backend is not None:
            return
        st = self.state
        fc = self.vllm_config.compilation_config.static_forward_context
        bufs = [fc[n].kv_cache for n in self.layer_names]
        bufs = [b[0] if isinstance(b, (list, tuple)) else b for b in bufs]
        first = next(iter(self.specs.values()))
        if any(b.dim() != 4 for b in bufs):
            raise AttnplugError(f"vLLM's KV cache for {self.layer_names[0]} has shape {tuple(bufs[0].shape)}, "
                                f"expected [blocks, kv_heads, block_size, head_dim + v_head_dim]")
        num_pages, kv_heads, page_size, _ = bufs[0].shape
        ps_max = -(-st.max_model_len // page_size) * page_size
        layout = self.state.registry.kv_layout(st.config.kv_layout or "nhd")
        self.kv_cache = PagedKVCache(
            num_layers=len(bufs), num_pages=int(num_pages), num_kv_heads=int(kv_heads), head_dim=first.head_dim,
            v_head_dim=first.v_head_dim, page_size=int(page_size), dtype=bufs[0].dtype, device=bufs[0].device,
            max_requests=st.max_num_seqs, max_context_len=ps_max, layout=layout, buffers=bufs,
        )
        ctx = BuildContext(
            config=st.config.replace(page_size=int(page_size)), host=st.registry.host, device=str(bufs[0].device),
            dtype=dtype_name(st.dtype), num_heads=first.num_heads, num_kv_heads=first.num_kv_heads,
            head_dim=first.head_dim, v_head_dim=first.v_head_dim, page_size=int(page_size), kv_cache=self.kv_cache,
            max_batch_size=st.max_num_seqs, max_context_len=ps_max,
        )
        backend = st.registry.build_pair(ctx)
        reasons = [f"layer {gid} ({s.describe()}): {r}" for gid, s in self.specs.items()
                   for r in backend.not_supported_reasons(s, ctx)]
        if reasons:
            raise NotSupportedError(st.pair_label, reasons, what="this model's KV-cache group in vLLM")
        self.ctx, self.backend = ctx, backend

    def batch(self, cm: CommonAttentionMetadata) -> ForwardBatch:
        """vLLM's per-batch metadata as one ``ForwardBatch`` (the cache's ``req_to_token`` rows 0..n-1 are the
        batch's requests, filled from the block table)."""
        cache = self.kv_cache
        assert cache is not None
        n, t = cm.num_reqs, cm.num_actual_tokens
        # the per-request vectors are a few host integers: read them once as lists (one tensor op each
        # would cost more than the list work)
        qsl = _head(cm.query_start_loc_cpu, n + 1)
        seq = _head(cm.seq_lens, n)
        qlens = [b - a for a, b in zip(qsl, qsl[1:])]
        prefix = [s - q for s, q in zip(seq, qlens)]
        # rows 0..n-1: each position's slot from the block table, whole pages at a time; the used block ids are
        # checked in range and the fill recorded, so the per-forward checks and the page table take those
        # entries as written (``PagedKVCache.page_fill``) instead of reading each one back
        cache.fill_from_page_table(cm.block_table_tensor, seq)
        rows = list(range(n))
        decode = [q == 1 and p > 0 for q, p in zip(qlens, prefix)]
        if n and all(decode):  # from host ints: the batch's tensors are made from them, nothing read back
            return ForwardBatch.decode(rows, seq, _head(cm.slot_mapping, t))
        loc = cm.slot_mapping[:t].to(torch.int64)
        mode = ForwardMode.MIXED if any(decode) else ForwardMode.EXTEND
        return ForwardBatch.extend(rows, prefix, qlens, loc, mode=mode)


def _head(t: torch.Tensor, k: int) -> list[int]:
    """The first ``k`` values of a 1-D host tensor as ints: the whole tensor read when it is short (one op, no
    slice), else its slice."""
    if t.shape[0] <= 2 * k + 16:
        return t.tolist()[:k]
    return t[:k].tolist()


class AttnplugVllmMetadataBuilder(AttentionMetadataBuilder[AttnplugVllmMetadata]):
    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any, device: Any) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        fc = vllm_config.compilation_config.static_forward_context
        impl = fc[layer_names[0]].impl
        if not isinstance(impl, AttnplugVllmImpl):
            raise AttnplugError(f"vLLM layer {layer_names[0]} is not served by attnplug (impl {type(impl).__name__})")
        self.state = impl.state
        self.group = Group(self.state, layer_names, vllm_config)
        self.state.groups.append(self.group)
        # the group's block size is known now (vLLM may pick another for sliding-window groups): check it
        ctx = self.state.probe_ctx.replace(page_size=kv_cache_spec.block_size,
                                           config=self.state.config.replace(page_size=kv_cache_spec.block_size))
        reasons = [f"layer {gid} ({s.describe()}): {r}" for gid, s in self.group.specs.items()
                   for r in self.state.probe.not_supported_reasons(s, ctx)]
        if reasons:
            raise NotSupportedError(self.state.pair_label, reasons,
                                    what=f"vLLM's block size {kv_cache_spec.block_size}")

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> AttnplugVllmMetadata:
        g = self.group
        g.ensure_built()
        batch = g.batch(common_attn_metadata)
        g.backend.init_forward_metadata(batch)  # once per scheduled batch; every layer of the group reuses it
        g.builds += 1
        mode = batch.forward_mode
        key = g.served_keys.get(mode)
        if key is None:  # the name the selector answers for this mode, once per built backend
            key = g.served_keys[mode] = (mode.value, str(backend_name_for_mode(mode, g.ctx.config, g.backend)))
        self.state.served[key] += 1
        return AttnplugVllmMetadata(batch, g, common_attn_metadata.num_actual_tokens)


class AttnplugVllmImpl(AttentionImpl):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None,
                 alibi_slopes: Any, sliding_window: int | None, kv_cache_dtype: str,
                 logits_soft_cap: float | None = None, attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: str | None = None, sinks: Any = None, **extra: Any) -> None:
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.sliding_window = sliding_window
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.sinks = sinks
        reasons = []
        if attn_type != AttentionType.DECODER:
            reasons.append(f"attention type {attn_type!s} (attnplug's vLLM integration serves decoder layers)")
        if alibi_slopes is not None:
            reasons.append("ALiBi slopes (no attnplug backend claims ALiBi)")
        if kv_sharing_target_layer_name is not None:
            reasons.append(f"KV sharing with {kv_sharing_target_layer_name} (not served)")
        if kv_cache_dtype != "auto":
            reasons.append(f"kv_cache_dtype={kv_cache_dtype!r} (attnplug's vLLM integration serves the model "
                           f"dtype cache, kv_cache_dtype='auto')")
        unknown = sorted(k for k, v in extra.items() if v not in (None, False))
        if unknown:
            reasons.append(f"vLLM attention arguments {unknown} (not served)")

        def make_spec(layer_id: int) -> LayerSpec:
            # vLLM's window W counts the query itself (keys p-W+1 .. p); attnplug's counts the keys before it
            return LayerSpec(
                layer_id=layer_id, num_heads=num_heads, num_kv_heads=self.num_kv_heads, head_dim=head_size,
                scaling=self.scale, logit_cap=logits_soft_cap or None,
                sliding_window=None if sliding_window in (None, -1) else int(sliding_window) - 1,
                sinks=sinks,
            )

        self.state = engine_state()
        self.spec = self.state.add_layer(self, reasons, make_spec)

    def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: AttnplugVllmMetadata | None, output: torch.Tensor,
                output_scale: Any = None, output_block_scale: Any = None) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("attnplug's vLLM backend does not fuse output quantization")
        if attn_metadata is None:  # vLLM's warm-up / profiling run
            return output
        n = attn_metadata.num_actual_tokens
        g = attn_metadata.group
        spec = g.specs[self.spec.layer_id]
        if query.shape[0] != n:  # padded (eager runs are not): the actual tokens only
            query, key, value = query[:n], key[:n], value[:n]
        dest = output if output.shape[0] == n else output[:n]
        into = getattr(g.backend, "forward_into", None)
        if into is not None and dest.is_contiguous():  # straight into vLLM's output where the kernel can
            into(dest.view(n, spec.num_heads, spec.v_head_dim), query, key, value, spec, attn_metadata.batch)
        else:
            out = g.backend.forward(query, key, value, spec, attn_metadata.batch)
            dest.copy_(out.view(n, *output.shape[1:]))
        g.layer_calls += 1
        return output
