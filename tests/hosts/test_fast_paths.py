"""The runner's per-token fast paths (issue 30, round 3) skip work, never checks.

* a decode step maps its slot as an int (``AttnplugCache.extend_one``) and builds the batch from host
  ints: the same slots, pages and logits as the general path, and every corruption the per-forward
  checks catch (a changed page table, a bad slot, an unknown request, a length past the cache) is still
  refused, with the cache left as it was;
* each attention call is compared with its layer's ``LayerCall`` (built once); a call that differs in
  anything runs the full keyword check and gets its error.
"""

from __future__ import annotations

import pytest
import torch

import hf_models as models
from attnplug import AttentionConfig, AttnplugError, LayerSpec, ShapeError
from attnplug.integrations.transformers import Chunk, TransformersRunner
from attnplug.integrations.transformers.attention import Forward, LayerCall, _check_layer_kwargs


def _runner(**kw):
    kw.setdefault("max_requests", 3)
    kw.setdefault("max_context_len", 64)
    kw.setdefault("page_size", 4)
    return TransformersRunner(models.build("llama"), AttentionConfig(attention_backend="torch_native"), **kw)


# -- the decode slot -----------------------------------------------------------------------------------
@pytest.mark.parametrize("page_size,prompt", [(4, 3), (4, 4), (4, 5), (1, 2), (8, 7), (16, 1)])
def test_extend_one_maps_the_slot_and_pages_extend_maps(page_size, prompt):
    a, b = _runner(page_size=page_size), _runner(page_size=page_size)
    for r in (a, b):
        r.forward([Chunk("x", range(1, prompt + 1))])
    for _ in range(page_size + 2):  # across at least one page boundary
        slot = a.cache.extend_one("x")
        want = b.cache.extend("x", 1)
        assert [slot] == want.tolist()
        assert a.cache._seqs["x"].pages == b.cache._seqs["x"].pages
        assert torch.equal(a.kv_cache.req_to_token, b.kv_cache.req_to_token)


@pytest.mark.parametrize("prompt_len", [9, 6])
def test_a_decode_step_gives_the_logits_the_general_path_gives(prompt_len, fill):
    """The same token as a decode chunk (host-int path) and as a one-token extend chunk (tensor path)."""
    fast, slow = _runner(), _runner()
    prompt = models.prompts((prompt_len,))[0]
    for r in (fast, slow):
        r.forward([Chunk("a", prompt), Chunk("b", prompt[:5])])
    for tok in (3, 17, 250, 5, 9):
        lf = fast.forward([Chunk("a", (tok,), decode=True), Chunk("b", (tok,), decode=True)])
        ls = slow.forward([Chunk("a", (tok,)), Chunk("b", (tok,))])
        assert fast.steps[-1].mode.value == "decode" and slow.steps[-1].mode.value == "extend"
        torch.testing.assert_close(lf, ls, rtol=1e-5, atol=1e-5)
        assert_same_mapping(fast, slow, fill)


def _prefix_entry(value):
    def corrupt(runner):
        runner.kv_cache.req_to_token[runner.cache.row("a"), 2] = value
    return corrupt


