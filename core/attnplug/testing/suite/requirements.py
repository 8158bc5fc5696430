"""The conformance requirements, each with the attnplug level that introduced it (pure data, no torch).

A *level* is an attnplug ``MAJOR.MINOR`` version: level ``0.1`` is what ``pytest --backend`` checked
in attnplug 0.1.x. Every family of the suite has one requirement here (its id is the family name);
a requirement added later to an existing family gets its own id ``family.what`` and a newer level,
and the suite's check names it when it fails (``_common.fail(..., requirement="family.what")``).

``pytest --backend=X --conformance-level=L`` fails the run on requirements up to ``L`` only; the
cases of newer ones still run and their failures are listed as "new since ..." with the guidance
below. Each failure message ends with the requirement's contract, how to meet it and
``docs/conformance.md#<anchor>``.

**Adding a family is one line in ``REQUIREMENTS``** (its ``since`` is the next release's level).
The table is versioned: ``policy_problems`` (run by ``tests/conformance/test_requirements.py``)
fails when the requirements of a level differ from the digest ``CHANGELOG.md`` records for it, so
a new requirement comes with a version bump and a CHANGELOG "Conformance" entry; a released level
never changes. See docs/conformance.md, "Conformance levels".
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re

DOC = "docs/conformance.md"

# how-to phrases shared by several requirements
_COMPUTE = ("implement compute_extend / compute_decode (PagedBackend step 4) to the semantics of "
            "attnplug.testing.reference.reference_attention (conventions in docs/api.md)")
_NEW_KV = ("take this forward's K/V from the k/v arguments: PagedBackend with new_kv_source='args' computes "
           "before it writes and never reads them back (a kernel that reads them from the cache declares "
           "new_kv_source='cache'; PagedKVCache.staged() then restores the slots)")


@dataclasses.dataclass(frozen=True)
class Requirement:
    """One requirement: ``id`` (a family name, or ``family.what``), the level that introduced it, what it
    checks and how a backend meets it."""

    id: str
    since: str
    contract: str
    how: str

    @property
    def family(self) -> str:
        return self.id.split(".", 1)[0]

    @property
    def anchor(self) -> str:
        """``docs/conformance.md#<anchor>`` of this requirement's row in the requirement table."""
        return "req-" + self.id.replace(".", "-").replace("_", "-")

    def guidance(self) -> str:
        """The lines every failure of this requirement ends with."""
        return (f"requirement {self.id!r} (conformance level {self.since}): {self.contract}\n"
                f"how to meet it: {self.how}\n"
                f"see {DOC}#{self.anchor}")


