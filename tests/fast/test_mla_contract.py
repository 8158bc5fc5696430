"""The MLA contract in the core (docs/mla.md): LayerSpec/MLASpec validation, the latent cache, the batch's
form flag, Capabilities.mla_forms and its reasons, the skeleton's per-forward refusals, resolution, and
the float64 reference's two forms agreeing."""

from __future__ import annotations

import math

import pytest
import torch

from attnplug import AttentionConfig, BuildContext, ForwardBatch, ForwardMode, HostInfo, LayerSpec, PagedKVCache
from attnplug.capabilities import Capabilities, MLAForms, mla_reasons, support_reasons
from attnplug.descriptor import capabilities_problems
from attnplug.errors import KVLayoutError, NotSupportedError, ShapeError
from attnplug.layer import MLASpec
from attnplug.paged import PagedBackend
from attnplug.registry import in_process_source
from attnplug.resolution import resolve
from attnplug.testing.reference import reference_mla
from tests import dists_resolution as D

H, LORA, ROPE, NOPE, VD = 4, 16, 8, 12, 10
WIDTH = LORA + ROPE


def mla(weights: bool = True, **kw):
    g = torch.Generator().manual_seed(1)
    w = dict(w_kc=torch.randn(H, NOPE, LORA, generator=g), w_vc=torch.randn(H, LORA, VD, generator=g)) \
        if weights else {}
    w.update(kw)
    return MLASpec(LORA, NOPE, ROPE, VD, **w)


def mla_layer(weights: bool = True, **kw) -> LayerSpec:
    return LayerSpec(0, H, 1, WIDTH, mla=mla(weights), **kw)


# -- LayerSpec / MLASpec ---------------------------------------------------------------------------
def test_mla_layer_defaults():
    layer = mla_layer()
    assert layer.v_head_dim == LORA and layer.is_mla
    assert layer.scaling == pytest.approx(1 / math.sqrt(NOPE + ROPE))  # not 1/sqrt(WIDTH)
    assert layer.query_dim("absorbed") == WIDTH and layer.query_dim("unabsorbed") == NOPE + ROPE
    assert layer.output_dim("absorbed") == LORA and layer.output_dim("unabsorbed") == VD
    assert "MLA" in layer.describe() and "latent 16+8" in layer.describe()
    assert "absorbed form only" in mla_layer(weights=False).describe()
    assert LayerSpec(0, H, 1, WIDTH, mla=mla(), scaling=0.5).scaling == 0.5  # YaRN mscale² passes through


@pytest.mark.parametrize("kw, field, expected", [
    (dict(num_kv_heads=2, num_heads=4), "num_kv_heads=2", "expected 1"),
    (dict(head_dim=WIDTH + 1), f"head_dim={WIDTH + 1}", f"= {WIDTH}"),
    (dict(head_dim=NOPE + ROPE), f"head_dim={NOPE + ROPE}", f"= {WIDTH}"),
    (dict(v_head_dim=VD), f"v_head_dim={VD}", f"kv_lora_rank = {LORA}"),
    (dict(sliding_window=8), "sliding_window=8", "MLA"),
    (dict(logit_cap=30.0), "logit_cap=30.0", "MLA"),
    (dict(sinks=torch.zeros(H)), "sinks=", "MLA"),
    (dict(is_cross_attention=True), "is_cross_attention=True", "MLA"),
    (dict(causality="bidirectional"), "causality='bidirectional'", "MLA"),
])
def test_mla_layer_validation_names_field_expected_actual(kw, field, expected):
    args = dict(layer_id=0, num_heads=H, num_kv_heads=1, head_dim=WIDTH, mla=mla())
    args.update(kw)
    with pytest.raises(ValueError) as info:
        LayerSpec(**args)
    assert f"LayerSpec.{field}" in str(info.value) and expected in str(info.value)


@pytest.mark.parametrize("name, shape", [("w_kc", (H, NOPE, LORA + 1)), ("w_kc", (H - 1, NOPE, LORA)),
                                          ("w_vc", (H, LORA, VD + 2)), ("w_vc", (LORA, VD))])
