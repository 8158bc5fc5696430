"""The conformance requirement table and its version policy (no suite run here: fast).

Every family the suite runs has one requirement with the level that introduced it; the table,
attnplug's version and CHANGELOG.md agree (``requirements.policy_problems``), and the policy check
catches each way of changing the table without a version bump and a changelog entry.
"""

from __future__ import annotations

import ast
import dataclasses
import re
import tomllib
from pathlib import Path

import pytest

import attnplug
from attnplug.descriptor import BackendDescriptor, descriptor_problems
from attnplug.testing.suite import requirements as R
from attnplug.testing.suite.cases import GENERATORS

ROOT = Path(__file__).resolve().parents[2]
SUITE = Path(R.__file__).resolve().parent
CHANGELOG = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
DOCS = (ROOT / "docs" / "conformance.md").read_text(encoding="utf-8")
FAMILIES = {*GENERATORS, "refusal", "protocol"}


def _suite_families() -> set[str]:
    """Families of the suite's test functions: ``test_<family>(attnplug_case, ...)``; the protocol
    functions take ``attnplug_backend``."""
    out = set()
    for path in SUITE.glob("test_*.py"):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                params = {a.arg for a in node.args.args}
                if "attnplug_case" in params:
                    out.add(node.name[len("test_"):])
                elif "attnplug_backend" in params:
                    out.add("protocol")
    return out


def test_every_family_has_its_requirement_and_nothing_else() -> None:
    assert _suite_families() <= FAMILIES, sorted(_suite_families() - FAMILIES)
    ids = [r.id for r in R.REQUIREMENTS]
    assert len(ids) == len(set(ids))
    assert {r.id for r in R.REQUIREMENTS if r.id == r.family} == FAMILIES
    assert {r.family for r in R.REQUIREMENTS} == FAMILIES
    for r in R.REQUIREMENTS:
        assert R.level_key(r.since) and r.contract and r.how, r
        assert r.anchor == "req-" + re.sub(r"[._]", "-", r.id)


#: the installed level and the next one (a release adding requirements moves to it)
CUR = R.installed_level()
NEXT = f"{R.level_key(CUR)[0]}.{R.level_key(CUR)[1] + 1}"
#: what ``parse_level`` lists as known, as the message prints it
KNOWN = ", ".join(R.known_levels())


def test_a_family_without_a_requirement_is_a_clear_error() -> None:
    with pytest.raises(R.RequirementError, match=r"'synthetic_family' is not in .*REQUIREMENTS.*one line there"):
        R.for_family("synthetic_family")


def test_the_levels_are_the_git_history_of_the_suite() -> None:
    """0.1: the families of the first suite (commit 016b324); 0.2: everything added until the
    suite was versioned; each later level: what its release added (CHANGELOG.md)."""
    first = {"protocol", "metadata_required", "bad_input", "refusal", "mode", "heads", "v_head_dim", "feature",
             "cross_attention", "kv_cache_dtype", "kv_cache_write", "shared_metadata", "sequence", "determinism",
             "cuda_graph"}
    assert {r.id for r in R.REQUIREMENTS if r.since == "0.1"} == first
    assert R.levels()[:2] == ["0.1", "0.2"] and R.levels()[-1] == CUR
    # the variants 016b324's refusal family listed (checked in words only then)
    assert R.REFUSAL_VARIANTS_0_1 == {"sliding_window", "logit_softcap", "sinks", "cross_attention",
                                      "v_head_dim_differs", "mqa", "gqa", "dtype_float64"}


def test_version_policy_holds_for_this_checkout() -> None:
    version = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["version"]
    assert version == attnplug.__version__, "pyproject.toml and attnplug.__version__ disagree"
    assert R.installed_level() == R.level_of(version) == R.levels()[-1]
    assert R.policy_problems(version, CHANGELOG) == []


_NEW = R.Requirement("synthetic_family", CUR, "a requirement made up for these tests", "meet it")


def _bumped_changelog(version: str, ids: list[str], digest: str | None) -> str:
    lines = [f"## {version}", "", "### Conformance", ""] + [f"- `{i}`: new" for i in ids]
    if digest:
        lines += ["", f"requirements digest: `{digest}`"]
    return "# Changelog\n\n" + "\n".join(lines) + "\n\n## " + CHANGELOG.split("\n## ", 1)[1]


@pytest.mark.parametrize("change", ["added_to_released_level", "new_level_without_bump", "bump_without_changelog",
                                    "changelog_without_digest", "changelog_missing_the_id", "removed_from_0_1",
                                    "renamed_in_0_1"])
