"""The static guard (``attnplug.guard`` and ``attnplug lint``): every spelling of a read, no false positives."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from attnplug import guard
from attnplug.cli.main import main
from attnplug.guard import (
    ALLOW_COMMENT,
    Finding,
    GuardError,
    assert_no_base_field_reads,
    check,
    find_base_field_reads,
)

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "guard"

#: fixture -> the exact lines the guard must report (one entry per read).
EXPECTED_LINES: dict[str, list[int]] = {
    "chains.py": [6, 7, 8, 9, 10, 12, 13, 14, 15],
    "aliases.py": [6, 11, 16, 21, 22, 27, 32, 34, 38],
    "getattr_forms.py": [15, 16, 17, 18, 19, 21, 22, 23, 24, 26, 28, 29, 31, 32],
    "mapping_forms.py": [5, 6, 7, 8, 9, 10, 11],
    "attrgetter_forms.py": [6, 7, 8, 9],
    "match_forms.py": [6, 8],
    "allow_comments.py": [7, 8],
    "clean.py": [],
    "config_like.py": [],
}


def lines_of(name: str, **kwargs) -> list[int]:
    return [f.line for f in find_base_field_reads({FIXTURES / name: "r"}, **kwargs)]


def test_every_fixture_is_listed():
    assert sorted(p.name for p in FIXTURES.glob("*.py")) == sorted(EXPECTED_LINES)


@pytest.mark.parametrize("name", sorted(EXPECTED_LINES))
def test_fixture_reports_exact_lines(name):
    assert lines_of(name) == EXPECTED_LINES[name]


def test_alias_reads_are_found_whatever_the_base_is_called():
    """A checker matching only ``*.kernel.attention_backend`` would fail here."""
    found = {(f.line, f.expr) for f in find_base_field_reads(FIXTURES / "aliases.py")}
    assert (6, "k.attention_backend") in found  # k = cfg.kernel
    assert (11, "a.attention_backend") in found  # a = args
    assert (16, "x.attention_backend") in found  # x = some_call()
    assert (27, "k.attention_backend") in found  # k, other = cfg.kernel, 1
    assert (38, "server_args.attention_backend") in found  # a parameter


def test_alias_case_in_source_written_here(tmp_path):
    src = tmp_path / "runner.py"
    src.write_text("k = cfg.kernel\nk.attention_backend\nx = some_call()\nx.attention_backend\n")
    assert [f.line for f in find_base_field_reads(src)] == [2, 4]


def test_mutation_kernel_only_predicate_is_caught(monkeypatch):
    """If the attribute predicate regressed to ``kernel.attention_backend`` chains, the suite must notice."""

    def kernel_only(node: ast.Attribute, attr: str) -> bool:
        return node.attr == attr and isinstance(node.value, ast.Attribute) and node.value.attr == "kernel"

    monkeypatch.setattr(guard.analysis, "_attribute_matches", kernel_only)
    mutated = {name: lines_of(name) for name in ("chains.py", "aliases.py")}
    assert mutated["chains.py"] == [7]  # only cfg.kernel.attention_backend survives
    assert mutated["aliases.py"] == []
    assert mutated["chains.py"] != EXPECTED_LINES["chains.py"]
    assert mutated["aliases.py"] != EXPECTED_LINES["aliases.py"]


def test_finding_fields_expression_and_reason():
    findings = find_base_field_reads({FIXTURES / "chains.py": "picks the prefill kernel"})
    first = findings[0]
    assert first == Finding(
        str(FIXTURES / "chains.py"), 6, 13, "self.server_args.attention_backend", "picks the prefill kernel", "attribute"
    )
    assert first.format() == (
        f"{FIXTURES / 'chains.py'}:6:13: self.server_args.attention_backend \u2014 picks the prefill kernel"
    )
    assert findings[4].expr == "cfg.attention_backend"  # a multi-line read is shown on one line
    suppressed = check(FIXTURES / "allow_comments.py").allowed
    assert suppressed[-1].expr == 'getattr(cfg, "attention_backend",)'
    kinds = {f.line: f.kind for f in find_base_field_reads(FIXTURES / "getattr_forms.py")}
    assert kinds[15] == "getattr" and kinds[18] == "hasattr"


def test_false_positives_are_absent():
    assert find_base_field_reads([FIXTURES / "clean.py", FIXTURES / "config_like.py"]) == []


def test_other_attr_name(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("a = cfg.attention_backend\nb = cfg.kv_backend\nc = getattr(cfg, 'kv_backend')\n")
    assert [f.line for f in find_base_field_reads(src, attr="kv_backend")] == [2, 3]
    with pytest.raises(GuardError, match="attr="):
        find_base_field_reads(src, attr="not a name")


def test_constant_folding_is_bounded_and_still_finds_the_field(tmp_path):
    src = tmp_path / "fold.py"
    body = "".join(f"s{i} = s{i - 1} + s{i - 1} + 'x'\n" for i in range(1, 40))
    src.write_text(
        "s0 = 'ab'\n" + body
        + "s = s + s\n"  # never settles
        + "p = 'attention_'\np = p + 'backend'\n"
        + "getattr(cfg, s39)\ngetattr(cfg, p)\n"
    )
    start = time.perf_counter()
    assert [f.expr for f in find_base_field_reads(src)] == ["getattr(cfg, p)"]
    assert time.perf_counter() - start < 1.0


def test_directory_walk_and_specific_reason_wins(tmp_path):
    pkg = tmp_path / "engine"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__pycache__").mkdir()
    (pkg / "a.py").write_text("x = cfg.attention_backend\n")
    (pkg / "sub" / "b.py").write_text("y = cfg.attention_backend\n")
    (pkg / "notes.txt").write_text("cfg.attention_backend\n")
    (pkg / "__pycache__" / "c.py").write_text("z = cfg.attention_backend\n")
    (pkg / "config.py").write_text("z = self.attention_backend\n")
    findings = find_base_field_reads(
        {pkg: "engine decision", pkg / "sub" / "b.py": "the sub decision"}, exclude=[pkg / "config.py"]
    )
    assert [(Path(f.path).name, f.reason) for f in findings] == [("a.py", "engine decision"), ("b.py", "the sub decision")]


def test_missing_path_and_syntax_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.py"):
        find_base_field_reads(tmp_path / "nope.py")
    bad = tmp_path / "broken.py"
    bad.write_text("def f(:\n    return cfg.attention_backend\n")
    with pytest.raises(GuardError, match=r"broken\.py:1:\d+: cannot check this file: syntax error") as info:
        find_base_field_reads(bad)
    assert info.value.problems[0].path == str(bad)


def test_allow_entries(tmp_path):
    path = FIXTURES / "allow_comments.py"
    assert lines_of("allow_comments.py", allow=[f"{path}:7"]) == [8]
    # FILE matches as a path suffix, so an entry is independent of the working directory.
    assert lines_of("allow_comments.py", allow=["guard/allow_comments.py:8", ("allow_comments.py", 7)]) == []
    assert lines_of("allow_comments.py", allow=["other.py:7"]) == [7, 8]
    report = check(path, allow=["allow_comments.py:7", "allow_comments.py:99"])
    assert [str(a) for a in report.unused_allow] == ["allow_comments.py:99"]
    assert sorted(f.line for f in report.allowed) == [5, 6, 7, 9]
    for bad in ("allow_comments.py", "allow_comments.py:x", ":3", "a.py:0"):
        with pytest.raises(GuardError, match="allow entry"):
            check(path, allow=[bad])


def test_helper_fails_with_offender_list():
    with pytest.raises(pytest.fail.Exception) as info:
        assert_no_base_field_reads({FIXTURES / "aliases.py": "chooses the decode kernel"})
    message = str(info.value)
    assert f"{FIXTURES / 'aliases.py'}:6:12: k.attention_backend \u2014 chooses the decode kernel" in message
    assert "9 read(s) of the base field 'attention_backend'" in message
    assert ALLOW_COMMENT in message


def test_helper_raises_assertion_error_without_pytest(monkeypatch):
    monkeypatch.delitem(sys.modules, "pytest")
    with pytest.raises(AssertionError, match=r"getattr_forms\.py:15:9: getattr\(x, \"attention_backend\"\)"):
        assert_no_base_field_reads({FIXTURES / "getattr_forms.py": "r"})


def test_helper_passes_when_clean_and_ratchets_allow_list(tmp_path):
    assert_no_base_field_reads({FIXTURES / "clean.py": "r", FIXTURES / "config_like.py": "r"})
    assert_no_base_field_reads(FIXTURES / "allow_comments.py", allow=["allow_comments.py:7", "allow_comments.py:8"])
    with pytest.raises(pytest.fail.Exception, match="allow_comments.py:99"):
        assert_no_base_field_reads(
            FIXTURES / "allow_comments.py",
            allow=["allow_comments.py:7", "allow_comments.py:8", "allow_comments.py:99"],
            strict_allow=True,
        )
    bad = tmp_path / "broken.py"
    bad.write_text("x = (\n")
    with pytest.raises(pytest.fail.Exception, match="broken.py.*cannot check this file"):
        assert_no_base_field_reads(bad)


@pytest.mark.parametrize("module", ["guard/__init__.py", "guard/analysis.py", "guard/files.py", "errors.py"])
def test_guard_imports_only_the_standard_library(module):
    """The guard's modules (and the one core module they use, errors.py) import nothing outside the stdlib;
    the analysis imports nothing of attnplug at all, the files module only errors and the analysis."""
    tree = ast.parse((REPO / "core" / "attnplug" / module).read_text())
    imported = {alias.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for alias in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 0}
    assert imported <= set(sys.stdlib_module_names) | {"__future__"}
    relative = {(n.level, n.module) for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level > 0}
    allowed = {"guard/__init__.py": {(1, "analysis"), (1, "files")}, "guard/analysis.py": set(),
               "guard/files.py": {(2, "errors"), (1, "analysis")}, "errors.py": set()}[module]
    assert relative <= allowed


def test_docs_name_the_allow_comment_and_flags():
    text = (REPO / "docs" / "guard.md").read_text(encoding="utf-8")
    for needle in (ALLOW_COMMENT, "--allow FILE:LINE", "assert_no_base_field_reads", "hasattr", "--json"):
        assert needle in text


# --------------------------------------------------------------------------- CLI


def test_cli_findings_exit_1(capsys):
    rc = main(["lint", str(FIXTURES / "aliases.py"), "--reason", "decode choice"])
    out = capsys.readouterr().out.splitlines()
    assert rc == 1
    assert out[0] == f"{FIXTURES / 'aliases.py'}:6:12: k.attention_backend \u2014 decode choice"
    assert len(out) == 9


def test_cli_clean_exit_0(capsys):
    assert main(["lint", str(FIXTURES / "clean.py"), str(FIXTURES / "config_like.py")]) == 0
    assert capsys.readouterr().out == ""


def test_cli_json(capsys):
    rc = main(["lint", str(FIXTURES / "match_forms.py"), "--json"])
    data = json.loads(capsys.readouterr().out)
    assert rc == 1
    assert [(d["line"], d["col"], d["expr"], d["kind"]) for d in data] == [
        (6, 14, 'Config(attention_backend="triton")', "match"),
        (8, 14, '{"attention_backend": name}', "match"),
    ]
    assert set(data[0]) == {"path", "line", "col", "expr", "reason", "kind"}
    assert main(["lint", str(FIXTURES / "clean.py"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == []


def test_cli_allow_attr_exclude_and_strict(capsys):
    path = str(FIXTURES / "allow_comments.py")
    assert main(["lint", path, "--allow", f"{path}:7", "--allow", "allow_comments.py:8"]) == 0
    assert main(["lint", path, "--allow", f"{path}:7", "--allow", f"{path}:8", "--allow", f"{path}:50"]) == 0
    assert "matches no read" in capsys.readouterr().err
    assert main(["lint", path, "--allow", f"{path}:7", "--allow", f"{path}:8", "--allow", f"{path}:50",
                 "--strict-allow"]) == 1
    assert main(["lint", path, "--attr", "prefill_attention_backend"]) == 0
    assert main(["lint", str(FIXTURES), "--exclude", str(FIXTURES)]) == 0


def test_cli_usage_errors_exit_2(capsys, tmp_path):
    assert main(["lint", str(tmp_path / "missing.py")]) == 2
    assert "missing.py" in capsys.readouterr().err
    assert main(["lint", str(FIXTURES / "clean.py"), "--allow", "clean.py"]) == 2
    assert main(["lint", str(FIXTURES / "clean.py"), "--attr", "a-b"]) == 2
    with pytest.raises(SystemExit) as info:
        main(["lint"])
    assert info.value.code == 2


def test_cli_syntax_error_names_file_no_traceback(capsys, tmp_path):
    bad = tmp_path / "broken.py"
    bad.write_text("x = cfg.attention_backend\nif True\n")
    good = tmp_path / "good.py"
    good.write_text("y = cfg.attention_backend\n")
    assert main(["lint", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert f"{bad}:2:" in captured.err and "syntax error" in captured.err
    assert "Traceback" not in captured.err
    assert f"{good}:1:5: cfg.attention_backend" in captured.out  # the other files are still checked


def test_cli_subprocess_module_entry(tmp_path):
    src = tmp_path / "runner.py"
    src.write_text("def pick(cfg):\n    k = cfg.kernel\n    return getattr(k, 'attention_backend')\n")
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    proc = subprocess.run(
        [sys.executable, "-m", "attnplug", "lint", str(src), "--json"],
        capture_output=True, text=True, timeout=60, env=env,
    )
    assert proc.returncode == 1, proc.stderr
    data = json.loads(proc.stdout)
    assert [(d["path"], d["line"], d["expr"]) for d in data] == [(str(src), 3, "getattr(k, 'attention_backend')")]