def test_mla_weight_shapes_are_checked(name, shape):
    spec = mla(**{name: torch.zeros(shape)})
    with pytest.raises(ValueError, match=rf"LayerSpec.mla.{name} has shape .*expected"):
        LayerSpec(0, H, 1, WIDTH, mla=spec)


@pytest.mark.parametrize("field", ["kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"])
@pytest.mark.parametrize("bad", [0, -1, 2.0, True])
def test_mlaspec_fields_positive_ints(field, bad):
    args = dict(kv_lora_rank=LORA, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=VD)
    args[field] = bad
    with pytest.raises(ValueError, match=rf"MLASpec.{field}="):
        MLASpec(**args)


def test_mla_must_be_an_mlaspec():
    with pytest.raises(ValueError, match="LayerSpec.mla="):
        LayerSpec(0, H, 1, WIDTH, mla={"kv_lora_rank": LORA})


# -- the batch's form ---------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", ["Absorbed", "latent", None, 1])
def test_batch_mla_form_is_validated(bad):
    with pytest.raises(ShapeError, match="ForwardBatch.mla_form="):
        ForwardBatch.decode([0], [3], [2], mla_form=bad)


def test_batch_mla_form_default_absorbed():
    assert ForwardBatch.decode([0], [3], [2]).mla_form == "absorbed"
    assert ForwardBatch.idle(mla_form="unabsorbed").mla_form == "unabsorbed"


# -- the latent cache ---------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["nhd", "hnd"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float8_e4m3fn"])
def test_latent_cache_allocates_one_row_per_token(layout, dtype):
    cache = PagedKVCache(2, 4, 1, WIDTH, v_head_dim=0, page_size=4, dtype=dtype, layout=layout)
    assert cache.latent and cache.geometry.kv_numel == 16 * WIDTH
    storage = cache.layer_storage(1)
    assert sum(t.numel() for t in storage) == 16 * WIDTH
    rows = torch.randn(3, 1, WIDTH)
    loc = torch.tensor([5, 0, 13])
    cache.set_latent_scale(1, 0.5) if cache.quantized else None
    cache.set_latent(1, loc, rows)
    got = cache.read_latent(1, loc, dequantize=True)
    tol = 0.3 if cache.quantized else (1e-2 if dtype == "bfloat16" else 0)
    assert got.shape == (3, 1, WIDTH) and torch.allclose(got, rows, atol=tol, rtol=tol)
    k, v = cache.read_kv(1, loc)
    assert v.shape == (3, 1, 0)
    assert cache.read_latent(0, dequantize=True).abs().sum() == 0  # the other layer is untouched


@pytest.mark.parametrize("layout", ["nhd", "hnd"])
def test_latent_cache_adopts_engine_buffer_without_copy(layout):
    buf = torch.zeros(4 * 4 * WIDTH)
    cache = PagedKVCache(1, 4, 1, WIDTH, v_head_dim=0, page_size=4, layout=layout, buffers=[buf])
    cache.set_latent(0, torch.tensor([6]), torch.full((1, 1, WIDTH), 2.0))
    assert buf.sum() == 2.0 * WIDTH  # written into the engine's memory
    with pytest.raises(ValueError, match="kv_numel"):
        PagedKVCache(1, 4, 1, WIDTH, v_head_dim=0, page_size=4, layout=layout, buffers=[torch.zeros(4 * 4 * WIDTH * 2)])


def test_latent_cache_refuses_more_than_one_row_and_two_scales():
    with pytest.raises(ValueError, match="num_kv_heads=2, expected 1"):
        PagedKVCache(1, 4, 2, WIDTH, v_head_dim=0)
    cache = PagedKVCache(1, 4, 1, WIDTH, v_head_dim=0, dtype="float8_e4m3fn")
    with pytest.raises(ValueError, match="one scale per layer"):
        cache.set_kv_scales(0, 0.5, 2.0)
    cache.set_latent_scale(0, 0.25)
    assert cache.kv_scales(0) == (0.25, 0.25)


