"""KV-cache layouts: the cache reads and writes any slot through its layout, plugins define
layouts, resolution picks one layout both halves read (or refuses naming both), and a backend
is never built over a cache in a layout it does not read."""

from __future__ import annotations

import types

import pytest
import torch

from attnplug import AttentionConfig, BackendDescriptor, BuildContext, Capabilities, HostInfo, PagedKVCache, hookimpl
from attnplug.errors import ConfigError, KVLayoutError, NotSupportedError, PluginError, ShapeError
from attnplug.kvlayout import HND, NHD, KVGeometry, KVLayout, NHDLayout
from attnplug.registry import Registry, in_process_source
from attnplug.resolution import resolve, trace

CPU = HostInfo(platform="cpu")


def _cache(layout: object = NHD, **kw: object) -> PagedKVCache:
    args = dict(num_layers=2, num_pages=6, num_kv_heads=2, head_dim=4, v_head_dim=3, page_size=4, layout=layout)
    args.update(kw)
    return PagedKVCache(**args)  # type: ignore[arg-type]


def _rows(n: int, heads: int, dim: int, seed: int) -> torch.Tensor:
    return torch.randn(n, heads, dim, generator=torch.Generator().manual_seed(seed))


# -- the cache through a layout ------------------------------------------------------
@pytest.mark.parametrize("layout", [NHD, HND])
def test_any_slots_written_are_read_back_exactly_and_nothing_else_changes(layout: str) -> None:
    cache = _cache(layout)
    before = [cache.read_kv(i) for i in range(2)]
    slots = torch.tensor([17, 2, 9, 23, 4])  # scattered, out of order, across pages
    k, v = _rows(5, 2, 4, 0), _rows(5, 2, 3, 1)
    cache.set_kv(1, slots, k, v)
    got_k, got_v = cache.read_kv(1, slots)
    assert torch.equal(got_k, k) and torch.equal(got_v, v)
    all_k, all_v = cache.read_kv(1)
    others = torch.ones(cache.num_slots, dtype=torch.bool)
    others[slots] = False
    assert torch.equal(all_k[others], before[1][0][others]) and torch.equal(all_v[others], before[1][1][others])
    assert all(torch.equal(a, b) for a, b in zip(cache.read_kv(0), before[0]))  # another layer: untouched
    got_k.fill_(7.0)  # read_kv returns copies, never views of the storage
    assert torch.equal(cache.read_kv(1, slots)[0], k)


def test_hnd_storage_is_head_major_pages() -> None:
    cache = _cache(HND)
    kb, vb = cache.layer_storage(0)
    assert tuple(kb.shape) == (6, 2, 4, 4) and tuple(vb.shape) == (6, 2, 4, 3)
    k, v = _rows(1, 2, 4, 2), _rows(1, 2, 3, 3)
    cache.set_kv(0, torch.tensor([13]), k, v)  # slot 13 = page 3, offset 1
    assert torch.equal(kb[3, :, 1], k[0]) and torch.equal(vb[3, :, 1], v[0])
    assert int((kb != 0).sum()) == int((k != 0).sum())


def test_token_major_accessors_name_the_layout_when_it_is_not_nhd() -> None:
    cache = _cache(HND)
    for access in (lambda: cache.get_kv(0), lambda: cache.k_buffers, lambda: cache.v_buffers):
        with pytest.raises(KVLayoutError, match="layout 'hnd'.*read_kv"):
            access()
    assert torch.equal(_cache(NHD).get_kv(0)[0], _cache(NHD).read_kv(0)[0])


@pytest.mark.parametrize("layout", [NHD, HND])
def test_read_kv_checks_slots_and_layer(layout: str) -> None:
    cache = _cache(layout)
    with pytest.raises(ShapeError, match=r"slots\[1\]=24 is out of range .*num_slots=24"):
        cache.read_kv(0, torch.tensor([0, 24]))
    with pytest.raises(ShapeError, match=r"slots\[0\]=-1"):
        cache.read_kv(0, torch.tensor([-1]))
    with pytest.raises(ShapeError, match="layer_id=2 is out of range"):
        cache.read_kv(2)