#: One entry per family (and per requirement added to an existing family), oldest level first.
REQUIREMENTS: tuple[Requirement, ...] = (
    # -- level 0.1: the suite as first released (attnplug 0.1.0) --
    Requirement("protocol", "0.1", "the factory returns (canonical effective name, backend); both stamps are that name; every alias builds the canonical name; the backend class claims at least what its descriptor claims", "return (NAME, backend) from the factory (never an alias, a bare backend or None) and set the class attribute capabilities to the descriptor's Capabilities object"),
    Requirement("metadata_required", "0.1", "forward() on a batch init_forward_metadata() did not see raises attnplug.errors.MetadataNotInitializedError naming init_forward_metadata", "subclass PagedBackend (init_forward_metadata records the batch, forward requires it); implementing AttentionBackend directly: keep an attnplug.backend.MetadataGuard, .set(batch, meta) in init_forward_metadata and .require(batch) first in forward"),
    Requirement("bad_input", "0.1", "q/k/v of a wrong shape, or k/v in another dtype than q, raise attnplug.ShapeError naming q, k or v, and nothing is written", "PagedBackend.check_forward does it per layer (step 2); directly: call attnplug.batch.check_qkv(q, k, v, layer, batch.num_tokens) before any write"),
    Requirement("refusal", "0.1", "not_supported_reasons() says in words why a layer or context using an unclaimed feature (window, soft-cap, sinks, cross-attention, V head dim, GQA/MQA) or float64 is not served", "AttentionBackend.not_supported_reasons derives it from the class's Capabilities; say what Capabilities cannot express in PagedBackend.backend_reasons"),
    Requirement("mode", "0.1", "every claimed forward mode equals the float64 reference within the dtype's tolerance at every claimed page size and dtype", _COMPUTE),
    Requirement("heads", "0.1", "MHA, GQA and MQA head layouts at head dims 64/128/256 equal the reference", _COMPUTE + "; map query head h to KV head h // layer.gqa_group_size"),
    Requirement("v_head_dim", "0.1", "a V head dim other than the K head dim equals the reference (claimed with v_head_dim_differs)", _COMPUTE),
    Requirement("feature", "0.1", "sliding window, logit soft-cap and attention sinks, as LayerSpec defines them, equal the reference in every claimed mode", _COMPUTE + "; a window W shows keys at positions >= p - W, new tokens included"),
    Requirement("cross_attention", "0.1", "a cross-attention layer reads the first encoder_lens[i] cached tokens of its request, without a causal mask, and writes nothing", _COMPUTE),
    Requirement("kv_cache_dtype", "0.1", "a KV cache in a dtype other than the model's equals the reference (the looser tolerance)", _COMPUTE + "; claim the cache dtypes in Capabilities.kv_cache_dtypes"),
    Requirement("kv_cache_write", "0.1", "save_kv_cache=True writes the new K/V at exactly out_cache_loc and nothing else; save_kv_cache=False and idle write nothing; req_to_token is never modified", "PagedBackend writes them (step 3); directly: PagedKVCache.set_kv(layer.layer_id, batch.out_cache_loc, k, v) once per layer, only when save_kv_cache"),
    Requirement("shared_metadata", "0.1", "one init_forward_metadata() serves every layer of a forward", "build per-forward data once in PagedBackend.build_metadata; keep nothing per layer in it"),
    Requirement("sequence", "0.1", "forwards in a row read the K/V that earlier forwards wrote", "write the new K/V where out_cache_loc says (PagedBackend step 3) and read a request's cached keys through req_to_token"),
    Requirement("determinism", "0.1", "with deterministic claimed: a repeated forward, and a request alone versus in a batch, are bit-identical", "use a fixed reduction order per request, independent of the batch (no atomics, no batch-dependent splits)"),
    Requirement("cuda_graph", "0.1", "with cuda_graph claimed: a captured decode replays correctly on new q/k/v (on a CUDA host)", "implement the CUDA-graph hooks with PagedBackend.graph_metadata (metadata moved into static buffers)"),
    # -- level 0.2: depth, robustness and new contracts (attnplug 0.2.0) --
    Requirement("refusal.forward", "0.2", "a forward using an unclaimed dtype (integer and complex included), KV-cache dtype, mode or feature raises attnplug.NotSupportedError naming it and writes nothing; not_supported_reasons() also covers unclaimed dtypes, KV-cache dtypes and modes", "subclass PagedBackend (init_forward_metadata refuses an unclaimed mode, check_forward an unclaimed dtype or layer, before any write); directly: check Capabilities.supports_mode(batch.forward_mode) and q.dtype against capabilities.dtypes and call self.require_supported(layer) before writing"),
    Requirement("kv_none", "0.2", "k=v=None on a self-attention layer raises attnplug.ShapeError naming k/v and writes nothing", "PagedBackend.check_forward does it (step 2); directly: refuse k is None unless layer.is_cross_attention, before any write"),
    Requirement("rejected", "0.2", "an out-of-range or negative out_cache_loc, req_pool_indices or layer_id, an unassigned (-1) or out-of-range req_to_token entry, or a seq_len beyond the assigned positions or the req_to_token width raises attnplug.ShapeError naming the field, the bad value and the bound, and writes nothing", "subclass PagedBackend (init_forward_metadata runs PagedKVCache.check_batch once per forward, check_forward runs check_layer_id); directly: call self.cache.check_batch(batch) in init_forward_metadata and self.cache.check_layer_id(layer.layer_id) before any write"),
    Requirement("garbage", "0.2", "whatever a slot no request owns holds (NaN, +inf) never reaches the output: request r reads only req_to_token[r, :seq_len] and its new k/v", "gather only owned slots (PagedKVCache.read_kv(layer_id, slots) or the page table up to each length) and mask by selecting (torch.where / masked_fill on the scores and on padded value rows), never by multiplying a masked value by zero"),
    Requirement("no_save", "0.2", "with save_kv_cache=False the new tokens' K/V come from the k/v arguments (their out_cache_loc slots hold stale values) and nothing is written", _NEW_KV),
    Requirement("unmapped_slot", "0.2", "new tokens whose positions req_to_token does not map yet are read from k/v, not through req_to_token", _NEW_KV),
    Requirement("edge", "0.2", "a query row with no visible key returns zero (never NaN); an extend request with zero new tokens; every request at position 0; a verify mask is ignored outside target-verify", "select-mask and return 0 for a row whose softmax has no visible key; read spec_custom_mask only when batch.forward_mode is TARGET_VERIFY"),
    Requirement("output_ownership", "0.2", "a forward returns a fresh tensor the caller owns: no later layer or forward changes it, and it shares storage with neither q/k/v nor the cache", "allocate each output per forward (PagedBackend.empty_output); never return a view of a reused workspace"),
    Requirement("long", "0.2", "problems crossing block, split and chunk thresholds (decode over 4.1k keys, a 700-query prefill over 4.2k keys) equal the reference", _COMPUTE + "; bound workspaces with PagedBackend.check_workspace"),
    Requirement("scaling", "0.2", "LayerSpec.scaling other than 1/sqrt(head_dim) is honoured", "use layer.scaling (LayerSpec already defaults it to 1/sqrt(head_dim)); never recompute the scale from head_dim"),
    Requirement("random", "0.2", "hypothesis-drawn batches within the claimed envelope (garbage, unmapped slots, no-save included) equal the reference, or are refused with a clear attnplug error that writes nothing", "meet the requirements above; a failure prints the shrunk Case(...) to reproduce it"),
    Requirement("workspace", "0.2", "under a small BuildContext.max_workspace_bytes a forward equals the reference (work done in pieces) or raises attnplug.errors.ResourceLimitError naming max_workspace_bytes, writing nothing", "call PagedBackend.check_workspace(nbytes, what) before allocating a workspace (the limit is self.max_workspace_bytes)"),
    Requirement("kv_layout", "0.2", "the forward is right in every KV layout the backend declares in Capabilities.kv_layouts (None: any layout)", "read and write the cache through PagedKVCache.read_kv / set_kv (layout-independent) or the cache's KVLayout, and declare only the layouts you read"),
    Requirement("fp8_kv", "0.2", "an fp8 KV cache with per-layer scales: the output is computed on stored values x scale, and new K/V are stored quantized (round(x / scale), saturated)", "write with PagedKVCache.set_kv (it quantizes) and read with read_kv(layer_id, slots, dequantize=True); claim the formats in kv_cache_dtypes"),
    # -- level 0.3: compiled-kernel depth, bidirectional attention, garbage in new tokens (attnplug 0.3.0) --
    Requirement("chunked", "0.3", "under workspace limits that cut a request's queries into chunks, at one and two threads, windows, sinks, soft-cap and the target-verify mask stay those of the request (a chunk never applies them at its own offset) and the forward equals the reference, or is refused with ResourceLimitError naming max_workspace_bytes", "index the causal bound, the window and spec_custom_mask by the query's position in its request (not in its chunk), and bound workspaces with PagedBackend.check_workspace"),
    Requirement("head_dim_class", "0.3", "head dims 72, 80, 96 and 112 (multiples of 8, 16, 32 but not 64) equal the reference in every claimed dtype, or are refused by Capabilities.head_dims", _COMPUTE + "; admit a vectorised path only for the head dims it handles (list the rest out of Capabilities.head_dims)"),
    Requirement("score_range", "0.3", "rows whose every score is hundreds below zero, and rows whose maximum sits in the first key block only, equal the reference", "start the running maximum at -inf (never 0) and rescale every earlier block's sum and accumulator when a later block raises the maximum (online softmax)"),
    Requirement("rounding", "0.3", "16-bit outputs are rounded to nearest: the mean signed error over thousands of elements is within 0.1 ulp of zero", "compute in float32 and round once to the output dtype with round-to-nearest-even (tensor.to(dtype)); never truncate, never scale by a rounded common factor"),
    Requirement("feature.bidirectional", "0.3", "with bidirectional claimed: a non-causal self-attention layer (LayerSpec.causality='bidirectional') lets every query see every key of its request, new tokens after it included (a window W: keys with |p - j| <= W), in extend, decode and mixed forwards", _COMPUTE + "; read layer.causality (LayerSpec.uses_bidirectional) and drop the causal mask only for such layers; claim Capabilities.bidirectional"),
    Requirement("refusal.bidirectional", "0.3", "a backend not claiming bidirectional says so in not_supported_reasons() for a non-causal layer and refuses a forward with one (attnplug.NotSupportedError naming it), writing nothing", "AttentionBackend.not_supported_reasons derives it from Capabilities.bidirectional; PagedBackend.check_forward refuses the layer before any write"),
    Requirement("garbage.new_tokens", "0.3", "a NaN/+inf in the K or V of a request's later new token (hidden by causal order from its earlier tokens) or of a draft the target-verify mask hides reaches exactly the rows that see it, never a row it is hidden from", "select masked keys out of the value product (tl.where / masked_fill, or skip a key whose probability is 0); a kernel that must multiply zeroes non-finite K/V for the product and sets to NaN exactly the rows that see such a key"),
    Requirement("odd_heads", "0.3", "odd KV-head counts over decode batches of 1 to 6 requests equal the reference at one and two threads", "split work over (request, KV head) items that cover every head exactly once whatever the thread count"),
    # -- level 0.4: MLA layers (attnplug 0.4.0; docs/mla.md) --
    Requirement("mla", "0.4", "with Capabilities.mla_forms claimed: an MLA layer (LayerSpec.mla) in each claimed form and mode kind equals attnplug.testing.reference.reference_mla (absorbed: MQA over the latent rows, values their first kv_lora_rank entries, output [T, H, kv_lora_rank]; unabsorbed: rows decompressed per head with w_kc/w_vc, output [T, H, v_head_dim]) at page sizes 1/16/64 over ragged batches, with the scale LayerSpec.scaling (1/sqrt(qk_nope + qk_rope), never 1/sqrt(head_dim)), and the new latent rows are written at exactly out_cache_loc", "implement PagedBackend.compute_mla(q, latent, layer, batch, meta) for the forms you claim (batch.mla_form, batch.forward_mode), read values from latent[..., :kv_lora_rank] and use layer.scaling"),
    Requirement("mla_garbage", "0.4", "whatever a latent slot no request owns holds (NaN, +inf) never reaches an MLA output, in either form", "gather only the latent rows a request owns (req_to_token[r, :prefix]) before decompressing or attending, and mask by selecting"),
    Requirement("mla_fp8", "0.4", "an fp8 latent cache with its one per-layer scale (PagedKVCache.set_latent_scale): outputs computed on stored rows x scale (new rows as the cache stores them), new rows stored quantized", "read rows with PagedKVCache.read_latent(layer_id, slots, dequantize=True) (or multiply by cache.k_scales[layer_id]); claim the formats in kv_cache_dtypes"),
    Requirement("mla_forms_agree", "0.4", "with both MLA forms claimed in a mode kind: on the same weights the unabsorbed output of head h equals the absorbed output @ w_vc[h] when the absorbed query is [q_nope_h @ w_kc[h], q_pe_h]", "use the same softmax scale (layer.scaling) and the same visible keys in both forms; decompress key h as [c_kv @ w_kc[h]^T, k_pe] and value h as c_kv @ w_vc[h]"),
)