def test_latent_accessors_refuse_an_ordinary_cache():
    cache = PagedKVCache(1, 4, 1, WIDTH)
    for call in (lambda: cache.read_latent(0), lambda: cache.set_latent_scale(0, 1.0)):
        with pytest.raises(KVLayoutError, match="v_head_dim=0"):
            call()


def test_cache_rows_match_the_layer_kind():
    latent = PagedKVCache(1, 4, 1, WIDTH, v_head_dim=0)
    latent.check_layer_rows(mla_layer())
    with pytest.raises(ShapeError, match="not an MLA layer"):
        latent.check_layer_rows(LayerSpec(0, H, 1, WIDTH))
    with pytest.raises(ShapeError, match="expected a latent cache"):
        PagedKVCache(1, 4, 1, WIDTH, v_head_dim=LORA).check_layer_rows(mla_layer())
    with pytest.raises(ShapeError, match="expected a latent cache"):
        PagedKVCache(1, 4, 1, WIDTH + 8, v_head_dim=0).check_layer_rows(mla_layer())


# -- Capabilities.mla_forms and the reasons ------------------------------------------------------------
def test_mla_forms_default_empty_and_read_only_hashable():
    caps = Capabilities()
    assert not caps.mla and caps.mla_forms_for("decode") == ()
    c = Capabilities(mla_forms={"decode": ["absorbed"], "extend": ("absorbed", "unabsorbed")})
    assert isinstance(c.mla_forms, MLAForms) and c.mla_forms["decode"] == ("absorbed",)
    assert hash(c) == hash(Capabilities(mla_forms={"extend": ("absorbed", "unabsorbed"), "decode": ("absorbed",)}))
    with pytest.raises(TypeError, match="read-only"):
        c.mla_forms["decode"] = ("unabsorbed",)  # type: ignore[index]
    assert c.to_dict()["mla_forms"] == {"decode": ["absorbed"], "extend": ["absorbed", "unabsorbed"]}
    assert "mla(decode:absorbed,extend:absorbed+unabsorbed)" in c.summary()


@pytest.mark.parametrize("forms", [{"prefill": ("absorbed",)}, {"decode": ("latent",)}, {"decode": "absorbed"},
                                   ("decode", "absorbed")])
def test_malformed_mla_forms_is_a_descriptor_problem(forms):
    problems = capabilities_problems(Capabilities(mla_forms=forms))
    assert any("capabilities.mla_forms" in p for p in problems), problems


@pytest.mark.parametrize("forms, mode, form, expected", [
    ({}, ForwardMode.DECODE, "absorbed", "MLA layer not supported by X (Capabilities.mla_forms claims no MLA form)"),
    ({"extend": ("absorbed",)}, ForwardMode.DECODE, "absorbed",
     "MLA layer (absorbed decode) not supported by X (mla_forms: decode: none)"),
    ({"decode": ("absorbed",)}, ForwardMode.EXTEND, "absorbed", "MLA layer (absorbed extend) not supported by X"),
    ({"decode": ("absorbed",)}, ForwardMode.DECODE, "unabsorbed", "MLA layer (unabsorbed decode) not supported by X"),
    ({"extend": ("unabsorbed",)}, ForwardMode.TARGET_VERIFY, "absorbed", "MLA layer (absorbed extend)"),
    ({"extend": ("absorbed",)}, ForwardMode.DRAFT_EXTEND, "unabsorbed", "MLA layer (unabsorbed extend)"),
])
def test_support_reasons_name_layer_kind_and_form(forms, mode, form, expected):
    caps = Capabilities(mla_forms=forms, speculative_verify=True, draft_extend=True)
    reasons = support_reasons(caps, mla_layer(), mode=mode, mla_form=form, backend="X")
    assert any(expected in r for r in reasons), reasons