def _bad_page(runner):
    seq = runner.cache._seqs["a"]
    seq.pages[seq.length // runner.kv_cache.page_size] = runner.kv_cache.num_pages + 3


CORRUPTIONS = {
    "prefix entry unassigned": (_prefix_entry(-1), ShapeError, r"position 2 .* is unassigned"),
    "prefix entry wild": (_prefix_entry(10 ** 6), ShapeError, r"position 2 .* is out of range"),
    "prefix entry past the slots": (_prefix_entry(4 * 64), ShapeError, r"position 2 .* is out of range"),
    "new slot past the cache": (_bad_page, ShapeError, r"out_cache_loc\[0\]=\d+ is out of range"),
}
#: with the decode step's page fill (round 7) a bad page id is refused by the fill, before any slot is used
FILL_WORDS = {"new slot past the cache": r"decode step of request 'a': fill_from_pages: request \d+: page 1 is "
                                         r"block 67, which is out of range \(expected 0 <= block < num_pages=64\)"}


@pytest.fixture(params=["fill", "entry writes"])
def fill(request, monkeypatch):
    """Both ways a decode step maps its rows: ``fill_from_pages`` (the default) and one entry write per request."""
    from attnplug.integrations.transformers import cache

    monkeypatch.setattr(cache, "_FILL", request.param == "fill")
    return request.param == "fill"


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_a_corrupted_cache_is_refused_at_a_decode_step_and_the_request_keeps_its_length(case, fill):
    corrupt, exc, match = CORRUPTIONS[case]
    if fill:
        match = FILL_WORDS.get(case, match)
    runner = _runner(num_pages=64)
    runner.forward([Chunk("a", range(1, 6))])  # 5 tokens: the next one goes into the second page
    runner.forward([Chunk("a", (7,), decode=True)])
    row, length = runner.cache.row("a"), runner.cache.length("a")
    corrupt(runner)
    table = runner.kv_cache.req_to_token.clone()
    with pytest.raises(exc, match=match):
        runner.forward([Chunk("a", (8,), decode=True)])
    assert runner.cache.length("a") == length
    assert int(runner.kv_cache.req_to_token[row, length]) == -1  # the new position unmapped again
    assert torch.equal(runner.kv_cache.req_to_token[:, :length], table[:, :length])


def test_a_decode_step_for_an_unknown_request_or_past_the_context_is_refused():
    runner = _runner(max_context_len=8)
    with pytest.raises(AttnplugError, match="decode Chunk for request 'z', which has no prompt in the cache"):
        runner.forward([Chunk("z", (1,), decode=True)])
    runner.forward([Chunk("a", range(1, 9))])
    with pytest.raises(AttnplugError, match="would hold 9 tokens, beyond max_context_len=8"):
        runner.forward([Chunk("a", (3,), decode=True)])
    assert runner.cache.length("a") == 8 and runner.cache.requests == ["a"]


# -- the per-layer call check ------------------------------------------------------------------------
class _Module:
    def __init__(self, layer_idx=0, is_causal=True):
        self.layer_idx, self.is_causal = layer_idx, is_causal


LAYERS = {
    "plain": LayerSpec(layer_id=0, num_heads=4, num_kv_heads=2, head_dim=8),
    "window": LayerSpec(layer_id=0, num_heads=4, num_kv_heads=2, head_dim=8, sliding_window=7),
    "window 0": LayerSpec(layer_id=0, num_heads=4, num_kv_heads=2, head_dim=8, sliding_window=0),
    "cap": LayerSpec(layer_id=0, num_heads=4, num_kv_heads=2, head_dim=8, logit_cap=30.0),
    "sinks": LayerSpec(layer_id=0, num_heads=4, num_kv_heads=2, head_dim=8, sinks=torch.zeros(4)),
}


def _good(layer):
    """The call the model makes for ``layer``: (module, scaling, dropout, mask, kwargs)."""
    kw = {"position_ids": None}
    if layer.sliding_window is not None:
        kw["sliding_window"] = layer.sliding_window + 1
    if layer.logit_cap:
        kw["softcap"] = layer.logit_cap
    if layer.sinks is not None:
        kw["s_aux"] = layer.sinks
    return _Module(), layer.scaling, 0.0, None, kw


def _vary(name):
    def apply(layer):
        module, scaling, dropout, mask, kw = _good(layer)
        kw = dict(kw)
        if name == "mask":
            mask = torch.zeros(1, 1, 1, 1)
        elif name == "dropout":
            dropout = 0.1
        elif name == "scaling off":
            scaling = layer.scaling * 1.1
        elif name == "scaling within tolerance":
            scaling = layer.scaling * (1 + 1e-9)
        elif name == "scaling None":
            scaling = None
        elif name == "window added":
            kw["sliding_window"] = 5
        elif name == "window dropped":
            kw.pop("sliding_window", None)
        elif name == "window as bool":
            kw["sliding_window"] = True
        elif name == "window as float":
            kw["sliding_window"] = None if layer.sliding_window is None else float(layer.sliding_window + 1)
        elif name == "softcap added":
            kw["softcap"] = 50.0
        elif name == "softcap dropped":
            kw.pop("softcap", None)
        elif name == "is_causal False":
            kw["is_causal"] = False
        elif name == "module bidirectional":
            module = _Module(is_causal=False)
        elif name == "sinks added":
            kw["s_aux"] = torch.zeros(4)
        elif name == "sinks dropped":
            kw.pop("s_aux", None)
        return module, scaling, dropout, mask, kw
    return apply


VARIANTS = ["as the model calls", "mask", "dropout", "scaling off", "scaling within tolerance", "scaling None",
            "window added", "window dropped", "window as bool", "window as float", "softcap added",
            "softcap dropped", "is_causal False", "module bidirectional", "sinks added", "sinks dropped"]


def _outcome(fn):
    try:
        fn()
    except (AttnplugError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


@pytest.mark.parametrize("layer_name", sorted(LAYERS))
@pytest.mark.parametrize("variant", VARIANTS)
def test_layer_call_accepts_only_calls_the_full_check_accepts_and_attend_words_the_same_error(layer_name, variant):
    layer = LAYERS[layer_name]
    module, scaling, dropout, mask, kw = _vary(variant)(layer)
    full = _outcome(lambda: _check_layer_kwargs(layer, module, scaling, dropout, mask, kw))
    plan = LayerCall(layer)
    if full is not None:
        assert not plan.matches(module, scaling, dropout, mask, kw)  # never skips a check that would fail
        fwd = Forward(None, None, [layer], None, [plan])  # the check runs before the backend is reached
        q = torch.zeros(1, 4, 1, 8)
        assert _outcome(lambda: fwd.attend(module, q, q, q, mask, scaling, dropout, kw)) == full
    if variant == "as the model calls":
        assert full is None and plan.matches(module, scaling, dropout, mask, kw)


def test_a_layer_call_for_another_spec_object_is_not_trusted():
    """``Forward`` checks with a plan only when the plan was built for the very spec it serves."""
    layer, other = LAYERS["plain"], LAYERS["window"]
    module, scaling, dropout, mask, kw = _good(layer)
    kw["sliding_window"] = 8  # what ``other`` expects, not ``layer``
    fwd = Forward(None, None, [layer], None, [LayerCall(other)])
    q = torch.zeros(1, 4, 1, 8)
    with pytest.raises(AttnplugError, match="the model passes sliding_window=8"):
        fwd.attend(module, q, q, q, mask, scaling, dropout, kw)


@pytest.mark.parametrize("unknown_at", [0, 1, 2])
def test_a_decode_step_with_an_unknown_request_maps_nothing(unknown_at):
    """``AttnplugCache.decode_step`` maps the requests one after the other; when one is unknown, those mapped
    before it are given back by the runner (lengths, pages and ``req_to_token`` as before the step)."""
    runner = _runner(num_pages=64)
    runner.forward([Chunk("a", range(1, 5)), Chunk("b", range(1, 8))])  # "a" fills its page: a decode takes one
    table = runner.kv_cache.req_to_token.clone()
    pages = {rid: list(runner.cache._seqs[rid].pages) for rid in ("a", "b")}
    free = runner.cache.pool.free_pages
    rids = ["a", "b"]
    rids.insert(unknown_at, "z")
    with pytest.raises(AttnplugError, match="decode Chunk for request 'z', which has no prompt in the cache"):
        runner.forward([Chunk(r, (3,), decode=True) for r in rids])
    assert torch.equal(runner.kv_cache.req_to_token, table)
    assert {rid: runner.cache._seqs[rid].pages for rid in ("a", "b")} == pages
    assert runner.cache.pool.free_pages == free and runner.cache.length("a") == 4 and runner.cache.length("b") == 7


def assert_same_mapping(fast, slow, fill):
    """``fast``'s ``req_to_token`` maps what ``slow``'s (entry writes) maps. Without the fill: equal tensors. With
    it (whole pages): every position below each request's length equal, and past it each entry of a request's
    row either unassigned or a slot of that request's own last page (never another request's slot); rows of
    no request as in ``slow``."""
    a, b = fast.kv_cache.req_to_token, slow.kv_cache.req_to_token
    if not fill:
        assert torch.equal(a, b)
        return
    ps, owned = fast.kv_cache.page_size, set()
    for rid, seq in fast.cache._seqs.items():
        owned.add(seq.row)
        n = seq.length
        assert torch.equal(a[seq.row, :n], b[slow.cache.row(rid), :n]), rid
        mine = {p * ps + o for p in seq.pages for o in range(ps)}
        assert all(x == -1 or x in mine for x in a[seq.row, n:].tolist()), rid
    for r in range(a.shape[0]):
        if r not in owned:
            assert torch.equal(a[r], b[r]), r


def test_decode_step_maps_what_extend_one_maps(fill):
    a, b = _runner(), _runner()
    for r in (a, b):
        r.forward([Chunk("x", range(1, 4)), Chunk("y", range(1, 6))])
    for _ in range(6):  # across page boundaries of both
        prefix: dict = {}
        rows, lens, slots = a.cache.decode_step(["x", "y"], prefix)
        want = [b.cache.extend_one("x"), b.cache.extend_one("y")]
        assert slots == want and rows == [b.cache.row("x"), b.cache.row("y")]
        assert lens == [b.cache.length("x"), b.cache.length("y")] == [prefix["x"] + 1, prefix["y"] + 1]
        assert_same_mapping(a, b, fill)
        assert (a.kv_cache.page_fill(rows, lens) is not None) == fill  # the fill's record covers the step


# -- the greedy pick (round 5) -------------------------------------------------------------------------
class _ScriptedRunner:
    """A runner stand-in whose forwards return given logits (no model): what ``generate`` picks from them."""

    def __init__(self, rows: list[torch.Tensor]) -> None:
        self.rows, self.steps, self.released = list(rows), [], []

    def forward(self, chunks):
        return torch.stack([self.rows.pop(0) for _ in chunks])

    def release(self, rid):
        self.released.append(rid)


_NAN = float("nan")
LOGITS = {
    "a clear maximum": [0.1, 3.0, -1.0, 2.9],
    "a tie: the first index": [1.0, 5.0, 5.0, 0.0],
    "all equal": [2.0, 2.0, 2.0, 2.0],
    "a NaN counts as the maximum": [1.0, _NAN, 7.0, 0.0],
    "two NaNs: the first": [_NAN, 0.0, _NAN, 9.0],
    "-inf and +inf": [float("-inf"), float("inf"), 1e30, float("inf")],
}


@pytest.mark.parametrize("batch", [1, 3])
def test_one_argmax_for_all_rows_picks_what_greedy_picks_row_by_row(monkeypatch, batch):
    from attnplug.integrations.transformers import Request, generate
    from attnplug.integrations.transformers import loop

    rows = [torch.tensor(v) for v in LOGITS.values()]
    new = len(rows)  # every scripted row is picked from once per request
    script = [rows[(step + r) % len(rows)] for step in range(new) for r in range(batch)]
    picked = {}
    for one in (True, False):
        monkeypatch.setattr(loop, "_ONE_ARGMAX", one)
        res = generate(_ScriptedRunner(script), [Request([1], new) for _ in range(batch)], max_running=batch)
        picked[one] = res.tokens
    assert picked[True] == picked[False]
    assert picked[True][0][:4] == [1, 1, 0, 1]