#: the refusal variants level 0.1 checked, in words only (every other variant, and a refused forward,
#: is ``refusal.forward``)
REFUSAL_VARIANTS_0_1: frozenset[str] = frozenset({
    "sliding_window", "logit_softcap", "sinks", "cross_attention", "v_head_dim_differs", "mqa", "gqa",
    "dtype_float64",
})

_BY_ID: dict[str, Requirement] = {r.id: r for r in REQUIREMENTS}


class RequirementError(LookupError):
    """A family or requirement id the table does not list (a family added without its line)."""


def requirement(req_id: str) -> Requirement:
    try:
        return _BY_ID[req_id]
    except KeyError:
        raise RequirementError(
            f"conformance requirement {req_id!r} is not in attnplug.testing.suite.requirements.REQUIREMENTS; "
            f"a new family needs one line there (its level, contract and how to meet it; see {DOC}, "
            f"'Conformance levels')"
        ) from None


def for_family(family: str) -> Requirement:
    """The requirement of ``family`` (the entry whose id is the family name)."""
    return requirement(family)


# -- levels ---------------------------------------------------------------------------
def level_key(level: str) -> tuple[int, int]:
    m = re.fullmatch(r"(\d+)\.(\d+)", level)
    if m is None:
        raise ValueError(f"{level!r} is not a conformance level (MAJOR.MINOR, e.g. '0.1')")
    return int(m.group(1)), int(m.group(2))


