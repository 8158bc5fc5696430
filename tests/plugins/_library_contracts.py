"""What the real kernel libraries require of a call, written down once from their sources.

Two halves, shared by the emulators in ``tests/plugins`` and the contract
tier in ``tests/contracts``:

* ``signature(library, version, qualname)``: the REAL parameter list of a
  library function in one release, rebuilt as an ``inspect.Signature`` from
  ``tests/contracts/signatures.json`` (extracted from the release's own
  wrapper source by ``scripts/extract_signatures.py``; never imported).
* ``PRECONDITIONS``: per library function, the dtype/layout checks the
  library itself makes (or documents) before launching a kernel, each
  citing where it comes from. The emulators call ``require()`` so a wrong
  dtype fails on CPU as it would on the GPU; the contract tier calls
  ``problems()`` for every recorded call at every supported version.

Checks about the query dtype (fp16/bf16/fp8 only) are ``strict`` ones: the
CPU emulator tests run some problems in float32 for a tight float64
comparison, so emulators skip them and the contract tier (bf16 runs) keeps them.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
from pathlib import Path
from typing import Any, Callable

import torch

from packaging.version import Version as version_key

SIGNATURES = Path(__file__).resolve().parents[1] / "contracts" / "signatures.json"
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_HALF = (torch.float16, torch.bfloat16)


# -- real signatures -------------------------------------------------------------------
@functools.cache
def recorded() -> dict[str, Any]:
    return json.loads(SIGNATURES.read_text())["libraries"]


def versions(library: str) -> list[str]:
    """The versions of ``library`` whose signatures are recorded, oldest first."""
    return sorted(recorded().get(library, {}), key=version_key)


def source_of(library: str, version: str) -> str:
    return recorded()[library][version]["source"]


_DEFAULT = object()


def signature(library: str, version: str, qualname: str) -> inspect.Signature | None:
    """``qualname``'s real signature in ``library`` ``version`` (``None``: the function does not exist there)."""
    entry = recorded()[library][version]["functions"].get(qualname, KeyError)
    if entry is KeyError:
        raise KeyError(f"{qualname} is not recorded for {library} {version}; add it to FUNCTIONS in "
                       f"scripts/extract_signatures.py and re-extract")
    if entry is None:
        return None
    params = [inspect.Parameter(p["name"], getattr(inspect.Parameter, p["kind"]),
                                default=_DEFAULT if p["has_default"] else inspect.Parameter.empty)
              for p in entry["parameters"]]
    return inspect.Signature(params)


# -- recorded calls ----------------------------------------------------------------------
@dataclasses.dataclass
class Call:
    """One library call as a plugin made it. ``owner``: for a wrapper method, what the wrapper
    was constructed with (its ``__init__`` call's keyword view), else ``{}``."""

    qualname: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    owner: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def is_method(self) -> bool:
        return self.qualname.count(".") >= 2 and self.qualname.split(".")[-2][:1].isupper()

    def bind(self, sig: inspect.Signature) -> inspect.BoundArguments:
        """Bind as Python would call the real function (``TypeError`` when it would not)."""
        args = (object(),) + self.args if self.is_method else self.args
        bound = sig.bind(*args, **self.kwargs)
        return bound

    def arguments(self, sig: inspect.Signature) -> dict[str, Any]:
        """Every parameter's value for this call (defaults as ``None`` when not passed)."""
        bound = self.bind(sig)
        out = {name: (None if p.default is _DEFAULT else p.default) for name, p in sig.parameters.items()
               if p.default is not inspect.Parameter.empty}
        out.update(bound.arguments)
        for name, p in sig.parameters.items():  # ``**kwargs`` (flashinfer 0.7.4's plan): checked by name too
            if p.kind is inspect.Parameter.VAR_KEYWORD and isinstance(out.get(name), dict):
                out.update({k: v for k, v in out.pop(name).items() if k not in out})
        return out


class Recorder:
    """Collects the library calls a plugin makes, then lets the real function (an emulator here) run."""

    def __init__(self) -> None:
        self.calls: list[Call] = []

    def wrap(self, qualname: str, fn: Callable[..., Any], owner: dict[str, Any] | None = None) -> Callable[..., Any]:
        def recorded_call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append(Call(qualname, args, dict(kwargs), dict(owner or {})))
            return fn(*args, **kwargs)

        return recorded_call

    def wrap_class(self, qualname: str, cls: type) -> type:
        """A subclass of the emulated wrapper ``cls`` recording ``__init__``, ``plan`` and ``run``."""
        rec = self

        class Recorded(cls):  # type: ignore[misc,valid-type]
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                init = Call(f"{qualname}.__init__", args, dict(kwargs))
                rec.calls.append(init)
                self._contract_owner = init
                super().__init__(*args, **kwargs)

            def plan(self, *args: Any, **kwargs: Any) -> Any:
                rec.calls.append(Call(f"{qualname}.plan", args, dict(kwargs), _owner_view(self)))
                return super().plan(*args, **kwargs)

            def run(self, *args: Any, **kwargs: Any) -> Any:
                rec.calls.append(Call(f"{qualname}.run", args, dict(kwargs), _owner_view(self)))
                return super().run(*args, **kwargs)

        Recorded.__name__ = cls.__name__
        return Recorded


