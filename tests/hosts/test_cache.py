"""The transformers Cache backed by PagedKVCache: the backend writes K/V, pages follow requests."""

from __future__ import annotations

import pytest
import torch

import hf_models as models
from attnplug import AttentionConfig, AttnplugError
from attnplug.integrations.transformers import Chunk, PagePool, TransformersRunner


def _runner(arch="llama", **kw):
    kw.setdefault("max_requests", 3)
    kw.setdefault("max_context_len", 64)
    return TransformersRunner(models.build(arch), AttentionConfig(attention_backend="torch_native"), **kw)


def test_the_backend_writes_the_keys_transformers_would_have_cached():
    prompt = models.prompts((21,))[0]
    eager = models.build("gpt_oss")
    with torch.inference_mode():
        dyn = eager(torch.tensor([prompt]), use_cache=True).past_key_values
    runner = _runner("gpt_oss", page_size=8)
    runner.forward([Chunk("a", prompt)])
    slots = runner.kv_cache.slots(runner.cache.row("a"), 0, 21)
    for layer in range(2):
        k, v = runner.kv_cache.get_kv(layer)
        want_k = dyn.layers[layer].keys[0].transpose(0, 1)  # [tokens, kv_heads, dim]
        want_v = dyn.layers[layer].values[0].transpose(0, 1)
        # the sliding layer's DynamicCache keeps only its window; compare what it kept
        n = want_k.shape[0]
        assert torch.allclose(k[slots[-n:]], want_k, atol=1e-5) and torch.allclose(v[slots[-n:]], want_v, atol=1e-5)
    assert runner.cache.layers[0].keys is None  # transformers' side stores nothing


def test_pages_are_taken_as_a_request_grows_and_freed_when_it_finishes():
    runner = _runner(page_size=4, num_pages=10)
    cache, pool = runner.cache, runner.cache.pool
    runner.forward([Chunk("a", range(6)), Chunk("b", range(3))])  # 2 pages + 1 page
    assert pool.free_pages == 7 and cache.length("a") == 6 and cache.length("b") == 3
    for t in range(3):  # b grows to 6: one more page when it passes 4
        runner.forward([Chunk("a", [t], decode=True), Chunk("b", [t], decode=True)])
    assert cache.length("b") == 6 and pool.free_pages == 10 - 3 - 2
    row_b = cache.row("b")
    runner.release("b")
    assert pool.free_pages == 10 - 3 and bool((runner.kv_cache.req_to_token[row_b, :6] == -1).all())
    runner.forward([Chunk("c", range(5))])
    assert cache.row("c") == row_b  # the freed row is reused
    with pytest.raises(AttnplugError, match="already in the KV cache"):
        cache.add_request("c")
    with pytest.raises(AttnplugError, match="request 'zz' is not in the KV cache"):
        runner.release("zz")


def test_running_out_of_pages_or_rows_says_so_and_leaves_the_cache_as_it_was():
    runner = _runner(page_size=4, num_pages=3, max_requests=2)
    with pytest.raises(AttnplugError, match="out of pages: asked for 4, 3 of 3 free"):
        runner.forward([Chunk("a", range(13))])
    assert runner.cache.requests == [] and runner.cache.pool.free_pages == 3
    runner.forward([Chunk("a", range(2)), Chunk("b", range(2))])
    with pytest.raises(AttnplugError, match="no free request row for 'c': all 2 rows are in use"):
        runner.forward([Chunk("c", range(2))])
    assert runner.cache.requests == ["a", "b"]


def test_a_ragged_batch_has_no_single_sequence_length():
    runner = _runner()
    runner.cache.begin_forward({"a": 3, "b": 5})
    with pytest.raises(AttnplugError, match=r"ragged batch of 2 requests with cached lengths \[3, 5\]: there is no "
                                            r"single sequence length"):
        runner.cache.get_seq_length()
    runner.cache.begin_forward({"a": 3})
    assert runner.cache.get_seq_length() == 3
    runner.cache.begin_forward({"a": 0, "b": 0})  # every request with the same cached length: that one
    assert runner.cache.get_seq_length() == 0


def test_page_pool_refuses_foreign_pages():
    pool = PagePool(4)
    assert pool.alloc(2) == [0, 1]
    with pytest.raises(AttnplugError, match="page 9 is not a page of this pool"):
        pool.free([9])