@pytest.mark.parametrize("layout", [NHD, HND])
def test_staged_write_is_undone_when_the_block_raises_in_any_layout(layout: str) -> None:
    cache = _cache(layout)
    before = cache.read_kv(0)
    loc = torch.tensor([5, 6, 11])
    with pytest.raises(RuntimeError, match="kernel failed"):
        with cache.staged(0, loc, _rows(3, 2, 4, 4), _rows(3, 2, 3, 5)):
            assert not torch.equal(cache.read_kv(0)[0], before[0])
            raise RuntimeError("kernel failed")
    assert all(torch.equal(a, b) for a, b in zip(cache.read_kv(0), before))
    with cache.staged(0, loc, _rows(3, 2, 4, 4), _rows(3, 2, 3, 5), keep=False):
        pass
    assert all(torch.equal(a, b) for a, b in zip(cache.read_kv(0), before))


class _EvenPagesOnly(NHDLayout):
    """A toy plugin layout: token-major, but only for even page sizes and K/V of one width."""

    name = "toy_even"
    description = "test layout"

    def geometry_reasons(self, geometry: KVGeometry) -> list[str]:
        out = []
        if geometry.page_size % 2:
            out.append(f"page_size={geometry.page_size} is odd (needs a multiple of 2)")
        if geometry.v_head_dim != geometry.head_dim:
            out.append("v_head_dim must equal head_dim")
        return out


def test_a_layout_refuses_a_geometry_it_cannot_hold_naming_itself() -> None:
    with pytest.raises(ValueError, match="layout 'toy_even' cannot hold this cache: page_size=3 is odd.*"
                                         "v_head_dim must equal head_dim"):
        _cache(_EvenPagesOnly(), page_size=3)
    assert _cache(_EvenPagesOnly(), page_size=2, v_head_dim=4).layout.name == "toy_even"
    with pytest.raises(ValueError, match="kv layout 'nope' is not one of the core's"):
        _cache("nope")
    with pytest.raises(ValueError, match="expected a KVLayout"):
        _cache(3)


# -- plugins define layouts; backends declare the ones they read -----------------------
def _plugin(name: str, layouts: tuple[str, ...] | None, *, priority: int = 5,
            factories: dict[str, str] | None = None, head_dims: tuple[int, ...] | None = None) -> types.ModuleType:
    mod = types.ModuleType(f"layout_plugin_{name}")

    @hookimpl
    def attnplug_register_backends(register):  # type: ignore[no-untyped-def]
        register(BackendDescriptor(
            name=name, factory="attnplug_template_backend.backend:create",
            capabilities=Capabilities(dtypes=("float32",), kv_layouts=layouts, head_dims=head_dims),
            priority={"cpu": priority}, kv_layout_factories=factories or {}))

    mod.attnplug_register_backends = attnplug_register_backends  # type: ignore[attr-defined]
    return mod


TOY = {"toy_even": f"{__name__}:_EvenPagesOnly"}


def _registry(*plugins: tuple[types.ModuleType, str]) -> Registry:
    reg = Registry(host=CPU)
    reg.load_sources([in_process_source(m, dist, "1.0") for m, dist in plugins])
    return reg


def test_registry_builds_a_plugin_layout_and_lists_every_layout_with_its_owner() -> None:
    reg = _registry((_plugin("toyb", ("toy_even",), factories=TOY), "attnplug-toyb"))
    assert reg.layout_names() == {"nhd": "core", "hnd": "core", "toy_even": "attnplug-toyb"}
    layout = reg.kv_layout("toy_even")
    assert isinstance(layout, _EvenPagesOnly) and reg.kv_layout("toy_even") is layout
    assert reg.kv_layout("hnd").name == "hnd"
    with pytest.raises(ConfigError, match="KV layout 'missing' is not defined .*known: hnd, nhd, toy_even"):
        reg.kv_layout("missing")