@pytest.mark.parametrize("mode, form", [(ForwardMode.DECODE, "absorbed"), (ForwardMode.EXTEND, "unabsorbed"),
                                        (ForwardMode.TARGET_VERIFY, "absorbed"), (ForwardMode.MIXED, "absorbed")])
def test_claimed_form_has_no_reason(mode, form):
    caps = Capabilities(mla_forms={"decode": ("absorbed",), "extend": ("absorbed", "unabsorbed")},
                        speculative_verify=True)
    assert support_reasons(caps, mla_layer(), mode=mode, mla_form=form) == []


def test_no_claim_refuses_the_layer_kind():
    assert mla_reasons(Capabilities(), None, None, "Y") == [
        "MLA layer not supported by Y (Capabilities.mla_forms claims no MLA form)"]
    # an MLA layer's latent width is not checked against head_dims: the MLA claim decides
    caps = Capabilities(head_dims=(64, 128), mla_forms={"decode": ("absorbed",)})
    assert support_reasons(caps, mla_layer()) == []


# -- the skeleton refuses per forward ------------------------------------------------------------------
class _Absorbed(PagedBackend):
    """A toy backend claiming absorbed decode only (computes with the reference)."""

    capabilities = Capabilities(mla_forms={"decode": ("absorbed",)})
    backend_name = "toy_mla"

    def compute_mla(self, q, latent, layer, batch, meta):
        rows = self.cache.read_latent(layer.layer_id)
        return reference_mla(q, latent, layer, batch, rows, self.cache.req_to_token).to(q.dtype)


def _setup(weights=True):
    cache = PagedKVCache(1, 8, 1, WIDTH, v_head_dim=0, page_size=4, max_requests=2, max_context_len=32)
    cache.assign_pages(0, 6, [5, 2])
    cache.set_latent(0, cache.slots(0, 0, 5).clone(), torch.randn(5, 1, WIDTH))
    ctx = BuildContext(config=AttentionConfig(attention_backend="toy_mla"), host=HostInfo(platform="cpu"),
                       dtype="float32", num_heads=H, num_kv_heads=1, head_dim=WIDTH, page_size=4, kv_cache=cache)
    return cache, _Absorbed(ctx), mla_layer(weights)


def test_skeleton_runs_claimed_form_and_writes_latent():
    cache, be, layer = _setup()
    batch = ForwardBatch.decode([0], [6], cache.slots(0, 5, 6).clone())
    be.init_forward_metadata(batch)
    q, lat = torch.randn(1, H, WIDTH), torch.randn(1, 1, WIDTH)
    out = be.forward(q, lat, None, layer, batch)
    assert out.shape == (1, H, LORA)
    assert torch.equal(cache.read_latent(0, cache.slots(0, 5, 6)), lat)


@pytest.mark.parametrize("what", ["unabsorbed", "extend"])
def test_skeleton_refuses_unclaimed_form_and_writes_nothing(what):
    cache, be, layer = _setup()
    before = cache.read_latent(0).clone()
    if what == "unabsorbed":
        batch = ForwardBatch.decode([0], [6], cache.slots(0, 5, 6).clone(), mla_form="unabsorbed")
        q = torch.randn(1, H, NOPE + ROPE)
    else:
        batch = ForwardBatch.extend([0], [5], [1], cache.slots(0, 5, 6).clone())
        q = torch.randn(1, H, WIDTH)
    be.init_forward_metadata(batch)
    with pytest.raises(NotSupportedError, match=r"MLA layer \((absorbed extend|unabsorbed decode)\) not supported "
                                                r"by toy_mla"):
        be.forward(q, torch.randn(1, 1, WIDTH), None, layer, batch)
    assert torch.equal(cache.read_latent(0), before)