def test_policy_fails_when_the_table_changes_without_bump_and_changelog(change: str) -> None:
    table = R.REQUIREMENTS
    version, log = attnplug.__version__, CHANGELOG
    new = dataclasses.replace(_NEW, since=NEXT)
    nv, cur, nxt = f"{NEXT}.0", re.escape(CUR), re.escape(NEXT)
    if change == "added_to_released_level":
        table, want = table + (_NEW,), rf"requirements of level {cur} changed: CHANGELOG\.md records digest .*never changes"
    elif change == "new_level_without_bump":
        table, want = table + (new,), (rf"'synthetic_family' is at level {nxt}, newer than attnplug "
                                       rf"{re.escape(version)}: bump")
    elif change == "bump_without_changelog":
        table, version, want = table + (new,), nv, rf"no '## {nxt}\.0' entry"
    elif change == "changelog_without_digest":
        table, version = table + (new,), nv
        log, want = _bumped_changelog(nv, ["synthetic_family"], None), rf"{nxt}\.0' Conformance section lacks"
    elif change == "changelog_missing_the_id":
        table, version = table + (new,), nv
        log = _bumped_changelog(nv, [], R.digest(NEXT, table))
        want = r"does not name requirement `synthetic_family`"
    elif change == "removed_from_0_1":
        table, want = tuple(r for r in table if r.id != "sequence"), r"requirements of level 0\.1 changed"
    else:
        table = tuple(dataclasses.replace(r, id="mode2") if r.id == "mode" else r for r in table)
        want = r"requirements of level 0\.1 changed"
    problems = R.policy_problems(version, log, table)
    assert any(re.search(want, p) for p in problems), problems


def test_policy_passes_a_proper_bump() -> None:
    """The procedure docs/conformance.md gives: a new level, the version bumped to it, a changelog entry."""
    table = R.REQUIREMENTS + (dataclasses.replace(_NEW, since=NEXT),)
    log = _bumped_changelog(f"{NEXT}.0", ["synthetic_family"], R.digest(NEXT, table))
    assert R.policy_problems(f"{NEXT}.0", log, table) == []
    patch = f"# Changelog\n\n## {NEXT}.1\n\n- a fix\n\n" + log.split("\n", 2)[2]
    assert R.policy_problems(f"{NEXT}.1", patch, table) == []


def test_rewording_a_requirement_is_not_a_new_requirement() -> None:
    table = tuple(dataclasses.replace(r, how=r.how + " (reworded)") for r in R.REQUIREMENTS)
    assert R.policy_problems(attnplug.__version__, CHANGELOG, table) == []


_V = re.escape(attnplug.__version__)


@pytest.mark.parametrize(("value", "error"), [
    ("0.9", rf"unknown conformance level '0\.9': attnplug {_V} knows {re.escape(KNOWN)}; 0\.9 is newer than the "
            rf"installed attnplug {_V}: upgrade attnplug"),
    ("latest", r"unknown conformance level 'latest'.*a level is MAJOR\.MINOR"),
    ("0.2.0", r"unknown conformance level '0\.2\.0'.*MAJOR\.MINOR"),
    ("0.0", rf"unknown conformance level '0\.0': attnplug {_V} knows {re.escape(KNOWN)}$"),
    ("", r"unknown conformance level ''"),
])
def test_bad_level_values_say_what_is_accepted(value: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        R.parse_level(value)


def test_levels_parse_and_versions_map_to_levels() -> None:
    assert [R.parse_level(x) for x in ("0.1", " 0.2")] == ["0.1", "0.2"]
    assert R.level_of("0.2.0") == "0.2" and R.level_of("1.10.3rc1") == "1.10"
    assert R.level_key("0.10") > R.level_key("0.9")


def test_docs_have_the_table_by_version_with_every_anchor() -> None:
    assert '<a id="conformance-levels"></a>' in DOCS
    for lv in R.levels():
        assert f'<a id="{R.level_anchor(lv)}"></a>' in DOCS, lv
    for r in R.REQUIREMENTS:
        row = next((line for line in DOCS.splitlines() if f'<a id="{r.anchor}"></a>' in line), None)
        assert row is not None, f"docs/conformance.md has no row for requirement {r.id}"
        assert f"`{r.id}`" in row and f"| {r.since} |" in row, row


def test_guidance_names_contract_how_and_anchor() -> None:
    text = R.requirement("rejected").guidance()
    assert text.splitlines()[0].startswith("requirement 'rejected' (conformance level 0.2): an out-of-range")
    assert "how to meet it: subclass PagedBackend" in text and "check_batch" in text
    assert text.endswith("see docs/conformance.md#req-rejected")


@pytest.mark.parametrize("value", ["v1", "0.1.0", 0.1, ""])
def test_descriptor_conformance_level_is_type_checked(value: object) -> None:
    d = BackendDescriptor(name="x", factory="m:f", conformance_level=value)  # type: ignore[arg-type]
    assert any("field 'conformance_level': expected a 'MAJOR.MINOR' str" in p for p in descriptor_problems(d))
    assert descriptor_problems(BackendDescriptor(name="x", factory="m:f", conformance_level="0.1")) == []


def test_the_plugin_refuses_to_run_a_family_without_its_requirement(monkeypatch: pytest.MonkeyPatch) -> None:
    """A family merged without its line in REQUIREMENTS is a usage error naming it, before any case runs."""
    from attnplug.testing import pytest_plugin
    from attnplug.testing.suite import cases

    assert pytest_plugin._level(None) == CUR and pytest_plugin._level("0.1") == "0.1"
    monkeypatch.setitem(cases.GENERATORS, "synthetic_family", list)
    with pytest.raises(pytest.UsageError, match=r"conformance family 'synthetic_family': conformance requirement "
                                                r"'synthetic_family' is not in .*REQUIREMENTS"):
        pytest_plugin._level(None)
