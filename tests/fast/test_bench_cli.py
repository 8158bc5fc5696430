"""``attnplug bench`` user errors: one line on stderr, exit 2, nothing measured, never a traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from attnplug.cli.main import main


def _unavailable_device() -> str | None:
    for kind in ("cuda", "xpu", "mps"):
        mod = getattr(torch, kind, None)
        if mod is None or not mod.is_available():
            return kind
    return None


BAD = [
    (["--batch", "0"], "--batch '0': 0 is below 1"),
    (["--batch", "x"], "--batch 'x': 'x' is not an integer"),
    (["--batch", "1,,8"], "--batch '1,,8': '' is not an integer"),
    (["--context", "-5"], "--context '-5': -5 is below 1"),
    (["--head-dim", "0"], "--head-dim '0'"),
    (["--page-size", "abc"], "--page-size 'abc'"),
    (["--kv-heads", "3"], "--kv-heads 3 does not divide --heads 32"),
    (["--heads", "8,16"], "--heads '8,16': give one number"),
    (["--repeats", "0"], "--repeats '0'"),
    (["--warmup", "-1"], "--warmup '-1'"),
    (["--threads", "0"], "--threads '0'"),
    (["--max-kv-gib", "lots"], "--max-kv-gib 'lots' is not a number"),
    (["--dtype", "int8"], "--dtype 'int8' is not a benchmarkable dtype"),
    (["--dtype", "nosuch"], "--dtype 'nosuch'"),
    (["--kv-cache-dtype", "int8"], "--kv-cache-dtype 'int8' is not a KV-cache dtype bench runs"),
    (["--mode", "prefill"], "--mode 'prefill' is not one of decode, extend, verify, mixed"),
    (["--backend", "nosuch"], "--backend 'nosuch': unknown attention backend 'nosuch'"),
    (["--backend", "fa3"], "--backend 'fa3': fa3 is not available here"),
    (["--backend", "torch_native,"], "--backend 'torch_native,': empty item"),
    (["--backend", "all,torch_native"], "'all' cannot be combined"),
    (["--device", "nonsense"], "--device 'nonsense' is not a torch device"),
    (["--json", "/nonexistent-dir/out.json"], "--json '/nonexistent-dir/out.json': cannot write there"),
    (["--clock", "cpu"], "--clock cpu needs --threads 1 (got None)"),
    (["--clock", "cpu", "--threads", "2"], "--clock cpu needs --threads 1 (got '2')"),
    (["--clock", "cpu", "--threads", "1", "--device", "meta"], "--clock cpu: times CPU work only, but --device is"),
    (["--mla", "--overhead"], "--mla and --overhead are two different tables; give one"),
    (["--mla", "--mode", "extend"], "--mode does not apply to --mla"),
    (["--mla", "--head-dim", "128"], "--head-dim does not apply to --mla"),
    (["--mla", "--kv-heads", "2"], "--kv-heads does not apply to --mla"),
    (["--mla", "--kv-cache-dtype", "fp8_e4m3"], "--kv-cache-dtype does not apply to --mla"),
    (["--mla", "--batch", "0"], "--batch '0': 0 is below 1"),
]


@pytest.mark.parametrize("argv,expected", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_argument_is_one_line_and_exit_2(argv, expected, capsys):
    rc = main(["bench", *argv])
    out, err = capsys.readouterr()
    assert rc == 2
    assert out == ""  # nothing was measured or printed as a result
    assert err.count("\n") == 1 and err.startswith("attnplug bench: error: "), err
    assert expected in err


def test_a_device_this_torch_lacks_is_a_user_error(capsys):
    kind = _unavailable_device()
    if kind is None:
        pytest.skip("every device kind tried is available here")
    assert main(["bench", "--device", kind]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert f"--device '{kind}': this torch ({torch.__version__}) has no usable {kind} device" in err


def test_backend_that_does_not_claim_the_device_is_refused(capsys, monkeypatch):
    """template_sdpa claims only the CPU; asked for on a CUDA device (CUDA mocked as present, since
    this machine has none) it is refused before anything runs."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert main(["bench", "--backend", "template_sdpa", "--device", "cuda"]) == 2
    _, err = capsys.readouterr()
    assert "--backend 'template_sdpa': template_sdpa does not run on cuda (claims: cpu)" in err


def test_plot_without_matplotlib_says_how_to_get_it(capsys, monkeypatch, tmp_path):
    """matplotlib is made unimportable (None in sys.modules) to stand for an install without the extra."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["bench", "--plot", str(tmp_path / "p.png")]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == "attnplug bench: error: --plot needs matplotlib, which is not installed: " \
                  "pip install 'attnplug[plot]'\n"
    assert not (tmp_path / "p.png").exists()


@pytest.mark.parametrize("argv", [["--batch", "x"], ["--backend", "nosuch"]])
def test_user_error_in_a_fresh_process_has_no_traceback(argv):
    proc = subprocess.run([sys.executable, "-m", "attnplug", "bench", *argv], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert "Traceback" not in proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("attnplug bench: error: ")


def _spec(*argv: str):
    from attnplug.cli.bench_cmd import parse_spec
    from attnplug.cli.main import build_parser

    return parse_spec(build_parser("bench").parse_args(["bench", *argv]))


def test_lists_make_the_sweep_and_quick_fills_only_what_was_not_given():
    s = _spec("--batch", "1,8,8", "--context", "128,1024", "--dtype", "fp32,bf16", "--mode", "all")
    assert s.batches == (1, 8) and s.contexts == (128, 1024) and s.dtypes == ("float32", "bfloat16")
    assert s.modes == ("decode", "extend", "verify", "mixed")
    assert len(list(s.problems())) == 4 * 2 * 2 * 2
    q = _spec("--quick", "--context", "64", "--mode", "decode")
    assert q.contexts == (64,) and q.modes == ("decode",)  # given explicitly: kept
    assert q.batches == (2,) and q.repeats == 3 and q.threads == 1 and q.head_dims == (32,)  # quick's
    d = _spec()
    assert d.batches is None and [p.batch for p in d.problems()] == [32]  # decode's default batch
    assert [p.batch for p in _spec("--mode", "extend").problems()] == [4]


def test_a_reader_that_leaves_early_is_not_a_traceback():
    """`attnplug bench --json - | head`: stdout is closed before the results are written."""
    cmd = [sys.executable, "-m", "attnplug", "bench", "--batch", "2", "--context", "16", "--heads", "4",
           "--kv-heads", "2", "--head-dim", "16", "--repeats", "1", "--warmup", "0", "--bandwidth-mib", "8",
           "--threads", "1", "--json", "-"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 0
    assert "Traceback" not in err and "BrokenPipe" not in err, err


def test_overhead_defaults_to_the_issue_rows_and_given_shapes_replace_them():
    o = _spec("--overhead")
    assert o.overhead and [(p.batch, p.context) for p in o.problems()] == [(1, 128), (4, 256), (32, 1024)]
    assert o.repeats == 200 and o.page_sizes == (32,)
    g = _spec("--overhead", "--batch", "2,3", "--context", "64", "--repeats", "7", "--page-size", "16")
    assert [(p.batch, p.context) for p in g.problems()] == [(2, 64), (3, 64)]
    assert g.repeats == 7 and g.page_sizes == (16,)
    assert not _spec().overhead and _spec().pairs is None
