"""Issue 26, items 4 and 16: flag values that used to end a process with a signal or an internal
error, exit statuses the docs promise, and inputs that used to give a bare AttributeError or go
unnoticed. Anything that could end a process with a signal runs in a fresh interpreter and asserts
a clean exit status and one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from attnplug import ForwardBatch, LayerSpec, PagedKVCache, ShapeError
from attnplug.cli.bench_cmd import MAX_BANDWIDTH_MIB
from attnplug.cli.main import main
from tests.paged_setup import qkv, small_setup


def attnplug(*args, timeout=180):
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATTNPLUG_")}
    return subprocess.run([sys.executable, "-m", "attnplug", *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


def one_line(proc, status, fragment):
    assert proc.returncode == status, (proc.returncode, proc.stdout[-300:], proc.stderr)  # never a signal (< 0)
    assert "Traceback" not in proc.stderr and "internal error" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and fragment in lines[0], lines
    return lines[0]


# -- item 4: bench's --threads and --bandwidth-mib are bounded ------------------------------------
CPUS = os.cpu_count() or 1
QUICK = ["bench", "--quick", "--mode", "decode", "--context", "32"]


@pytest.mark.parametrize("value", ["100000", str(CPUS + 1), str(2**31), str(2**63)])
def test_threads_above_the_cpu_count_is_a_usage_error(value):
    proc = attnplug(*QUICK, "--threads", value)
    one_line(proc, 2, f"attnplug bench: error: --threads '{value}': {int(value)} is above {CPUS} (this machine's "
                      f"CPU count)")
    assert proc.stdout == ""


@pytest.mark.parametrize("value", ["999999999", str(MAX_BANDWIDTH_MIB + 1), str(2**62)])
def test_bandwidth_above_the_cap_is_a_usage_error(value):
    proc = attnplug(*QUICK, "--bandwidth-mib", value)
    one_line(proc, 2, f"--bandwidth-mib '{value}': {int(value)} is above {MAX_BANDWIDTH_MIB} (the cap on the tensor "
                      f"summed, {MAX_BANDWIDTH_MIB} MiB)")


@pytest.mark.parametrize("free_mib,value,refused", [(1024, 513, True), (1024, 512, False), (100, 64, True)])
def test_bandwidth_above_half_the_free_memory_is_a_usage_error_simulated(monkeypatch, capsys, free_mib, value, refused):
    """The free memory is simulated (a real test would have to fill this shared machine's memory)."""
    from attnplug.bench import runner
    from attnplug.bench.spec import BenchUsageError

    monkeypatch.setattr(runner, "available_memory", lambda device: free_mib << 20)
    spec = _parse(["--quick", "--mode", "decode", "--bandwidth-mib", str(value)])
    if refused:
        with pytest.raises(BenchUsageError, match=f"--bandwidth-mib {value}: the tensor summed would take more than "
                                                  f"half the free memory of cpu \\({free_mib} MiB free\\)"):
            runner.prepare(spec)
    else:
        assert runner.prepare(spec).spec.bandwidth_mib == value


def _parse(argv):
    import argparse

    from attnplug.cli.bench_cmd import add_arguments, parse_spec

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parse_spec(parser.parse_args(argv))


def test_the_cpu_count_itself_is_accepted():
    assert _parse(["--threads", str(CPUS), "--bandwidth-mib", str(MAX_BANDWIDTH_MIB)]).threads == CPUS


# -- item 16: resolve exits 2 for a name no plugin registers ---------------------------------------
@pytest.mark.parametrize("flag", ["--attention-backend", "--prefill-attention-backend", "--decode-attention-backend",
                                  "--speculative-draft-attention-backend"])
@pytest.mark.parametrize("name", ["nosuch", "TORCH_NATIVE", "torch-native2"])
def test_resolve_with_an_unknown_backend_name_exits_2(flag, name):
    proc = attnplug("resolve", flag, name)
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-500:], proc.stderr)
    field = flag[2:].replace("-", "_")
    assert f"{field}={name!r} (flag {flag}): unknown attention backend {name!r}" in proc.stdout


def test_resolve_json_with_an_unknown_backend_name_exits_2_and_stays_json():
    proc = attnplug("resolve", "--json", "--attention-backend", "nosuch")
    assert proc.returncode == 2
    data = json.loads(proc.stdout)
    assert data["ok"] is False and "unknown attention backend 'nosuch'" in data["error"]


# -- item 16: read_kv takes a list of ints, or says what it got --------------------------------------
@pytest.fixture
def cache():
    c = PagedKVCache(2, num_pages=4, num_kv_heads=2, head_dim=4, page_size=4)
    for kb, vb in zip(c.k_buffers, c.v_buffers):
        kb.normal_()
        vb.normal_()
    return c


@pytest.mark.parametrize("slots", [[3, 0, 7], (3, 0, 7), range(2, 5), [], [15]])
def test_read_kv_takes_a_list_tuple_or_range_of_slots(cache, slots):
    k, v = cache.read_kv(1, slots)
    want_k, want_v = cache.read_kv(1, torch.tensor(list(slots), dtype=torch.int64))
    assert torch.equal(k, want_k) and torch.equal(v, want_v) and k.shape[0] == len(slots)