def record_mla_forward(qualname: str, emulator: Callable[..., Any], problem: tuple[Any, ...],
                       build: Callable[[Any, Any, Callable[..., Any]], Any]) -> list[Call]:
    """The library calls of one MLA forward: ``problem`` is ``(cache, batch, layer, q, latent)``; ``build(cache,
    layer, kernel)`` makes the backend with ``kernel``, ``emulator`` recorded as ``qualname``."""
    rec = Recorder()
    cache, batch, layer, q, lat = problem
    be = build(cache, layer, rec.wrap(qualname, emulator))
    be.init_forward_metadata(batch)
    be.forward(q, lat, None, layer, batch)
    return rec.calls


def _owner_view(wrapper: Any) -> dict[str, Any]:
    init: Call = wrapper._contract_owner
    names = ("float_workspace_buffer", "kv_layout", "use_cuda_graph")
    view = dict(zip(names, init.args))
    view.update(init.kwargs)
    view["_class"] = init.qualname.rsplit(".", 2)[-2]
    view["_instance"] = id(wrapper)  # which wrapper object: sequence_problems follows one wrapper's plans
    return view


# -- preconditions ------------------------------------------------------------------------
Check = Callable[[dict[str, Any], str, dict[str, Any], bool], list[str]]


def _int32(a: dict[str, Any], *names: str) -> list[str]:
    return [f"{n} must be int32, got {a[n].dtype}" for n in names
            if isinstance(a.get(n), torch.Tensor) and a[n].dtype != torch.int32]


def _last_dim_contiguous(a: dict[str, Any], *names: str) -> list[str]:
    return [f"{n} must have contiguous last dimension (stride {a[n].stride(-1)})" for n in names
            if isinstance(a.get(n), torch.Tensor) and a[n].stride(-1) != 1]


def _fa3_kvcache(a: dict[str, Any], version: str, owner: dict[str, Any], strict: bool) -> list[str]:
    """sgl-kernel ``flash_attn_with_kvcache`` -> ``mha_fwd`` (sgl-kernel/csrc/flash_extension.cc, FA3
    hopper/flash_api.cpp): int32 index tensors, same q/KV dtype, contiguous last dims, paged cache
    ``[pages, page_size, kv_heads, dim]``, ``sinks`` bfloat16 of one value per query head
    ("sinks must have dtype bfloat16"), fp8 head dims multiples of 16."""
    out = _int32(a, "cache_seqlens", "page_table", "cu_seqlens_q") + _last_dim_contiguous(a, "q", "k_cache", "v_cache")
    q, kc = a["q"], a["k_cache"]
    if q.dtype != kc.dtype:
        out.append(f"q ({q.dtype}) and k_cache ({kc.dtype}) must have one dtype")
    if a.get("page_table") is not None and kc.dim() != 4:
        out.append(f"a paged k_cache is [num_pages, page_size, kv_heads, dim], got {tuple(kc.shape)}")
    s = a.get("sinks")
    if s is not None:
        if s.dtype != torch.bfloat16:
            out.append(f"sinks must have dtype bfloat16, got {s.dtype}")
        if s.numel() != q.shape[-2]:
            out.append(f"sinks must hold one value per query head ({q.shape[-2]}), got {s.numel()}")
    if kc.dtype in _FP8 and q.shape[-1] % 16:
        out.append(f"the fp8 path needs head_dim % 16 == 0, got {q.shape[-1]}")
    cu = a.get("cu_seqlens_q")
    batch = cu.numel() - 1 if isinstance(cu, torch.Tensor) else q.shape[0]
    for n in ("q_descale", "k_descale", "v_descale"):  # flash_api.cpp: CHECK_SHAPE(x, batch_size, num_heads_k)
        t = a.get(n)
        if t is None:
            continue
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32:
            out.append(f"{n} must be a float32 tensor (read through data_ptr<float>), got {getattr(t, 'dtype', t)!r}")
        elif tuple(t.shape) != (batch, kc.shape[-2]):
            out.append(f"{n} must have shape (batch_size, num_heads_k) = {(batch, kc.shape[-2])}, got {tuple(t.shape)}")
        elif t.device != q.device:
            out.append(f"{n} must be on q's device")
    if strict and q.dtype not in _HALF + _FP8:
        out.append(f"FA3 supports fp16/bf16/fp8 q, got {q.dtype}")
    d, dv = q.shape[-1], a["v_cache"].shape[-1]
    if dv != d and not ((128 < d <= 192 and 96 < dv <= 128) or (d <= 64 and dv <= 512)):
        out.append(f"V head dim {dv} differs from Q/K head dim {d}: FA3 supports Q/K in (128, 192] with V in "
                   f"(96, 128], or Q/K <= 64 and V <= 512")
    if dv > 256 and q.dtype not in _HALF:
        out.append(f"HeaddimV > 256 requires fp16 and bf16 data type, got {q.dtype}")
    qv = a.get("qv")
    if qv is not None:  # flash_api.cpp: q_v
        if d > 64:
            out.append(f"q_v is only supported for head_size <= 64, got {d}")
        if q.dtype not in _HALF or qv.dtype != q.dtype:
            out.append(f"q_v needs fp16/bf16 q and the query's dtype, got q {q.dtype}, qv {qv.dtype}")
        if tuple(qv.shape) != (*q.shape[:-1], dv):
            out.append(f"q_v must have shape {(*q.shape[:-1], dv)} (total_q, num_heads, head_size_v), "
                       f"got {tuple(qv.shape)}")
        out += _last_dim_contiguous(a, "qv")
    return out