def level_of(version: str) -> str:
    """The conformance level of an attnplug version: its ``MAJOR.MINOR`` (``"0.2.1"`` -> ``"0.2"``)."""
    m = re.match(r"(\d+)\.(\d+)", version)
    if m is None:
        raise ValueError(f"attnplug version {version!r} does not start with MAJOR.MINOR")
    return f"{int(m.group(1))}.{int(m.group(2))}"


def installed_level() -> str:
    """The level of the installed attnplug: every requirement it checks."""
    import attnplug

    return level_of(attnplug.__version__)


def levels(table: tuple[Requirement, ...] = REQUIREMENTS) -> list[str]:
    """The levels that introduced requirements, oldest first."""
    return sorted({r.since for r in table}, key=level_key)


def known_levels() -> list[str]:
    """The levels ``--conformance-level`` accepts: those with requirements, up to the installed one."""
    cur = installed_level()
    return [lv for lv in levels() if level_key(lv) <= level_key(cur)] + (
        [cur] if cur not in levels() else [])


def parse_level(text: str) -> str:
    """``--conformance-level`` value -> a known level; ``ValueError`` saying what is accepted."""
    import attnplug

    known = known_levels()
    value = text.strip()
    if value in known:
        return value
    hint = ""
    try:
        if level_key(value) > level_key(installed_level()):
            hint = f"; {value} is newer than the installed attnplug {attnplug.__version__}: upgrade attnplug"
    except ValueError:
        hint = " (a level is MAJOR.MINOR)"
    raise ValueError(f"unknown conformance level {text!r}: attnplug {attnplug.__version__} knows "
                     f"{', '.join(known)}{hint}")