@pytest.mark.parametrize("slots,fragment", [
    ([1.5, 2], "read_kv slots: 1.5 (float) is not a slot index (expected ints)"),
    ([True, 1], "read_kv slots: True (bool) is not a slot index"),
    (["3"], "read_kv slots: '3' (str) is not a slot index"),
    ("0,1", "read_kv slots is a str, expected an integer tensor or a list of ints"),
    ({0: 1}, "read_kv slots is a dict, expected"),
    (3, "read_kv slots is a int, expected"),
    ([16], "slots[0]=16 is out of range (expected 0 <= slot < num_slots=16)"),
    ([-1], "slots[0]=-1 is out of range"),
])
def test_read_kv_with_other_values_is_a_shape_error_naming_them(cache, slots, fragment):
    with pytest.raises(ShapeError) as err:
        cache.read_kv(0, slots)
    assert fragment in str(err.value)


def test_check_slots_with_a_list_is_a_shape_error_not_an_attribute_error(cache):
    with pytest.raises(ShapeError, match="out_cache_loc is a list, expected an integer tensor"):
        cache.check_slots([0, 1])


# -- item 16: a batch changed after validation is noticed -----------------------------------------------
H, KV, D, PS = 4, 2, 8, 4
LAYER = LayerSpec(layer_id=0, num_heads=H, num_kv_heads=KV, head_dim=D)


def _backend_and_batch(kind):
    s = small_setup(kind, num_layers=1, lens={2: 6, 0: 3}, heads=H, kv_heads=KV, head_dim=D, page_size=PS)
    loc = torch.cat([s.cache.slots(2, 4, 6), s.cache.slots(0, 1, 3)])
    batch = ForwardBatch.extend([2, 0], [4, 1], [2, 2], loc)
    return s.backend, batch, qkv(s, LAYER, 4)


def _bump(field, replace):
    def change(batch):
        t = getattr(batch, field)
        if replace:
            t = t.clone()
            setattr(batch, field, t)
        t[0] += 1

    return change


CHANGES = {f"{field}-{'replaced' if r else 'in-place'}": (field, _bump(field, r))
           for field in ("extend_prefix_lens", "extend_seq_lens", "seq_lens", "positions", "out_cache_loc",
                         "req_pool_indices")
           for r in (False, True)}


@pytest.mark.parametrize("kind", ["torch_native", "template_sdpa"])
@pytest.mark.parametrize("change", sorted(CHANGES))
def test_a_batch_changed_after_init_forward_metadata_is_refused_naming_the_field(kind, change):
    backend, batch, (q, k, v) = _backend_and_batch(kind)
    field, apply = CHANGES[change]
    backend.init_forward_metadata(batch)
    backend.forward(q, k, v, LAYER, batch)  # fine before the change
    apply(batch)
    with pytest.raises(ShapeError) as err:
        backend.forward(q, k, v, LAYER, batch)
    assert f"ForwardBatch.{field} changed after init_forward_metadata" in str(err.value)


@pytest.mark.parametrize("field,delta,fragment", [
    ("extend_prefix_lens", 1, "request 0: extend_prefix_lens=5 + extend_seq_lens=2 must equal seq_lens=6"),
    ("extend_seq_lens", -1, "request 0: extend_prefix_lens=4 + extend_seq_lens=1 must equal seq_lens=6"),
])
def test_a_batch_changed_between_validation_and_init_forward_metadata_is_validated_again(field, delta, fragment):
    backend, batch, _ = _backend_and_batch("torch_native")
    getattr(batch, field)[0] += delta  # after ForwardBatch.extend validated it
    with pytest.raises(ShapeError, match=fragment.replace("+", r"\+")):
        backend.init_forward_metadata(batch)


def test_revalidating_after_a_change_is_accepted():
    backend, batch, (q, k, v) = _backend_and_batch("torch_native")
    backend.init_forward_metadata(batch)
    batch.positions[0] += 0  # an in-place write of the same value still counts: validate again to go on
    with pytest.raises(ShapeError, match="positions changed"):
        backend.forward(q, k, v, LAYER, batch)
    backend.init_forward_metadata(batch)
    assert backend.forward(q, k, v, LAYER, batch).shape == (4, H, D)


# -- item 16: bench reports a head dim a backend cannot hold as skipped ----------------------------------
def test_bench_reports_a_head_dim_the_kv_layout_cannot_hold_as_skipped(capsys):
    from attnplug.registry import default_registry

    reg = default_registry()
    if "vllm_cpu" not in reg.names() or not reg.availability("vllm_cpu"):
        pytest.skip("vllm_cpu (whose layout holds only the head dims its op is compiled for) is not available")
    rc = main(["bench", "--quick", "--backend", "torch_native,vllm_cpu", "--mode", "decode", "--context", "32",
               "--head-dim", "24", "--json", "-"])
    assert rc == 0
    data = json.loads(capsys.readouterr().out)
    notes = data["problems"][0]["notes"]
    mine = [n for n in notes if n.startswith("vllm_cpu: skipped (")]
    assert len(mine) == 1 and "head_dim=24" in mine[0], notes
    # the only other note is the vllm-raw baseline row's: vLLM's op cannot run this head dim either
    others = [n for n in notes if n not in mine]
    assert all(n.startswith("vllm-raw: skipped (") and "head_dim=24" in n for n in others), notes
    assert not any("failed" in n for n in notes)
