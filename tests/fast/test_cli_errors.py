"""Every subcommand with every class of bad argument: one clear line on stderr, a non-zero
exit (2 for a bad argument, flag value, variable or file), never a traceback (issue 9:
classes 13, 15, 17 and "Also"). Each case runs ``attnplug`` in a fresh interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from attnplug import AttentionConfig
from attnplug.errors import ConfigError, HostInfoError
from attnplug.host import HostInfo


def attnplug(*args, env=None, timeout=180):
    full = {k: v for k, v in os.environ.items() if not k.startswith("ATTNPLUG_")}
    full.update(env or {})
    return subprocess.run([sys.executable, "-m", "attnplug", *args], capture_output=True, text=True, env=full,
                          timeout=timeout)


def one_line_error(proc, status, *fragments):
    assert proc.returncode == status, (proc.returncode, proc.stdout[-500:], proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines, "no error message"
    last = lines[-1]
    for fragment in fragments:
        assert fragment in last, (fragment, last)
    return last


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("hosts")
    out = {}
    for name, text in {
        "bad_json": "{platform: cpu",
        "empty": "",
        "cc_one": json.dumps({"platform": "cuda", "compute_capability": [9]}),
        "libs_list": json.dumps({"libraries": ["flashinfer-python"]}),
        "flags_str": json.dumps({"cpu_flags": "amx_bf16 amx_tile"}),
        "count_str": json.dumps({"device_count": "many"}),
        "not_object": json.dumps(["cpu"]),
        "unknown": json.dumps({"gpus": 2}),
    }.items():
        (d / f"{name}.json").write_text(text)
        out[name] = str(d / f"{name}.json")
    out["missing"] = str(d / "no_such.json")
    out["directory"] = str(d)
    return out


HOST_CASES = [
    ("bad_json", "not valid JSON"),
    ("empty", "the file is empty"),
    ("missing", "no such file"),
    ("directory", "is a directory"),
    ("cc_one", "field 'compute_capability': expected [major, minor] (two ints) or null, got list [9]"),
    ("libs_list", "field 'libraries': expected an object {distribution: version}, got list"),
    ("flags_str", "field 'cpu_flags': expected a list of str flags, got str 'amx_bf16 amx_tile'"),
    ("count_str", "field 'device_count': expected a non-negative int, got str 'many'"),
    ("not_object", "expected a JSON object of HostInfo fields, got list"),
    ("unknown", "unknown field(s) ['gpus']"),
]


@pytest.mark.parametrize("case,fragment", HOST_CASES)
def test_host_json_flag_is_validated_field_by_field(files, case, fragment):
    path = files[case]
    proc = attnplug("resolve", "--host-json", path)
    one_line_error(proc, 2, f"--host-json={path!r}", fragment)


@pytest.mark.parametrize("case,fragment", HOST_CASES)
def test_host_json_variable_is_validated_for_every_command(files, case, fragment):
    path = files[case]
    for command in (["list", "--json"], ["resolve"]):
        proc = attnplug(*command, env={"ATTNPLUG_HOST_JSON": path})
        one_line_error(proc, 2, f"ATTNPLUG_HOST_JSON={path!r}", fragment)
        assert proc.stdout == ""


def test_cpu_flags_as_a_string_is_not_split_into_characters():
    with pytest.raises(HostInfoError, match="field 'cpu_flags'"):
        HostInfo(cpu_flags="amx_bf16")
    with pytest.raises(HostInfoError, match="field 'libraries'"):
        HostInfo.from_dict({"libraries": [["torch", "2.0"]]}, source="x")
    assert HostInfo(cpu_flags=["AMX_BF16", "amx_tile"]).has_amx  # a list still works


@pytest.mark.parametrize("field,value", [
    ("deterministic", "yes"), ("deterministic", 1), ("deterministic", "false"), ("cuda_graph", "no"),
    ("dtype", "int8"), ("dtype", 16), ("kv_cache_dtype", "int4"), ("page_size", True), ("page_size", "16"),
    ("extra", ["diffusion_lm"]),
])
def test_config_values_of_the_wrong_type_are_rejected_not_truthy(field, value):
    with pytest.raises(ConfigError, match=field):
        AttentionConfig(**{field: value})


# -- every subcommand x every class of bad argument -------------------------------------------
BAD = [
    # (args, env, exit status, fragment of the one line)
    (["list", "--bogus"], {}, 2, "unrecognized arguments: --bogus"),
    (["list"], {"ATTNPLUG_PLUGINS": " , "}, 2, "ATTNPLUG_PLUGINS=' , ' names no plugin"),
    (["doctor", "--backend", "no_such_backend"], {}, 2, "unknown attention backend 'no_such_backend'"),
    (["doctor", "--json"], {"ATTNPLUG_DISABLE_PLUGINS": ","}, 2, "ATTNPLUG_DISABLE_PLUGINS=',' names no plugin"),
    (["resolve", "--dtype", "int8"], {}, 2, "dtype='int8': unknown dtype 'int8'"),
    (["resolve", "--page-size", "0"], {}, 2, "page_size=0 (expected a positive integer)"),
    (["resolve", "--page-size", "many"], {}, 2, "invalid int value: 'many'"),
    (["resolve", "--extra", "novalue"], {}, 2, "--extra 'novalue': expected KEY=VALUE"),
    (["resolve", "--speculative-attention-mode", "sideways"], {}, 2, "invalid choice: 'sideways'"),
    (["bench", "--backend", "no_such_backend"], {}, 2, "unknown attention backend 'no_such_backend'"),
    (["bench", "--batch", "0"], {}, 2, "--batch"),
    (["bench", "--dtype", "int8"], {}, 2, "int8"),
    (["bench", "--device", "no_such_device"], {}, None, "no_such_device"),
    (["lint", ""], {}, 2, "an empty path was given"),
    (["lint", "/dev/null"], {}, 2, "/dev/null: a character device, not a Python source file"),
    (["lint", "no_such_dir/x.py"], {}, 2, "no_such_dir/x.py: no such file or directory"),
    (["lint", "--allow", "file.py:zero", "."], {}, 2, "LINE must be a positive integer"),
]


@pytest.mark.parametrize("args,env,status,fragment", BAD, ids=[" ".join(b[0]) + str(sorted(b[1])) for b in BAD])
def test_each_subcommand_turns_bad_arguments_into_one_line(args, env, status, fragment):
    proc = attnplug(*args, env=env)
    if status is None:  # no fixed status (torch decides what kind of error a device is): non-zero
        assert proc.returncode != 0
        status = proc.returncode
    one_line_error(proc, status, fragment)


def test_a_resolution_error_names_the_draft_field():
    proc = attnplug("resolve", "--speculative-draft-attention-backend", "no_such_backend")
    assert proc.returncode == 2  # a bad flag value (issue 26: it was 1)
    assert ("speculative_draft_attention_backend='no_such_backend' (flag --speculative-draft-attention-backend): "
            "unknown attention backend 'no_such_backend'") in proc.stdout


def test_a_closed_pipe_is_quiet():
    """``attnplug doctor --json | head``: the reader goes away; no traceback, no 'Exception ignored'."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATTNPLUG_")}
    proc = subprocess.Popen([sys.executable, "-m", "attnplug", "doctor", "--json", "--backend", "torch_native"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    proc.stdout.close()  # before doctor writes anything
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=180) == 141, err
    assert err == ""


# -- lint on anything (class 17) ----------------------------------------------------------------
@pytest.fixture
def odd_tree(tmp_path):
    root = tmp_path / "src"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "ok.py").write_text("x = cfg.attention_backends()\n")
    os.mkfifo(root / "pkg" / "pipe.py")
    os.symlink("loop.py", root / "pkg" / "loop.py")
    return root