def _bmm_scale_problems(a: dict[str, Any]) -> list[str]:
    """trtllm-gen's ``bmm1_scale`` / ``bmm2_scale``: a float, or a float32 tensor ("bmm1_scale tensor must have
    dtype torch.float32", decode.py); the same rule for the MHA and the MLA entry points."""
    out = []
    for n in ("bmm1_scale", "bmm2_scale"):
        t = a.get(n)
        if isinstance(t, torch.Tensor):
            if t.dtype != torch.float32:
                out.append(f"{n} tensor must have dtype torch.float32, got {t.dtype}")
        elif not isinstance(t, (float, int)) or isinstance(t, bool):
            out.append(f"{n} must be a float or a float32 tensor, got {type(t).__name__}")
    return out


def _trtllm(a: dict[str, Any], version: str, owner: dict[str, Any], strict: bool) -> list[str]:
    """flashinfer ``trtllm_batch_{decode,context}_with_kv_cache`` (flashinfer/decode.py, prefill.py and the
    trtllm-gen FMHA runner): int32 block tables / lengths, HND ``[pages, kv_heads, page_size, dim]`` pages
    of 16/32/64 tokens, float32 sinks per query head, and non-degenerate KV strides: with one KV head
    the head stride must not equal the token stride (trtllm-gen cannot build its TMA descriptor)."""
    out = _int32(a, "block_tables", "seq_lens", "cum_seq_lens_q", "cum_seq_lens_kv")
    kv = a["kv_cache"]
    pair = kv if isinstance(kv, tuple) else (kv,)
    layout = a.get("kv_layout") or "HND"
    for name, t in zip(("k_cache", "v_cache"), pair):
        if t.dim() != 4:
            out.append(f"{name} must be 4-D [pages, kv_heads, page_size, dim] ({layout}), got {tuple(t.shape)}")
            continue
        if t.stride(-1) != 1:
            out.append(f"{name} must have contiguous last dimension")
        ps_dim = 2 if layout == "HND" else 1
        if t.shape[ps_dim] not in (16, 32, 64):
            out.append(f"{name} page size {t.shape[ps_dim]} (trtllm-gen needs 16/32/64)")
        heads_dim = 1 if layout == "HND" else 2
        if t.shape[heads_dim] == 1 and t.stride(heads_dim) == t.stride(ps_dim):
            out.append(f"{name} with one KV head has head stride == token stride {tuple(t.stride())}: "
                       f"the degenerate pattern trtllm-gen's TMA descriptor rejects (canonicalise the strides)")
    s = a.get("sinks")
    if s is not None:
        if s.dtype != torch.float32:
            out.append(f"sinks must be float32, got {s.dtype}")
        if s.numel() != a["query"].shape[-2]:
            out.append(f"sinks must hold one value per query head ({a['query'].shape[-2]}), got {s.numel()}")
    out += _bmm_scale_problems(a)
    q, kc = a["query"], pair[0]
    if q.dtype != kc.dtype:
        out.append(f"query ({q.dtype}) and the cache ({kc.dtype}) must share a dtype (fp8 KV: cast the query)")
    if strict and q.dtype not in _HALF + (torch.float8_e4m3fn,):
        out.append(f"trtllm-gen takes fp16/bf16/e4m3 queries, got {q.dtype}")
    return out


def _fi_init(a: dict[str, Any], version: str, owner: dict[str, Any], strict: bool) -> list[str]:
    out = []
    if a.get("kv_layout") not in ("NHD", "HND"):
        out.append(f"kv_layout must be 'NHD' or 'HND', got {a.get('kv_layout')!r}")
    return out


#: flashinfer's first release whose FA3 prefill path checks q/KV dtypes (before it, ``backend="auto"``
#: on SM90 picks FA3 and fp16/bf16 q over an fp8 cache JIT-compiles an invalid kernel).
FLASHINFER_FA3_FP8_CHECKED = "0.6.4"