@pytest.mark.parametrize("q_dim, k_shape, v, match", [
    (NOPE + ROPE, (1, 1, WIDTH), None, r"q has shape .* absorbed form"),
    (WIDTH, (1, 2, WIDTH), None, r"k has shape \(1, 2, 24\), expected \(1, 1, 24\)"),
    (WIDTH, (1, 1, LORA), None, r"k has shape"),
    (WIDTH, (1, 1, WIDTH), "v", r"v is given for MLA layer 0, expected None"),
])
def test_skeleton_shape_errors_name_the_field(q_dim, k_shape, v, match):
    cache, be, layer = _setup()
    batch = ForwardBatch.decode([0], [6], cache.slots(0, 5, 6).clone())
    be.init_forward_metadata(batch)
    vv = torch.randn(1, 1, LORA) if v else None
    with pytest.raises(ShapeError, match=match):
        be.forward(torch.randn(1, H, q_dim), torch.randn(*k_shape), vv, layer, batch)


class _Both(_Absorbed):
    capabilities = Capabilities(mla_forms={"decode": ("absorbed", "unabsorbed")})


def test_unabsorbed_without_weights_names_the_field():
    cache, _, _ = _setup()
    be = _Both(_setup()[1].ctx)
    layer = mla_layer(weights=False)
    batch = ForwardBatch.decode([0], [6], be.cache.slots(0, 5, 6).clone(), mla_form="unabsorbed")
    be.init_forward_metadata(batch)
    with pytest.raises(NotSupportedError, match=r"LayerSpec.mla.w_kc and LayerSpec.mla.w_vc.*no w_kc / w_vc"):
        be.forward(torch.randn(1, H, NOPE + ROPE), torch.randn(1, 1, WIDTH), None, layer, batch)
    # with the weights the same forward runs
    out = be.forward(torch.randn(1, H, NOPE + ROPE), torch.randn(1, 1, WIDTH), None, mla_layer(), batch)
    assert out.shape == (1, H, VD)


def test_idle_output_width_follows_the_form():
    _, be, layer = _setup()
    for form, width in (("absorbed", LORA), ("unabsorbed", VD)):
        batch = ForwardBatch.idle(mla_form=form)
        be.init_forward_metadata(batch)
        assert be.forward(torch.randn(0, H, layer.query_dim(form)), None, None, layer, batch).shape == (0, H, width)


# -- resolution -------------------------------------------------------------------------------------
CPU = HostInfo(platform="cpu", libraries={"torch": "2.8.0"})


def _mla_layers():
    return [LayerSpec(i, H, 1, WIDTH, mla=mla()) for i in range(2)]


def test_resolution_picks_an_mla_capable_pair():
    # on this CUDA host flashinfer/fa3 rank above torch_native, but claim no MLA form: torch_native serves
    host = HostInfo(platform="cuda", compute_capability=(9, 0),
                    libraries={"flashinfer-python": "0.6.1", "triton": "3.4.0", "sgl-kernel": "0.3.5",
                               "torch": "2.8.0"})
    plain = resolve(AttentionConfig(), host=host, registry=D.registry(host))
    assert plain.pair[0] != "torch_native"
    res = resolve(AttentionConfig(), host=host, registry=D.registry(host), layers=_mla_layers())
    assert res.pair == ("torch_native", "torch_native")


def test_resolution_arch_override_records_provenance():
    res = resolve(AttentionConfig(), arch="DeepseekV3ForCausalLM", host=CPU, registry=D.registry(CPU))
    recs = [r for r in res.records if r.pass_name == "arch_overrides"]
    assert recs and recs[0].source == "attnplug-torch-native"
    assert res.pair == ("torch_native", "torch_native")


def test_resolution_refuses_a_user_pair_without_mla_naming_the_layer_kind():
    host = HostInfo(platform="cuda", compute_capability=(9, 0),
                    libraries={"flashinfer-python": "0.6.1", "triton": "3.4.0", "torch": "2.8.0"})
    with pytest.raises(Exception) as info:
        resolve(AttentionConfig(decode_attention_backend="flashinfer", prefill_attention_backend="torch_native"),
                host=host, registry=D.registry(host), layers=_mla_layers())
    msg = str(info.value)
    assert "flashinfer" in msg and "MLA layer not supported by flashinfer" in msg