def test_lint_walks_past_a_fifo_and_a_symlink_loop_with_notes(odd_tree):
    proc = attnplug("lint", str(odd_tree), timeout=60)  # before: blocked forever on the FIFO
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert f"note: skipped {odd_tree / 'pkg' / 'pipe.py'}: a FIFO, not a Python source file" in proc.stderr
    assert (f"note: skipped {odd_tree / 'pkg' / 'loop.py'}: symlink loop (too many levels of symbolic links)"
            in proc.stderr)
    assert "1 file(s) checked" in proc.stderr


@pytest.mark.parametrize("name,fragment", [("pipe.py", "a FIFO, not a Python source file"),
                                           ("loop.py", "symlink loop (too many levels of symbolic links)")])
def test_lint_given_a_fifo_or_a_symlink_loop_directly_is_an_error(odd_tree, name, fragment):
    path = odd_tree / "pkg" / name
    one_line_error(attnplug("lint", str(path), timeout=60), 2, f"{path}: {fragment}")


def test_lint_cost_is_linear_in_findings(tmp_path, monkeypatch):
    """The guard splits and encodes the source once, however many findings: a one-line file
    with 3,000 reads encodes that line once (before: the source was re-split per finding)."""
    import attnplug.guard as guard
    from attnplug.guard import analysis

    encoded = []
    splits = []
    real_raw, real_split = analysis._Lines.raw, analysis._split_lines

    def raw(self, lineno):
        if lineno not in self._bytes:
            encoded.append(lineno)
        return real_raw(self, lineno)

    def split(source):
        splits.append(len(source))
        return real_split(source)

    monkeypatch.setattr(analysis._Lines, "raw", raw)
    monkeypatch.setattr(analysis, "_split_lines", split)
    path = tmp_path / "one_line.py"
    path.write_text("x = [" + ", ".join(f"c{i}.attention_backend" for i in range(3000)) + "]\n")
    report = guard.check([path])
    assert len(report.findings) == 3000
    assert len(splits) == 1 and encoded == [1]


def test_lint_allow_marker_inside_a_string_is_not_a_comment(tmp_path):
    import attnplug.guard as guard

    path = tmp_path / "m.py"
    path.write_text('a = cfg.attention_backend  # attnplug: allow-base-field\n'
                    'b = "# attnplug: allow-base-field" + cfg.attention_backend\n'
                    'c = f"{x}#" + cfg.attention_backend  # attnplug: allow-base-field\n'
                    'd = """\n# attnplug: allow-base-field""" + cfg.attention_backend\n')
    report = guard.check([path])
    assert [f.line for f in report.allowed] == [1, 3]
    assert [f.line for f in report.findings] == [2, 5]  # the read on the string's closing line


def test_benchmark_script_runs(tmp_path):
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve().parents[2] / "benchmarks" / "bench_lint.py"),
                           "--mb", "0.2", "--repeats", "1"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "guard/parse" in proc.stdout and len(proc.stdout.splitlines()) == 4