#: flashinfer's tensor-core decode (``use_tensor_cores=True``: the prefill kernel) under ``backend="auto"``
#: resolves through ``determine_attention_backend``, which picks FA3 on SM90 — for every q/KV dtype in
#: 0.6.0-0.6.3 (decode.py, the tensor-core branch of ``plan``; the issue-27 reading of the wheels), and for
#: fp8 q or KV in every recorded release (the installed 0.7.4's decode.py: ``if {fp8} & {q, kv}:
#: determine_attention_backend(...) else "fa2"``). ``[first, end)`` per case; ``None``: no end yet.
FLASHINFER_DECODE_AUTO_FA3: dict[str, tuple[str, str | None]] = {"any": ("0.6.0", "0.6.4"), "fp8": ("0.5.0", None)}
#: Before this release a prefill wrapper built with ``backend="auto"`` keeps the backend its FIRST plan
#: resolved (``self._backend`` overwritten); 0.7.4 re-resolves from the requested backend at every plan.
#: An extend's plan fixes FA3 on SM90, and a later plan with ``custom_mask`` then fails there
#: (``cudaErrorNotSupported``): flashinfer <= 0.6.4.
FLASHINFER_AUTO_STICKS_BEFORE = "0.6.5"


def _in(version: str, span: tuple[str, str | None]) -> bool:
    lo, hi = span
    return version_key(lo) <= version_key(version) and (hi is None or version_key(version) < version_key(hi))


def _fi_plan(kind: str) -> Check:
    index = {"decode": ("indptr", "indices", "last_page_len"),
             "paged": ("qo_indptr", "paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len"),
             "ragged": ("qo_indptr", "kv_indptr")}[kind]

    def check(a: dict[str, Any], version: str, owner: dict[str, Any], strict: bool) -> list[str]:
        """flashinfer ``plan`` (flashinfer/decode.py, prefill.py): int32 CSR index arrays; the split
        arguments (``fixed_split_size``/``disable_split_kv``) reach the kernel only on the FA2 path
        (``if self._backend == "fa2"``), so a prefill wrapper left at ``backend="auto"`` drops them on
        SM90; ``fixed_split_size`` is documented as not guaranteed under CUDA graphs; fp8 KV under
        ``backend="auto"`` needs flashinfer >= 0.6.4 (SM90 FA3 path)."""
        out = _int32(a, *index)
        backend = owner.get("backend", "auto")
        split = a.get("fixed_split_size") not in (None, -1) or bool(a.get("disable_split_kv"))
        if kind != "decode" and split and backend != "fa2":
            out.append(f"split arguments (fixed_split_size/disable_split_kv) with backend={backend!r}: only the "
                       f"FA2 path honours them (SM90 'auto' selects FA3 and drops them); pin backend='fa2'")
        if a.get("fixed_split_size") not in (None, -1) and owner.get("use_cuda_graph"):
            out.append("fixed_split_size is not guaranteed under CUDA graphs (use disable_split_kv)")
        if kind == "decode" and a.get("fixed_split_size") not in (None, -1) and not owner.get("use_tensor_cores"):
            out.append("fixed_split_size is only supported by tensor-core decode")
        kv_dt, q_dt = a.get("kv_data_type"), a.get("q_data_type")
        if (kind == "paged" and backend == "auto" and kv_dt in _FP8 and q_dt not in _FP8
                and version_key(version) < version_key(FLASHINFER_FA3_FP8_CHECKED)):
            out.append(f"fp8 KV with {q_dt} queries under backend='auto': on SM90 flashinfer {version} selects "
                       f"FA3, which before {FLASHINFER_FA3_FP8_CHECKED} builds an invalid kernel; pin backend='fa2'")
        if kind == "decode" and owner.get("use_tensor_cores") and backend != "fa2":
            fp8 = kv_dt in _FP8 or q_dt in _FP8
            if _in(version, FLASHINFER_DECODE_AUTO_FA3["any"]) or (fp8 and _in(version, FLASHINFER_DECODE_AUTO_FA3["fp8"])):
                if split:
                    out.append(f"tensor-core decode with backend={backend!r}: on SM90 flashinfer {version} resolves it "
                               f"to FA3, which drops disable_split_kv/fixed_split_size; pin backend='fa2'")
                if fp8 and version_key(version) < version_key(FLASHINFER_FA3_FP8_CHECKED):
                    out.append(f"tensor-core decode of fp8 KV with backend={backend!r}: on SM90 flashinfer {version} "
                               f"selects FA3, which before {FLASHINFER_FA3_FP8_CHECKED} builds an invalid kernel; "
                               f"pin backend='fa2'")
        return out

    return check