def test_two_distributions_defining_one_layout_make_it_unusable_naming_both() -> None:
    other = {"toy_even": "elsewhere:Layout"}
    reg = _registry((_plugin("toya", ("toy_even",), factories=TOY), "attnplug-toya"),
                    (_plugin("toyb", ("toy_even",), factories=other), "attnplug-toyb"))
    assert "toy_even" not in reg.layout_names()
    with pytest.raises(ConfigError, match="'toy_even' is defined by both 'attnplug-toya'.*'attnplug-toyb'"):
        reg.kv_layout("toy_even")
    reg = _registry((_plugin("toya", ("nhd",), factories={"nhd": f"{__name__}:_EvenPagesOnly"}), "attnplug-toya"))
    assert reg.kv_layout("nhd").__class__ is NHDLayout  # a plugin cannot redefine a core layout
    assert "redefines the core's layout 'nhd'" in reg.layout_conflicts["nhd"]


def test_a_layout_path_that_is_not_a_kv_layout_is_the_plugins_fault() -> None:
    reg = _registry((_plugin("toya", ("bad",), factories={"bad": f"{__name__}:_rows"}), "attnplug-toya"))
    with pytest.raises(PluginError, match="attnplug-toya.*must be a KVLayout subclass whose name is 'bad'"):
        reg.kv_layout("bad")
    reg = _registry((_plugin("toya", ("gone",), factories={"gone": "no_such_module_here:X"}), "attnplug-toya"))
    with pytest.raises(PluginError, match="attnplug-toya.*loading KV layout 'gone'"):
        reg.kv_layout("gone")


@pytest.mark.parametrize("bad", [(), "nhd", ("nhd", ""), [1]])
def test_malformed_kv_layouts_set_the_plugin_aside(bad: object) -> None:
    reg = _registry((_plugin("toya", bad), "attnplug-toya"))  # type: ignore[arg-type]
    assert "toya" not in reg.names()
    assert "capabilities.kv_layouts" in reg.failed_plugins()[0].error


# -- resolution: one cache serves both halves -------------------------------------------
def _three() -> Registry:
    return _registry((_plugin("reads_nhd", ("nhd",), priority=5), "attnplug-a"),
                     (_plugin("reads_toy", ("toy_even",), priority=20, factories=TOY), "attnplug-b"),
                     (_plugin("reads_any", None, priority=1), "attnplug-c"))


def test_a_pair_sharing_no_layout_is_refused_naming_both_halves_layouts() -> None:
    res = trace(AttentionConfig(prefill_attention_backend="reads_nhd", decode_attention_backend="reads_toy"),
                host=CPU, registry=_three())
    assert isinstance(res.error, ConfigError)
    msg = str(res.error)
    assert "shares no KV-cache layout" in msg and "reads_nhd reads nhd" in msg and "reads_toy reads toy_even" in msg
    assert "toy_even: reads_any, reads_toy" in msg  # who reads what, to choose from


def test_a_half_reading_any_layout_follows_the_other_half_with_provenance() -> None:
    res = resolve(AttentionConfig(prefill_attention_backend="reads_any", decode_attention_backend="reads_toy"),
                  host=CPU, registry=_three())
    assert res.config.kv_layout == "toy_even"
    rec = res.records[-1]
    assert rec.pass_name == "kv_layout" and rec.applied == {"kv_layout": "toy_even"}
    assert "reads_any reads any (through read_kv/set_kv)" in rec.rule and "reads_toy reads toy_even" in rec.rule
    assert "kv_layout" in res.explain()


def test_an_unpinned_half_moves_to_the_best_backend_sharing_the_pinned_halfs_layout() -> None:
    # decode is left to priority (reads_toy, 20), but the user's prefill reads only nhd
    res = resolve(AttentionConfig(prefill_attention_backend="reads_nhd"), host=CPU, registry=_three())
    assert res.pair == ("reads_nhd", "reads_nhd") and res.config.kv_layout == "nhd"
    rec = res.records[-1]
    assert rec.pass_name == "kv_layout" and "the decode half moves to reads_nhd" in rec.rule
    # without a pinned half the best backend serves both, in its own layout
    res = resolve(AttentionConfig(), host=CPU, registry=_three())
    assert res.pair == ("reads_toy", "reads_toy") and res.config.kv_layout == "toy_even"