def newer_than(req: Requirement, level: str) -> bool:
    return level_key(req.since) > level_key(level)


def level_anchor(level: str) -> str:
    return "level-" + level.replace(".", "-")


# -- the version policy ---------------------------------------------------------------------
def digest(level: str, table: tuple[Requirement, ...] = REQUIREMENTS) -> str:
    """A digest of the requirement ids at or below ``level`` (what a level promises; wording is free)."""
    ids = sorted(r.id for r in table if level_key(r.since) <= level_key(level))
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]


def changelog_sections(text: str) -> dict[str, str]:
    """``CHANGELOG.md`` -> ``{version: the text of its '### Conformance' section}`` ('' when it has none)."""
    out: dict[str, str] = {}
    for block in re.split(r"(?m)^## ", text)[1:]:
        head, _, body = block.partition("\n")
        m = re.match(r"\[?v?(\d+\.\d+\.\d+)", head.strip())
        if m is None:
            continue
        conf = re.search(r"(?ms)^### Conformance\s*$(.*?)(?=^### |\Z)", body)
        out[m.group(1)] = conf.group(1) if conf else ""
    return out


def policy_problems(version: str, changelog: str, table: tuple[Requirement, ...] = REQUIREMENTS) -> list[str]:
    """What breaks the version policy: the table, the installed ``version`` and ``CHANGELOG.md`` disagree.

    Each level that introduced requirements is released as ``L.0`` with a ``### Conformance``
    section naming every requirement it added and the line ``requirements digest: <digest(L)>``.
    A released level never changes: changing its requirements changes its digest (fails here), so a
    new requirement goes to a new level, with a version bump and a CHANGELOG entry.
    """
    problems: list[str] = []
    cur = level_of(version)
    ids = [r.id for r in table]
    for dup in sorted({i for i in ids if ids.count(i) > 1}):
        problems.append(f"requirement {dup!r} is listed twice")
    for r in table:
        try:
            level_key(r.since)
        except ValueError as exc:
            problems.append(f"requirement {r.id!r}: {exc}")
            return problems
        if level_key(r.since) > level_key(cur):
            problems.append(
                f"requirement {r.id!r} is at level {r.since}, newer than attnplug {version}: bump the version to "
                f"{r.since}.0 (pyproject.toml and attnplug.__version__) and add a CHANGELOG.md '## {r.since}.0' "
                f"entry with a '### Conformance' section")
        if r.family != r.id and r.family not in ids:
            problems.append(f"requirement {r.id!r} refines family {r.family!r}, which has no requirement")
    sections = changelog_sections(changelog)
    if version not in sections:
        problems.append(f"CHANGELOG.md has no '## {version}' entry for the installed attnplug version")
    for lv in levels(table):
        if level_key(lv) > level_key(cur):
            continue
        release, want = f"{lv}.0", digest(lv, table)
        added = [r.id for r in table if r.since == lv]
        if release not in sections:
            problems.append(f"level {lv} introduced {', '.join(added)} but CHANGELOG.md has no '## {release}' entry "
                            f"(add it with a '### Conformance' section and 'requirements digest: {want}')")
            continue
        text = sections[release]
        if not text:
            problems.append(f"CHANGELOG.md '## {release}' has no '### Conformance' section (list the requirements "
                            f"level {lv} added and 'requirements digest: {want}')")
            continue
        m = re.search(r"requirements digest:\s*`?([0-9a-f]+)`?", text)
        if m is None:
            problems.append(f"CHANGELOG.md '## {release}' Conformance section lacks 'requirements digest: {want}'")
        elif m.group(1) != want:
            problems.append(
                f"the requirements of level {lv} changed: CHANGELOG.md records digest {m.group(1)} for {release}, "
                f"the table now gives {want}. A released level never changes: give the new requirement "
                f"since=<the next level>, bump attnplug's version to it and add its CHANGELOG.md entry")
        for rid in added:
            if f"`{rid}`" not in text:
                problems.append(f"CHANGELOG.md '## {release}' Conformance section does not name requirement `{rid}`")
    return problems