def _fi_run(a: dict[str, Any], version: str, owner: dict[str, Any], strict: bool) -> list[str]:
    """flashinfer wrapper ``run``: ``q_scale``/``k_scale``/``v_scale`` are ``Optional[float]`` (the decode
    wrapper's annotation, flashinfer/decode.py; the prefill wrapper's also allows a tensor)."""
    out = _last_dim_contiguous(a, "q")
    for n in ("q_scale", "k_scale", "v_scale"):
        t = a.get(n)
        if t is not None and (not isinstance(t, (float, int)) or isinstance(t, bool)):
            out.append(f"{n} must be a float (Optional[float]), got {type(t).__name__}")
    if owner.get("kv_layout") == "NHD" and isinstance(a.get("paged_kv_cache"), tuple):
        for t in a["paged_kv_cache"]:
            if t.dim() != 4:
                out.append(f"NHD pages are [num_pages, page_size, kv_heads, dim], got {tuple(t.shape)}")
    if strict and a["q"].dtype not in _HALF:
        out.append(f"flashinfer's FA2 kernels take fp16/bf16 queries, got {a['q'].dtype}")
    return out


def _aiter_prefill(a: dict[str, Any], version: str, owner: dict[str, Any], strict: bool) -> list[str]:
    """aiter ``mha_batch_prefill_func`` (aiter/ops/mha.py, v0.1.10): int32 indptr/indices, ``sink_ptr`` one
    value per query head on q's device (converted to float32), linear K/V of 3 or 4 dims."""
    out = _int32(a, "cu_seqlens_q", "kv_indptr", "kv_page_indices", "kv_last_page_lens")
    q, k, v = a["q"], a["k"], a["v"]
    if k.dim() not in (3, 4) or v.dim() != k.dim():
        out.append(f"k/v must be linear 3-D or 4-D (or vectorised 5-D), got {k.dim()}-D/{v.dim()}-D")
    s = a.get("sink_ptr")
    if s is not None:
        if s.device != q.device:
            out.append("sink_ptr must be on the same device as q")
        if s.shape[0] != q.size(1):
            out.append(f"sink_ptr has incorrect shape {tuple(s.shape)} (one per query head: {q.size(1)})")
    if strict and q.dtype not in _HALF:
        out.append(f"aiter's batch prefill takes fp16/bf16 q, got {q.dtype}")
    return out


def _aiter_ragged(a: dict[str, Any], version: str, owner: dict[str, Any], strict: bool) -> list[str]:
    """aiter ``paged_attention_ragged`` (aiter/ops/attention.py): int32 ragged indices, out in q's dtype,
    float32 k/v scale tensors, layout 'NHD'/'HND', 4-D caches."""
    out = _int32(a, "kv_indptr", "kv_page_indices", "kv_last_page_lens")
    if a["kv_cache_layout"] not in ("NHD", "HND"):
        out.append(f"kv_cache_layout must be 'NHD' or 'HND', got {a['kv_cache_layout']!r}")
    if a["out"].dtype != a["query"].dtype:
        out.append(f"out ({a['out'].dtype}) must have the query dtype ({a['query'].dtype})")
    for n in ("k_scale", "v_scale"):
        t = a[n]
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32:
            out.append(f"{n} must be a float32 tensor")
    for n in ("key_cache", "value_cache"):
        if a[n].dim() != 4:
            out.append(f"{n} must be 4-D, got {tuple(a[n].shape)}")
    return out


def _fi_mla_init(a: dict[str, Any], version: str, owner: dict[str, Any], strict: bool) -> list[str]:
    """``BatchMLAPagedAttentionWrapper(float_workspace_buffer, use_cuda_graph, ..., backend)`` (flashinfer/mla.py):
    a uint8 workspace; ``backend`` one of the kernels it dispatches to."""
    out = []
    ws = a["float_workspace_buffer"]
    if not isinstance(ws, torch.Tensor) or ws.dtype != torch.uint8:
        out.append(f"float_workspace_buffer must be a uint8 tensor, got {getattr(ws, 'dtype', type(ws).__name__)}")
    if a.get("backend") not in ("auto", "fa2", "fa3", "cutlass"):
        out.append(f"backend must be 'auto', 'fa2', 'fa3' or 'cutlass', got {a.get('backend')!r}")
    return out


#: the latent shape flashinfer's MLA kernels are instantiated for (DeepSeek-V2/V3: ckv 512, kpe 64)
FI_MLA_DIMS = (512, 64)


def _fi_mla_plan(a: dict[str, Any], version: str, owner: dict[str, Any], strict: bool) -> list[str]:
    """``BatchMLAPagedAttentionWrapper.plan``: int32 CSR arrays over pages (``kv_indptr``/``kv_indices``) and
    ``kv_len_arr`` (keys per request), the 512 + 64 latent, fp16/bf16 query and KV of one dtype."""
    out = _int32(a, "qo_indptr", "kv_indptr", "kv_indices", "kv_len_arr")
    if (a["head_dim_ckv"], a["head_dim_kpe"]) != FI_MLA_DIMS:
        out.append(f"head_dim_ckv/head_dim_kpe {a['head_dim_ckv']}/{a['head_dim_kpe']} (kernels exist for 512/64)")
    for n in ("qo_indptr", "kv_indptr"):
        if a[n].shape[0] != a["kv_len_arr"].shape[0] + 1:
            out.append(f"{n} has {a[n].shape[0]} entries for {a['kv_len_arr'].shape[0]} requests (expected B + 1)")
    if not isinstance(a["sm_scale"], float):
        out.append(f"sm_scale must be a float, got {type(a['sm_scale']).__name__}")
    if strict and a["q_data_type"] not in _HALF:
        out.append(f"q_data_type must be fp16/bf16, got {a['q_data_type']}")
    if a["kv_data_type"] != a["q_data_type"]:
        out.append(f"kv_data_type {a['kv_data_type']} differs from q_data_type {a['q_data_type']}")
    if not isinstance(a["causal"], bool):
        out.append(f"causal must be a bool, got {a['causal']!r}")
    return out