def test_resolution_needs_the_half_kind():
    # a backend claiming absorbed decode only may serve the decode half, not the prefill half
    import types

    from attnplug import BackendDescriptor, hookimpl

    mod = types.ModuleType("decode_mla_only")

    @hookimpl
    def attnplug_register_backends(register):
        register(BackendDescriptor(name="decode_mla", factory="nowhere:create", priority={"cpu": 50},
                                   capabilities=Capabilities(kv_layouts=None,
                                                             mla_forms={"decode": ("absorbed",)})))

    mod.attnplug_register_backends = attnplug_register_backends
    reg = D.registry(CPU, in_process_source(mod, "attnplug-decode-mla"))
    res = resolve(AttentionConfig(), host=CPU, registry=reg, layers=_mla_layers())
    assert res.pair == ("torch_native", "decode_mla")
    with pytest.raises(Exception, match=r"MLA layer \(extend\) not supported by decode_mla"):
        resolve(AttentionConfig(attention_backend="decode_mla"), host=CPU, registry=reg, layers=_mla_layers())


# -- the reference: the two forms agree ------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["decode", "extend"])
def test_reference_forms_agree(mode):
    g = torch.Generator().manual_seed(5)
    spec = mla()
    layer = LayerSpec(0, H, 1, WIDTH, mla=spec)
    cache = PagedKVCache(1, 8, 1, WIDTH, v_head_dim=0, page_size=4, max_requests=2, max_context_len=32)
    cache.assign_pages(0, 9, [7, 1, 4])
    cache.set_latent(0, cache.slots(0, 0, 6).clone(), torch.randn(6, 1, WIDTH, generator=g))
    n = 1 if mode == "decode" else 3
    loc = cache.slots(0, 6, 6 + n).clone()
    qn, qpe = torch.randn(n, H, NOPE, generator=g).double(), torch.randn(n, H, ROPE, generator=g).double()
    lat = torch.randn(n, 1, WIDTH, generator=g)
    mk = (lambda f: ForwardBatch.decode([0], [7], loc, mla_form=f)) if mode == "decode" else \
        (lambda f: ForwardBatch.extend([0], [6], [3], loc, mla_form=f))
    qa = torch.cat([torch.einsum("thn,hnl->thl", qn, spec.w_kc.double()), qpe], -1)
    oa = reference_mla(qa, lat, layer, mk("absorbed"), cache.read_latent(0), cache.req_to_token)
    ou = reference_mla(torch.cat([qn, qpe], -1), lat, layer, mk("unabsorbed"), cache.read_latent(0),
                       cache.req_to_token)
    assert oa.shape == (n, H, LORA) and ou.shape == (n, H, VD)
    torch.testing.assert_close(torch.einsum("thl,hlv->thv", oa, spec.w_vc.double()), ou, atol=1e-9, rtol=1e-9)


def test_reference_scale_is_not_the_latent_width():
    # a reference that used 1/sqrt(576)-style scaling would differ: the two scales give different outputs
    g = torch.Generator().manual_seed(2)
    layer = mla_layer()
    wrong = LayerSpec(0, H, 1, WIDTH, mla=layer.mla, scaling=1 / math.sqrt(WIDTH))
    cache = PagedKVCache(1, 4, 1, WIDTH, v_head_dim=0, page_size=4, max_requests=1, max_context_len=16)
    cache.assign_pages(0, 4, [2])
    cache.set_latent(0, cache.slots(0, 0, 3).clone(), 3 * torch.randn(3, 1, WIDTH, generator=g))
    batch = ForwardBatch.decode([0], [4], cache.slots(0, 3, 4).clone())
    q, lat = 3 * torch.randn(1, H, WIDTH, generator=g), torch.randn(1, 1, WIDTH, generator=g)
    a = reference_mla(q, lat, layer, batch, cache.read_latent(0), cache.req_to_token)
    b = reference_mla(q, lat, wrong, batch, cache.read_latent(0), cache.req_to_token)
    assert (a - b).abs().max() > 1e-3