def test_the_users_layout_is_pinned_and_checked() -> None:
    res = resolve(AttentionConfig(kv_layout="hnd"), host=CPU, registry=_three())
    assert res.pair == ("reads_any", "reads_any") and res.config.kv_layout == "hnd"
    res = trace(AttentionConfig(kv_layout="hnd", attention_backend="reads_nhd"), host=CPU, registry=_three())
    assert isinstance(res.error, ConfigError) and "kv_layout=hnd (reads: nhd)" in str(res.error)
    res = trace(AttentionConfig(kv_layout="nope", attention_backend="reads_any"), host=CPU, registry=_three())
    assert isinstance(res.error, ConfigError) and "kv_layout='nope' (flag --kv-layout) is not defined" in str(res.error)
    with pytest.raises(ConfigError, match="kv_layout=''"):
        AttentionConfig(kv_layout="")


def test_build_refuses_a_cache_in_a_layout_the_backend_does_not_read() -> None:
    from attnplug.registry import default_registry

    reg = default_registry()
    cache = PagedKVCache(1, 4, 1, 8, page_size=4, layout=HND)
    ctx = BuildContext(config=AttentionConfig(attention_backend="template_sdpa"), host=reg.host, head_dim=8,
                       page_size=4, kv_cache=cache)
    with pytest.raises(NotSupportedError, match=r"kv_layout=hnd \(reads: nhd\)"):
        reg.build("template_sdpa", ctx)


def test_a_custom_layout_subclass_needs_only_its_four_methods() -> None:
    class Reversed(KVLayout):
        """Slots stored in reverse order: a layout the core knows nothing about."""

        name = "reversed"

        def allocate(self, g, dtype, device):  # type: ignore[no-untyped-def]
            return (torch.zeros(g.num_slots, g.num_kv_heads, g.head_dim, dtype=dtype),
                    torch.zeros(g.num_slots, g.num_kv_heads, g.v_head_dim, dtype=dtype))

        def read(self, storage, g, slots):  # type: ignore[no-untyped-def]
            return storage[0][g.num_slots - 1 - slots].clone(), storage[1][g.num_slots - 1 - slots].clone()

        def write(self, storage, g, slots, k, v):  # type: ignore[no-untyped-def]
            storage[0][g.num_slots - 1 - slots] = k
            storage[1][g.num_slots - 1 - slots] = v

    cache = _cache(Reversed())
    k, v = _rows(2, 2, 4, 6), _rows(2, 2, 3, 7)
    cache.set_kv(0, torch.tensor([0, 1]), k, v)
    assert torch.equal(cache.layer_storage(0)[0][23], k[0]) and torch.equal(cache.read_kv(0, torch.tensor([1]))[1], v[1:])


def test_the_models_layers_take_part_in_the_choice() -> None:
    """resolve(..., layers=): the best backend by priority is passed over when it does not claim a layer
    (here a head dim), and the rejection names the layer; without layers it would have been chosen."""
    from attnplug import LayerSpec

    reg = _registry((_plugin("reads_nhd", ("nhd",), priority=5), "attnplug-a"),
                    (_plugin("narrow", ("nhd",), priority=20, head_dims=(64, 128)), "attnplug-b"))
    assert resolve(AttentionConfig(), host=CPU, registry=reg).pair == ("narrow", "narrow")
    layers = [LayerSpec(0, 4, 2, 64), LayerSpec(1, 4, 2, 16)]
    res = resolve(AttentionConfig(), host=CPU, registry=reg, layers=layers)
    assert res.pair == ("reads_nhd", "reads_nhd")
    assert any("layer 1: head_dim=16 (supported: 64, 128)" in r for r in res.rejected()["narrow"])
    res = trace(AttentionConfig(attention_backend="narrow"), host=CPU, registry=reg, layers=layers)
    assert isinstance(res.error, ConfigError) and "layer 1: head_dim=16" in str(res.error)