def _fi_mla_run(a: dict[str, Any], version: str, owner: dict[str, Any], strict: bool) -> list[str]:
    """``BatchMLAPagedAttentionWrapper.run(q_nope, q_pe, ckv_cache, kpe_cache, out=)``: ``[T, H, 512]`` /
    ``[T, H, 64]`` queries, ``[pages, page_size, 512]`` / ``[pages, page_size, 64]`` caches (strided views of one
    latent buffer are fine: the kernels take the row stride), each with a contiguous last dimension, one dtype."""
    out = _last_dim_contiguous(a, "q_nope", "q_pe", "ckv_cache", "kpe_cache")
    qn, qp, ckv, kpe = a["q_nope"], a["q_pe"], a["ckv_cache"], a["kpe_cache"]
    if qn.dim() != 3 or qp.dim() != 3 or qn.shape[:2] != qp.shape[:2]:
        out.append(f"q_nope {tuple(qn.shape)} / q_pe {tuple(qp.shape)} must be [tokens, heads, dim] alike")
    if ckv.dim() != 3 or kpe.dim() != 3 or ckv.shape[:2] != kpe.shape[:2]:
        out.append(f"ckv_cache {tuple(ckv.shape)} / kpe_cache {tuple(kpe.shape)} must be [pages, page_size, dim] alike")
    if (qn.shape[-1], qp.shape[-1]) != FI_MLA_DIMS or (ckv.shape[-1], kpe.shape[-1]) != FI_MLA_DIMS:
        out.append(f"q_nope/q_pe last dims {qn.shape[-1]}/{qp.shape[-1]}, ckv/kpe {ckv.shape[-1]}/{kpe.shape[-1]} "
                   f"(expected 512/64)")
    if len({qn.dtype, qp.dtype, ckv.dtype, kpe.dtype}) != 1:
        out.append(f"dtypes differ: q_nope {qn.dtype}, q_pe {qp.dtype}, ckv {ckv.dtype}, kpe {kpe.dtype}")
    o = a.get("out")
    if o is not None and (tuple(o.shape) != (*qn.shape[:2], FI_MLA_DIMS[0]) or o.dtype != qn.dtype):
        out.append(f"out {tuple(o.shape)} {o.dtype}, expected {(*qn.shape[:2], FI_MLA_DIMS[0])} {qn.dtype}")
    return out


def _trtllm_mla(a: dict[str, Any], version: str, owner: dict[str, Any], strict: bool) -> list[str]:
    """``trtllm_batch_decode_with_kv_cache_mla`` (flashinfer/decode.py in 0.5.0, mla.py after): query
    ``[B, q_len, H, kv_lora_rank + qk_rope]``, kv_cache ``[pages, page_size, 576]`` (or ``[pages, 1, page_size,
    576]``) with blocks of 32 or 64 ("Supported block_size are 32 and 64"), kv_lora_rank 512 and qk_rope 64,
    int32 block tables and lengths, one dtype for query and cache, float (or float32 tensor) scales."""
    out = _int32(a, "block_tables", "seq_lens")
    q, kv = a["query"], a["kv_cache"]
    if q.dim() != 4:
        out.append(f"query must be 4-D [batch, q_len_per_request, heads, dim], got {tuple(q.shape)}")
    if kv.dim() not in (3, 4) or (kv.dim() == 4 and kv.shape[1] != 1):
        out.append(f"kv_cache must be [pages, page_size, dim] or [pages, 1, page_size, dim], got {tuple(kv.shape)}")
    elif kv.shape[-2] not in (32, 64):
        out.append(f"kv_cache block size {kv.shape[-2]}: supported block_size are 32 and 64")
    if (a["kv_lora_rank"], a["qk_rope_head_dim"]) != (512, 64):
        out.append(f"kv_lora_rank/qk_rope_head_dim {a['kv_lora_rank']}/{a['qk_rope_head_dim']} (expected 512/64)")
    width = a["kv_lora_rank"] + a["qk_rope_head_dim"]
    if q.shape[-1] != width or kv.shape[-1] != width:
        out.append(f"query/kv_cache last dims {q.shape[-1]}/{kv.shape[-1]}, expected kv_lora_rank + qk_rope = {width}")
    if q.dtype != kv.dtype:
        out.append(f"query ({q.dtype}) and kv_cache ({kv.dtype}) must share a dtype")
    if strict and q.dtype not in _HALF + (torch.float8_e4m3fn,):
        out.append(f"trtllm-gen MLA takes fp16/bf16/e4m3, got {q.dtype}")
    if a["block_tables"].shape[0] != q.shape[0] or a["seq_lens"].shape[0] != q.shape[0]:
        out.append("block_tables / seq_lens rows must equal the query batch")
    if not isinstance(a["max_seq_len"], int) or isinstance(a["max_seq_len"], bool):
        out.append(f"max_seq_len must be an int, got {type(a['max_seq_len']).__name__}")
    out += _bmm_scale_problems(a)
    o = a.get("out")
    if o is not None and tuple(o.shape) not in ((*q.shape[:-1], a["kv_lora_rank"]),
                                                (q.shape[0] * q.shape[1], q.shape[2], a["kv_lora_rank"])):
        out.append(f"out {tuple(o.shape)} does not fit query {tuple(q.shape)} with kv_lora_rank {a['kv_lora_rank']}")
    return out


