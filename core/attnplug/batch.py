"""``ForwardBatch``: what one forward pass carries, validated once per forward."""

from __future__ import annotations

import array
import dataclasses
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

import torch

from .errors import ShapeError
from .kvcache import _not_inference, indptr
from .layer import ABSORBED, MLA_FORMS
from .modes import ForwardMode

if TYPE_CHECKING:
    from .layer import LayerSpec

#: what the constructors take for an index or length field: a tensor, or a list of ints
IndexLike: TypeAlias = "torch.Tensor | Sequence[int]"
#: a device as torch takes it
DeviceLike: TypeAlias = "torch.device | str | int"


@dataclasses.dataclass(eq=False)
class ForwardBatch:
    """One forward pass.

    Per request ``i`` (batch order): ``req_pool_indices[i]`` is its row in
    ``req_to_token``; ``seq_lens[i]`` is its KV length *after* this forward
    (new tokens included); ``extend_prefix_lens[i]`` is the cached length
    before it and ``extend_seq_lens[i]`` the number of new tokens (decode: 1).
    Tokens are laid out request after request: ``out_cache_loc[t]`` is the slot
    for new token ``t``, ``positions[t]`` its position.

    Speculative fields: ``spec_num_draft_tokens`` (tokens per request in
    target-verify) and ``spec_custom_mask`` (bool ``[batch, draft, draft]``:
    draft token ``a`` may see draft token ``b``; ``None`` means causal among
    drafts; the prefix is always visible). Cross-attention layers read
    ``encoder_lens[i]`` cached tokens at positions ``0 … encoder_lens[i]-1``.

    ``mla_form``: how MLA layers (``LayerSpec.mla``) of this forward are computed, the host's choice per
    forward: ``"absorbed"`` (the default: q in the latent space, output ``[T, H, kv_lora_rank]``) or
    ``"unabsorbed"`` (per-head q, the backend decompresses the latent rows with ``w_kc``/``w_vc``, output
    ``[T, H, mla.v_head_dim]``); see docs/mla.md. Layers that are not MLA ignore it.
    """

    forward_mode: ForwardMode
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    out_cache_loc: torch.Tensor
    extend_prefix_lens: torch.Tensor | None = None
    extend_seq_lens: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    encoder_lens: torch.Tensor | None = None
    spec_num_draft_tokens: int | None = None
    spec_custom_mask: torch.Tensor | None = None
    mla_form: str = ABSORBED
    #: host-side copies, filled by ``validate`` so backends need no device sync
    seq_lens_cpu: list[int] = dataclasses.field(default_factory=list)
    extend_prefix_lens_cpu: list[int] = dataclasses.field(default_factory=list)
    extend_seq_lens_cpu: list[int] = dataclasses.field(default_factory=list)
    req_pool_indices_cpu: list[int] = dataclasses.field(default_factory=list)

    def __setattr__(self, name: str, value: Any) -> None:
        """Set a field; replacing an index field of a validated batch by another object also replaces the
        validation record by a copy (same entries, a new object): the per-layer guard compares that record's
        identity only (``PagedBackend._unchanged``: one read where a read per field cost ~4 µs a layer after a
        kernel that streamed the caches) — or, cheaper still, the old record's own mark (``ValidationRecord``:
        marked superseded here) — and ``changed_since_validate`` names the field from the copy's entries.
        (Writing into ``__dict__`` directly bypasses this and is not supported.)"""
        if name in _INDEX_FIELD_SET:
            d = self.__dict__
            snap = d.get("_validated")
            if snap is not None and (snap.get(name) or (None,))[0] is not value:
                d["_validated"] = _supersede(snap, ValidationRecord(snap))
        object.__setattr__(self, name, value)

    @property
    def batch_size(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.out_cache_loc.shape[0])

    # -- constructors ------------------------------------------------------
    @classmethod
    def idle(cls, device: DeviceLike = "cpu", **kw: Any) -> ForwardBatch:
        z = torch.zeros(0, dtype=torch.int64, device=device)
        return cls(ForwardMode.IDLE, z, z.clone(), z.clone(), z.clone(), z.clone(), z.clone(), **kw).validate()

    @classmethod
    def decode(
        cls, req_pool_indices: IndexLike, seq_lens: IndexLike, out_cache_loc: IndexLike, **kw: Any
    ) -> ForwardBatch:
        # ``after``: the host's previous decode batch (host ints only): tensors of it still holding this batch's
        # values, never written, are taken instead of made again (``_decode_from_host``)
        after = kw.pop("after", None)
        if not kw.keys() - {"mla_form"} and _all_ints(req_pool_indices, seq_lens, out_cache_loc):
            return cls._decode_from_host(list(req_pool_indices), list(seq_lens), list(out_cache_loc),
                                         kw.get("mla_form", ABSORBED), after)
        seq = _i64(seq_lens)
        return cls(
            ForwardMode.DECODE, _i64(req_pool_indices), seq, _i64(out_cache_loc),
            extend_prefix_lens=seq - 1, extend_seq_lens=torch.ones_like(seq), positions=seq - 1, **kw,
        ).validate()

    @classmethod
    def _decode_from_host(cls, rows: list[int], seq: list[int], loc: list[int], mla_form: str,
                          after: ForwardBatch | None = None) -> ForwardBatch:
        """``decode`` from host ints (what a host's scheduler holds): the checks ``validate`` runs, run on
        the ints themselves, then the tensors made from those very ints (so the host copies are the
        tensors' values without reading them back). Same fields, dtypes and errors as the tensor path.

        ``after`` (the previous decode step's batch, made here too): what it already holds is taken, not made
        again — its ``req_pool_indices`` when the rows are the same, its ``extend_seq_lens`` (ones) for the same
        batch size, and its ``seq_lens`` as this step's ``positions`` when each request is one token longer —
        each only while that tensor was never written (its write counter still 0: its values are the ints it
        was made from). The two batches then share the tensor: a write through either moves the counter
        both record, so the per-layer guard refuses it in the batch that uses it."""
        if mla_form not in MLA_FORMS:
            raise ShapeError(f"ForwardBatch.mla_form={mla_form!r} (expected one of {', '.join(MLA_FORMS)})")
        b = len(seq)
        if len(rows) != b:
            raise ShapeError(f"ForwardBatch.req_pool_indices has shape ({len(rows)},), expected ({b},)")
        for i, r in enumerate(rows):
            if r < 0:
                raise ShapeError(f"ForwardBatch.req_pool_indices[{i}]={r} (expected a row index >= 0)")
        if any(s < 1 for s in seq):
            raise ShapeError(f"seq_lens must be >= 1 for every request (got {seq})")
        if len(loc) != b:
            raise ShapeError(f"ForwardBatch.out_cache_loc has shape ({len(loc)},), expected ({b},)")
        for t, x in enumerate(loc):
            if x < 0:
                raise ShapeError(f"ForwardBatch.out_cache_loc[{t}]={x} (expected a slot >= 0)")
        prefix = [s - 1 for s in seq]
        # made outside inference mode even when the host runs under it (the transformers runner, vLLM): the
        # tensors keep write counters, so an in-place change after this validation is refused per layer
        # (``changed_since_validate``) and the backends' per-slot-tensor memos need no private copy
        req_t = ones_t = pos_t = None
        made = None if after is None else after.__dict__.get("_made")
        if made is not None:  # (rows, req_pool_indices, extend_seq_lens, seq_lens ints, seq_lens) of ``after``
            if made[1]._version == 0 and made[0] == rows:
                req_t = made[1]
            if made[2]._version == 0 and len(made[0]) == b:
                ones_t = made[2]
            if made[4]._version == 0 and made[3] == prefix:
                pos_t = made[4]
        # the fields not taken from ``after``, made as views of one int64 buffer (``_host_i64_views``): one
        # allocation, and one write counter for all of them (a view shares its base's), so the per-layer guard
        # reads one counter for the lot (``_Forward``); ``changed_since_validate`` still names the field written
        fresh: list[tuple[str, list[int]]] = [("seq_lens", seq), ("out_cache_loc", loc), ("extend_prefix_lens", prefix)]
        if req_t is None:
            fresh.append(("req_pool_indices", rows))
        if ones_t is None:
            fresh.append(("extend_seq_lens", [1] * b))
        if pos_t is None:
            fresh.append(("positions", prefix))
        with _not_inference():
            made_t = _host_i64_views(fresh)
        fields: dict[str, Any] = dict(forward_mode=ForwardMode.DECODE,
                      req_pool_indices=req_t if req_t is not None else made_t["req_pool_indices"],
                      seq_lens=made_t["seq_lens"], out_cache_loc=made_t["out_cache_loc"],
                      extend_prefix_lens=made_t["extend_prefix_lens"],
                      extend_seq_lens=ones_t if ones_t is not None else made_t["extend_seq_lens"],
                      positions=pos_t if pos_t is not None else made_t["positions"], encoder_lens=None,
                      spec_num_draft_tokens=None, spec_custom_mask=None, mla_form=mla_form,
                      # the host copies ``_validated_as`` records
                      seq_lens_cpu=seq, extend_prefix_lens_cpu=prefix, extend_seq_lens_cpu=[1] * b,
                      req_pool_indices_cpu=rows)
        if cls is ForwardBatch:
            # every field set straight into the instance's ``__dict__``, as the generated ``__init__`` would through
            # the setter (~5 µs a batch for 15 Python-level setter calls; ``tests/fast/test_decode_from_host.py``
            # checks the two give the same fields)
            self = object.__new__(cls)
            self.__dict__.update(fields)
        else:  # a subclass: its own constructor
            host = {f: fields.pop(f) for f in ("seq_lens_cpu", "extend_prefix_lens_cpu", "extend_seq_lens_cpu",
                                               "req_pool_indices_cpu")}
            self = cls(**fields)
            self.__dict__.update(host)
        # the validation record ``_validated_as`` makes, written out: fresh tensors with write counters
        d = self.__dict__
        d["_validated"] = ValidationRecord({f: (t, None if t is None else t._version)
                                            for f in _INDEX_FIELDS for t in (d[f],)})
        # the ints the three tensors were made from (private copies), for ``host_ints``
        d["_host_ints"] = ((d["req_pool_indices"], d["seq_lens"], d["out_cache_loc"]),
                           (list(rows), list(seq), list(loc)))
        # what a next decode step may take (``after``): tensors with the ints they were made from (private copies)
        d["_made"] = (d["_host_ints"][1][0], d["req_pool_indices"], d["extend_seq_lens"], d["_host_ints"][1][1],
                      d["seq_lens"])
        return self

    def host_ints(self) -> tuple[list[int], list[int], list[int]] | None:
        """``(req_pool_indices, seq_lens, out_cache_loc)`` as host ints, without reading a tensor: only for a
        batch ``decode`` made from host ints, while its three fields are still the very tensors made from
        those ints (same objects), never written since (their write counters are the ones they had then),
        and its host copies ``req_pool_indices_cpu`` / ``seq_lens_cpu`` still equal them; else ``None``
        (read the tensors). The lists are the batch's private copies: do not change them."""
        d = self.__dict__
        rec = d.get("_host_ints")
        if rec is None:
            return None
        tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor] = rec[0]
        ints: tuple[list[int], list[int], list[int]] = rec[1]
        req, seq_t, loc_t = tensors
        if (d.get("req_pool_indices") is not req or d.get("seq_lens") is not seq_t or d.get("out_cache_loc") is not loc_t
                or req._version or seq_t._version or loc_t._version
                or ints[0] != self.req_pool_indices_cpu or ints[1] != self.seq_lens_cpu):
            return None
        return ints

    @classmethod
    def extend(
        cls,
        req_pool_indices: IndexLike,
        prefix_lens: IndexLike,
        extend_lens: IndexLike,
        out_cache_loc: IndexLike,
        mode: ForwardMode = ForwardMode.EXTEND,
        **kw: Any,
    ) -> "ForwardBatch":
        prefix, ext = _i64(prefix_lens), _i64(extend_lens)
        for field, t in (("extend_prefix_lens", prefix), ("extend_seq_lens", ext)):
            if t.dim() != 1:
                raise ShapeError(f"ForwardBatch.{field} has shape {tuple(t.shape)}, expected (batch,)")
            bad = [(i, x) for i, x in enumerate(t.tolist()) if x < 0]
            if bad:
                raise ShapeError(f"ForwardBatch.{field}[{bad[0][0]}]={bad[0][1]} (expected >= 0)")
        positions = kw.pop("positions", None)
        if positions is None:
            positions = torch.cat(
                [torch.arange(p, p + e, dtype=torch.int64) for p, e in zip(prefix.tolist(), ext.tolist())]
                or [torch.zeros(0, dtype=torch.int64)]
            ).to(prefix.device)
        return cls(
            mode, _i64(req_pool_indices), prefix + ext, _i64(out_cache_loc),
            extend_prefix_lens=prefix, extend_seq_lens=ext, positions=positions, **kw,
        ).validate()

    # -- validation (once per forward) -----------------------------------
    def validate(self) -> "ForwardBatch":
        """Check lengths agree; fill the host-side copies. Returns ``self``."""
        mode = self.forward_mode
        if not isinstance(mode, ForwardMode):
            raise ShapeError(f"ForwardBatch.forward_mode={mode!r} (expected a ForwardMode)")
        if self.mla_form not in MLA_FORMS:
            raise ShapeError(f"ForwardBatch.mla_form={self.mla_form!r} (expected one of {', '.join(MLA_FORMS)})")
        b = self.batch_size
        _expect_1d("req_pool_indices", self.req_pool_indices, b)
        _expect_1d("seq_lens", self.seq_lens, b)
        for field in ("req_pool_indices", "seq_lens", "out_cache_loc", "extend_prefix_lens", "extend_seq_lens",
                      "positions", "encoder_lens"):
            _expect_int(field, getattr(self, field))
        rows = self.req_pool_indices.tolist()
        for i, r in enumerate(rows):
            if r < 0:
                raise ShapeError(f"ForwardBatch.req_pool_indices[{i}]={r} (expected a row index >= 0)")
        seq = self.seq_lens.tolist()
        if mode.is_decode():
            prefix = [s - 1 for s in seq]
            ext = [1] * b
        elif mode.is_idle():
            prefix, ext = [], []
            if b or self.num_tokens:
                raise ShapeError(f"idle batch must be empty (got batch {b}, tokens {self.num_tokens})")
        else:
            if self.extend_prefix_lens is None or self.extend_seq_lens is None:
                raise ShapeError(f"{mode.value} batch needs extend_prefix_lens and extend_seq_lens (got None)")
            _expect_1d("extend_prefix_lens", self.extend_prefix_lens, b)
            _expect_1d("extend_seq_lens", self.extend_seq_lens, b)
            prefix, ext = self.extend_prefix_lens.tolist(), self.extend_seq_lens.tolist()
            for i, (p, e, s) in enumerate(zip(prefix, ext, seq)):
                if p < 0 or e < 0 or p + e != s:
                    raise ShapeError(
                        f"request {i}: extend_prefix_lens={p} + extend_seq_lens={e} must equal seq_lens={s}"
                    )
        if any(s < 1 for s in seq) and not mode.is_idle():
            raise ShapeError(f"seq_lens must be >= 1 for every request (got {seq})")
        total = sum(ext)
        _expect_1d("out_cache_loc", self.out_cache_loc, total)
        if self.positions is not None:
            _expect_1d("positions", self.positions, total)
        if self.num_tokens and int(self.out_cache_loc.min()) < 0:
            t = int((self.out_cache_loc < 0).nonzero()[0, 0])
            raise ShapeError(f"ForwardBatch.out_cache_loc[{t}]={int(self.out_cache_loc[t])} (expected a slot >= 0)")
        if self.encoder_lens is not None:
            _expect_1d("encoder_lens", self.encoder_lens, b)
            enc = self.encoder_lens.tolist()
            for i, e in enumerate(enc):
                if e < 0:
                    raise ShapeError(f"ForwardBatch.encoder_lens[{i}]={e} (expected >= 0)")
        if mode.is_target_verify():
            d = self.spec_num_draft_tokens
            if d is None or any(e != d for e in ext):
                raise ShapeError(
                    f"target_verify: every request must extend by spec_num_draft_tokens={d} (got {ext})"
                )
            if self.spec_custom_mask is not None and tuple(self.spec_custom_mask.shape) != (b, d, d):
                raise ShapeError(
                    f"spec_custom_mask has shape {tuple(self.spec_custom_mask.shape)}, expected ({b}, {d}, {d})"
                )
        self._validated_as(seq, prefix, ext, rows)
        return self

    def _validated_as(self, seq: list[int], prefix: list[int], ext: list[int], rows: list[int]) -> None:
        """Record a validation: the host copies, and each index field with its write counter."""
        self.seq_lens_cpu, self.extend_prefix_lens_cpu, self.extend_seq_lens_cpu = seq, prefix, ext
        self.req_pool_indices_cpu = rows
        self.__dict__.pop("_derived_memo", None)  # derived kernel inputs follow the fields validated now
        d = self.__dict__
        record = ValidationRecord({f: (getattr(self, f), _version(getattr(self, f))) for f in _INDEX_FIELDS})
        old = d.get("_validated")
        d["_validated"] = record if old is None else _supersede(old, record)

    def changed_since_validate(self) -> str | None:
        """The first index field (``extend_prefix_lens``, ``seq_lens`` …) replaced or written in place
        since the last ``validate()``, else ``None`` (also when never validated). Cheap (no reduction,
        no sync: torch's per-tensor version counter): the host copies and the metadata built from them
        describe the validated values, never the new ones. Fields that are views of one buffer (a decode
        batch made from host ints) share one write counter: the field named is the one whose values
        changed; a write of the same values names every field of the buffer ("a, b or c (views of one
        buffer, …)")."""
        snap: dict[str, tuple[torch.Tensor | None, int | None]] | None = self.__dict__.get("_validated")
        if snap is None:
            return None
        d = self.__dict__  # the dataclass's fields (a plain dict read per field)
        moved: list[str] = []
        for field, (tensor, version) in snap.items():
            if d.get(field) is not tensor:
                return field
            # the same object with a recorded counter is a normal tensor: its counter is read directly
            if version is not None and tensor is not None and tensor._version != version:
                moved.append(field)
        if len(moved) > 1:
            # fields made as views of one buffer share its write counter (``_decode_from_host``): a write into
            # one moves them all; the field written is the one whose values are no longer those validated, and
            # where none is (a write of the same values), the fields that share the counter are all named
            for field in moved:
                was = self._validated_values(field)
                if was is not None and d[field].tolist() != was:
                    return field
            return f"{', '.join(moved[:-1])} or {moved[-1]} (views of one buffer, one of them written in place)"
        return moved[0] if moved else None

    def _validated_values(self, field: str) -> list[int] | None:
        """The values ``field`` had when validated, where the batch knows them without its tensor (the host
        copies; ``out_cache_loc`` of a batch made from host ints), else ``None``. For error messages only."""
        if field == "positions" and self.forward_mode.is_decode():
            field = "extend_prefix_lens"
        if field in ("req_pool_indices", "seq_lens", "extend_prefix_lens", "extend_seq_lens"):
            return list(getattr(self, field + "_cpu"))
        rec = self.__dict__.get("_host_ints")
        if field == "out_cache_loc" and rec is not None and rec[0][2] is self.out_cache_loc:
            return list(rec[1][2])
        return None

    # -- derived kernel inputs (built on first use from the validated host copies, memoised per device) --
    @property
    def max_extend_len(self) -> int:
        """The most new tokens of one request in this forward (``max_seqlen_q``; decode: 1)."""
        return max(self.extend_seq_lens_cpu, default=0)

    @property
    def max_seq_len(self) -> int:
        """The longest KV length after this forward (``max_seqlen_k``)."""
        return max(self.seq_lens_cpu, default=0)

    def qo_indptr(self, device: DeviceLike | None = None) -> torch.Tensor:
        """int32 ``[batch + 1]``: offset of each request's first new token in q/k/v (``cu_seqlens_q``).

        On ``device`` (default: the batch's); built once per device and shared by every layer.
        """
        return self._derived("qo_indptr", device, lambda d: indptr(self.extend_seq_lens_cpu, d))

    def kv_indptr(self, device: DeviceLike | None = None) -> torch.Tensor:
        """int32 ``[batch + 1]``: offsets of each request's keys after this forward (``cu_seqlens_k``)."""
        return self._derived("kv_indptr", device, lambda d: indptr(self.seq_lens_cpu, d))

    def seq_lens_int32(self, device: DeviceLike | None = None) -> torch.Tensor:
        """int32 ``[batch]``: each request's KV length after this forward, new tokens included."""
        return self._derived("seq_lens_int32", device, lambda d: _int32(self.seq_lens_cpu, d))

    def _derived(
        self, key: str, device: DeviceLike | None, build: Callable[[torch.device], torch.Tensor]
    ) -> torch.Tensor:
        """Memoised per (key, device) until the next ``validate``."""
        dev = torch.device(self.seq_lens.device if device is None else device)
        memo: dict[tuple[str, torch.device], torch.Tensor] = self.__dict__.setdefault("_derived_memo", {})
        if (key, dev) not in memo:
            memo[key, dev] = build(dev)
        return memo[key, dev]


def check_qkv(
    q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer: LayerSpec, num_tokens: int
) -> None:
    """Per-call shape/dtype check of q/k/v against the layer; errors name the field."""
    exp = (num_tokens, layer.num_heads, layer.head_dim)
    if tuple(q.shape) != exp:
        raise ShapeError(f"q has shape {tuple(q.shape)}, expected {exp} (tokens, num_heads, head_dim) "
                         f"for layer {layer.layer_id}")
    if k is None and v is None:
        return
    if k is None or v is None:
        raise ShapeError(f"layer {layer.layer_id}: k and v must both be given or both be None")
    expk = (num_tokens, layer.num_kv_heads, layer.head_dim)
    expv = (num_tokens, layer.num_kv_heads, layer.v_head_dim)
    if tuple(k.shape) != expk:
        raise ShapeError(f"k has shape {tuple(k.shape)}, expected {expk} (tokens, num_kv_heads, head_dim) "
                         f"for layer {layer.layer_id}")
    if tuple(v.shape) != expv:
        raise ShapeError(f"v has shape {tuple(v.shape)}, expected {expv} (tokens, num_kv_heads, v_head_dim) "
                         f"for layer {layer.layer_id}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ShapeError(f"layer {layer.layer_id}: dtypes differ: q {q.dtype}, k {k.dtype}, v {v.dtype}")


def mla_q_dim(layer: Any, form: str) -> int:
    """Per-head query width of an MLA layer in ``form``: the latent row (absorbed) or nope + rope."""
    return int(layer.query_dim(form))


def mla_out_dim(layer: Any, form: str) -> int:
    """Per-head output width of an MLA layer in ``form``: ``kv_lora_rank`` (absorbed) or ``mla.v_head_dim``."""
    return int(layer.output_dim(form))


def check_mla_qkv(q: torch.Tensor, k: torch.Tensor | None, v: Any, layer: Any, num_tokens: int, form: str) -> None:
    """Per-call shape/dtype check of an MLA layer's q / latent k / v (``None``) in ``form``; errors name
    the field, the form and expected vs actual."""
    lid = layer.layer_id
    exp = (num_tokens, layer.num_heads, mla_q_dim(layer, form))
    what = "kv_lora_rank + qk_rope_head_dim" if form == ABSORBED else "qk_nope_head_dim + qk_rope_head_dim"
    if tuple(q.shape) != exp:
        raise ShapeError(f"q has shape {tuple(q.shape)}, expected {exp} (tokens, num_heads, {what}) for MLA layer "
                         f"{lid} in the {form} form (ForwardBatch.mla_form)")
    if v is not None:
        raise ShapeError(f"v is given for MLA layer {lid}, expected None (the values are the first kv_lora_rank "
                         f"entries of the latent rows passed as k)")
    if k is None:
        raise ShapeError(f"k is None for MLA layer {lid}, expected the new tokens' latent rows "
                         f"({num_tokens}, 1, {layer.head_dim})")
    expk = (num_tokens, 1, layer.head_dim)
    if tuple(k.shape) != expk:
        raise ShapeError(f"k has shape {tuple(k.shape)}, expected {expk} (tokens, 1, kv_lora_rank + "
                         f"qk_rope_head_dim: the latent rows c_kv ++ k_pe) for MLA layer {lid}")
    if k.dtype != q.dtype:
        raise ShapeError(f"MLA layer {lid}: dtypes differ: q {q.dtype}, k {k.dtype}")


#: the fields ``validate`` derives host copies and kernel inputs from
_INDEX_FIELDS = ("req_pool_indices", "seq_lens", "out_cache_loc", "extend_prefix_lens", "extend_seq_lens",
                 "positions", "encoder_lens", "spec_custom_mask")
_INDEX_FIELD_SET = frozenset(_INDEX_FIELDS)


class ValidationRecord(dict):  # type: ignore[type-arg]  # field -> (tensor, write counter)
    """A batch's validation record (``ForwardBatch.validate``): each index field's tensor and its write counter
    then, plus ``superseded``, set when the batch replaces this record by another (``validate`` again, or an
    index field replaced: ``ForwardBatch.__setattr__``). Whoever trusts the record (a backend's per-forward
    record, ``paged._Forward``) registers with ``watch``: superseding the record sets its ``trusted`` to
    ``False``, so the per-layer guard reads a flag of an object it holds already, where finding the batch's
    current record costs a dictionary lookup in the batch's ``__dict__`` and a read of the record (~1.7 µs a
    layer once a kernel streamed the caches). Watchers are held weakly (no cycle keeps a forward's metadata
    alive through the batch). ``counters()``: the write counters a forward reads per layer, worked out once per
    record (its entries never change)."""

    __slots__ = ("superseded", "watchers", "_counters")

    def __init__(self, entries: Any = ()) -> None:
        super().__init__(entries)
        self.superseded = False
        self.watchers: list[weakref.ref[Any]] = []
        self._counters: tuple[tuple[Any, int], ...] | None = None

    def counters(self) -> tuple[tuple[Any, int], ...]:
        """``counters_of(self)``, computed at the first call and kept (``paged._Forward`` asks it per forward)."""
        c = self._counters
        if c is None:
            c = self._counters = counters_of(self)
        return c

    def watch(self, watcher: Any) -> None:
        """Set ``watcher.trusted = False`` when this record is superseded (held weakly; dead ones dropped)."""
        ws = self.watchers
        if ws:
            ws[:] = [r for r in ws if r() is not None]
        ws.append(weakref.ref(watcher))

    def __copy__(self) -> ValidationRecord:
        return ValidationRecord(self)

    def __deepcopy__(self, memo: dict[int, Any]) -> ValidationRecord:
        import copy
        return ValidationRecord({k: copy.deepcopy(v, memo) for k, v in self.items()})

    def __reduce__(self) -> Any:
        return (ValidationRecord, (dict(self),))


def counters_of(entries: Any) -> tuple[tuple[Any, int], ...]:
    """One ``(tensor, version)`` per write counter among a validation record's ``field -> (tensor, version)``
    entries: fields that are views of one buffer share its counter (``ForwardBatch.decode`` from host ints makes
    them so), so a forward reads one counter for the lot. Each is read through the ``out_cache_loc`` entry where
    that is a view of the buffer (a view shares its base's counter; it is the tensor a layer's K/V write touches
    anyway), else through the buffer. Fields recorded with different versions of one counter get ``-1`` (a
    counter never reads it: never "unchanged")."""
    counters: dict[int, tuple[Any, int]] = {}
    for t, ver in entries.values():
        if t is None or ver is None:
            continue
        base = t._base if t._base is not None else t
        seen = counters.setdefault(id(base), (base, ver))
        if seen[1] != ver:
            counters[id(base)] = (base, -1)
    loc = (entries.get("out_cache_loc") or (None, None))[0]
    if loc is not None:
        key = id(loc._base if loc._base is not None else loc)
        if key in counters:
            counters[key] = (loc, counters[key][1])
    return tuple(counters.values())


def _supersede(old: Any, new: ValidationRecord) -> ValidationRecord:
    """``new``, having marked ``old`` superseded (a record made before records were ``ValidationRecord``s, or
    put there by hand, is a plain dict: nothing to mark; the guard then compares the batch's record)."""
    if old.__class__ is ValidationRecord:
        old.superseded = True
        for ref in old.watchers:
            w = ref()
            if w is not None:
                w.trusted = False
        old.watchers = []
    return new


def _version(t: torch.Tensor | None) -> int | None:
    """``t``'s in-place write counter (``None`` for ``None`` and for inference tensors, which keep none).

    An inference tensor (made under ``torch.inference_mode``, as hosts run) is asked first: reading its
    ``_version`` raises, and a raised and caught error costs ~12 µs against ~0.1 µs for the question, on
    a path run per field and forward."""
    if t is None:
        return None
    try:
        return None if t.is_inference() else int(t._version)
    except (RuntimeError, AttributeError):
        return None


def _expect_1d(name: str, t: object, n: int) -> None:
    shape = tuple(getattr(t, "shape", ()))
    if shape != (n,):
        raise ShapeError(f"ForwardBatch.{name} has shape {shape}, expected ({n},)")


def _expect_int(name: str, t: object) -> None:
    dt = getattr(t, "dtype", None)
    if dt is not None and (dt.is_floating_point or dt.is_complex or dt == torch.bool):
        raise ShapeError(f"ForwardBatch.{name} has dtype {dt}, expected an integer tensor")


def _all_ints(*seqs: object) -> bool:
    """Every argument is a list or tuple of plain ``int`` (not ``bool``, not a tensor or numpy scalar)."""
    for s in seqs:
        if type(s) is not list and type(s) is not tuple:
            return False
        for x in s:
            if type(x) is not int:
                return False
    return True


def _host_i64(field: str, xs: list[int]) -> torch.Tensor:
    """An int64 CPU tensor of ``xs`` (plain ints), made through an ``array`` buffer (~0.7 µs against
    ~2.3 µs for ``torch.tensor(list)``); a value outside int64 is a ``ShapeError`` naming the field."""
    if not xs:
        return torch.empty(0, dtype=torch.int64)
    try:
        buf = array.array("q", xs)
    except OverflowError:
        raise ShapeError(f"ForwardBatch.{field} holds a value outside int64: {xs}") from None
    return torch.frombuffer(buf, dtype=torch.int64)


def _host_i64_views(fields: list[tuple[str, list[int]]]) -> dict[str, torch.Tensor]:
    """``{field: int64 CPU tensor of its ints}``, every tensor a view of one buffer holding them all (one
    allocation; the views share the buffer's write counter). A value outside int64 is ``_host_i64``'s
    ``ShapeError`` naming its field."""
    xs: list[int] = []
    for _, ints in fields:
        xs += ints
    if not xs:
        return {f: torch.empty(0, dtype=torch.int64) for f, _ in fields}
    try:
        buf = array.array("q", xs)
    except OverflowError:
        for f, ints in fields:  # the field holding it, named
            _host_i64(f, ints)
        raise
    parts = torch.frombuffer(buf, dtype=torch.int64).split_with_sizes([len(ints) for _, ints in fields])
    return {f: t for (f, _), t in zip(fields, parts)}


def _int32(xs: list[int], device: torch.device) -> torch.Tensor:
    """int32 ``xs`` on ``device``: through an ``array`` buffer on CPU (as ``_host_i64``), else ``torch.as_tensor``."""
    if device.type == "cpu" and xs:
        try:
            return torch.frombuffer(array.array("i", xs), dtype=torch.int32)
        except OverflowError:
            pass  # a length past int32: torch's own error below
    return torch.as_tensor(xs, dtype=torch.int32, device=device)


def _i64(x: IndexLike) -> torch.Tensor:
    t = torch.as_tensor(x)
    if t.numel() and (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool):
        raise ShapeError(f"index/length values must be integers, got dtype {t.dtype}")
    return t.to(torch.int64)