#: aiter's MLA decode (csrc/py_itfs_cu/asm_mla.cu, v0.1.10): the heads whose bf16 kernels exist (non-persistent,
#: one query per request), and the latent width of its ``.co`` kernels
AITER_MLA_HEADS = (16, 32, 64, 128)
AITER_MLA_WIDTH, AITER_MLA_V = 576, 512


def _aiter_mla_decode(a: dict[str, Any], version: str, owner: dict[str, Any], strict: bool) -> list[str]:
    """``aiter.mla.mla_decode_fwd`` (aiter/mla.py + csrc/py_itfs_cu/asm_mla.cu, v0.1.10): ``kv_buffer`` 4-D
    ``[num_page, page_size, nhead_kv, 576]`` with ``num_kv_heads==1``, a contiguous ``q [total_s, H, 576]``
    (``head_size == KV.size(3)``), ``o [total_s, H, 512]`` preallocated, int32 indptrs/indices, bf16 q and KV
    (the non-fp8 kernels), ``logit_cap <= 0`` ("is not support yet"), query heads per KV head in 16/32/64/128
    for one query per request; ``max_seqlen_q`` an int, ``sm_scale`` a float."""
    out = _int32(a, "qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_lens")
    q, kv, o = a["q"], a["kv_buffer"], a["o"]
    if kv.dim() != 4:
        out.append(f"kv_buffer must be 4-D [num_page, page_size, nhead_kv, head_size], got {tuple(kv.shape)}")
    elif kv.shape[2] != 1:
        out.append(f"only support num_kv_heads==1, got kv_buffer {tuple(kv.shape)}")
    if q.dim() != 3 or not q.is_contiguous():
        out.append(f"q must be a contiguous [total_s, heads, head_size], got {tuple(q.shape)}")
    elif q.shape[-1] != kv.shape[-1] or q.shape[-1] != AITER_MLA_WIDTH:
        out.append(f"q head_size {q.shape[-1]} / kv_buffer {kv.shape[-1]}: the kernels take {AITER_MLA_WIDTH}")
    if o.dim() != 3 or tuple(o.shape[:2]) != tuple(q.shape[:2]) or o.shape[-1] != AITER_MLA_V or o.dtype != q.dtype:
        out.append(f"o {tuple(o.shape)} {o.dtype} must be [total_s, heads, {AITER_MLA_V}] in q's dtype "
                   f"({tuple(q.shape[:2])}, {q.dtype})")
    if q.dim() == 3 and q.shape[1] not in AITER_MLA_HEADS:
        out.append(f"{q.shape[1]} query heads: the bf16 decode kernels exist for {AITER_MLA_HEADS}")
    if q.dtype != kv.dtype:
        out.append(f"q ({q.dtype}) and kv_buffer ({kv.dtype}) differ")
    if strict and q.dtype != torch.bfloat16:
        out.append(f"aiter's MLA decode kernels take bf16 (or fp8) q, got {q.dtype}")
    if a["qo_indptr"].shape[0] != a["kv_indptr"].shape[0]:
        out.append(f"qo_indptr ({a['qo_indptr'].shape[0]}) and kv_indptr ({a['kv_indptr'].shape[0]}) must both be B + 1")
    m = a["max_seqlen_q"]
    if not isinstance(m, int) or isinstance(m, bool) or m < 1:
        out.append(f"max_seqlen_q must be a positive int, got {m!r}")
    s = a.get("sm_scale")
    if s is not None and not isinstance(s, float):
        out.append(f"sm_scale must be a float, got {type(s).__name__}")
    if (a.get("logit_cap") or 0.0) > 0:
        out.append(f"logit_cap={a['logit_cap']} is not support yet (mla_decode_fwd asserts logit_cap <= 0)")
    return out


_FI = "flashinfer."
PRECONDITIONS: dict[str, Check] = {
    _FI + "mla.BatchMLAPagedAttentionWrapper.__init__": _fi_mla_init,
    _FI + "mla.BatchMLAPagedAttentionWrapper.plan": _fi_mla_plan,
    _FI + "mla.BatchMLAPagedAttentionWrapper.run": _fi_mla_run,
    "flashinfer.decode.trtllm_batch_decode_with_kv_cache_mla": _trtllm_mla,
    "sgl_kernel.flash_attn.flash_attn_with_kvcache": _fa3_kvcache,
    "flashinfer.decode.trtllm_batch_decode_with_kv_cache": _trtllm,
    "flashinfer.prefill.trtllm_batch_context_with_kv_cache": _trtllm,
    _FI + "BatchDecodeWithPagedKVCacheWrapper.__init__": _fi_init,
    _FI + "BatchPrefillWithPagedKVCacheWrapper.__init__": _fi_init,
    _FI + "BatchDecodeWithPagedKVCacheWrapper.plan": _fi_plan("decode"),
    _FI + "BatchPrefillWithPagedKVCacheWrapper.plan": _fi_plan("paged"),
    _FI + "BatchDecodeWithPagedKVCacheWrapper.run": _fi_run,
    _FI + "BatchPrefillWithPagedKVCacheWrapper.run": _fi_run,
    "aiter.mha_batch_prefill_func": _aiter_prefill,
    "aiter.paged_attention_ragged": _aiter_ragged,
    "aiter.mla.mla_decode_fwd": _aiter_mla_decode,
}


def problems(call: Call, library: str, version: str, *, strict: bool = True,
             sig: inspect.Signature | None = None) -> list[str]:
    """Why ``call`` would fail against ``library`` ``version``: it does not bind to the real signature,
    or breaks a documented precondition. Empty when it would be accepted."""
    if sig is None:
        sig = signature(library, version, call.qualname)
    if sig is None:
        return [f"{call.qualname} does not exist in {library} {version}"]
    try:
        a = call.arguments(sig)
    except TypeError as exc:
        return [f"{call.qualname} does not bind to {library} {version}'s signature: {exc}"]
    return [f"{call.qualname} ({library} {version}): {p}"
            for p in PRECONDITIONS[call.qualname](a, version, call.owner, strict)]


def sequence_problems(calls: list[Call], library: str, version: str) -> list[str]:
    """What only the ORDER of calls breaks: a flashinfer prefill wrapper left at ``backend="auto"`` and planned
    first without, later with a ``custom_mask`` keeps the first plan's choice before
    ``FLASHINFER_AUTO_STICKS_BEFORE`` (FA3 on SM90, which refuses the custom mask)."""
    if library != "flashinfer-python" or version_key(version) >= version_key(FLASHINFER_AUTO_STICKS_BEFORE):
        return []
    out: list[str] = []
    plain_first: set[int] = set()
    for call in calls:
        if call.qualname != _FI + "BatchPrefillWithPagedKVCacheWrapper.plan":
            continue
        if call.owner.get("backend", "auto") == "fa2":
            continue
        sig = signature(library, version, call.qualname)
        try:
            a = call.arguments(sig) if sig is not None else {}
        except TypeError:
            continue  # problems() reports it
        inst = call.owner.get("_instance", -1)
        if a.get("custom_mask") is None and a.get("packed_custom_mask") is None:
            plain_first.add(inst)
        elif inst in plain_first:
            out.append(f"{call.qualname} ({library} {version}): a custom-mask plan on a backend='auto' wrapper "
                       f"first planned without one: before {FLASHINFER_AUTO_STICKS_BEFORE} the first plan's choice "
                       f"sticks (FA3 on SM90), which fails with a custom mask; give the verify its own wrapper or "
                       f"pin backend='fa2'")
    return out


def require(qualname: str, library: str, version: str, args: tuple[Any, ...], kwargs: dict[str, Any],
            owner: dict[str, Any] | None = None) -> None:
    """For emulators: fail as the real library would (non-strict: float32 test problems pass)."""
    found = problems(Call(qualname, args, dict(kwargs), dict(owner or {})), library, version, strict=False)
    assert not found, "; ".join(found)


def emulates(qualname: str, library: str, version: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator for an emulator of ``qualname``: every call is first bound against the real signature of
    ``library`` ``version`` and checked against its preconditions (non-strict), then emulated. For a wrapper
    method the instance's ``contract_owner`` (its constructor arguments) is the owner."""
    method = Call(qualname, (), {}).is_method and not qualname.endswith(".__init__")

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def checked(*args: Any, **kwargs: Any) -> Any:
            if method:
                require(qualname, library, version, args[1:], kwargs, getattr(args[0], "contract_owner", {}))
            elif qualname.endswith(".__init__"):
                require(qualname, library, version, args[1:], kwargs)
            else:
                require(qualname, library, version, args, kwargs)
            return fn(*args, **kwargs)

        return checked

    return deco
