"""The ``attnplug`` pytest plugin: ``pytest --backend=<name>`` runs the conformance suite.

Registered through the core's ``pytest11`` entry point, so it autoloads in
every pytest run of an environment where ``attnplug`` is installed. It must
stay cheap and harmless there: importing this module and adding the options
imports neither torch nor the registry; nothing happens at all unless
``--backend`` is given (disable it entirely with ``-p no:attnplug``).

How collection works: when ``--backend`` is given, ``pytest_configure``
resolves every name through the real registry (``default_registry()``:
entry points, aliases to canonical names, availability on this host) and
adds the suite's test modules (files of the ``attnplug.testing.suite``
package, wherever it is installed) to the paths pytest collects. Without
explicit paths the suite replaces ``testpaths`` (ini ``attnplug_suite_only
= false`` appends it instead); with explicit paths it is appended to them.
The modules are collected as ordinary pytest modules; ``pytest_generate_tests``
below parametrizes their functions with the cases generated from each
backend's declared capabilities.

Conformance levels (``suite/requirements.py``): every case belongs to a
requirement with the attnplug level that introduced it. ``--conformance-level``
(default: the installed attnplug's level) decides which failures fail the run;
a failure of a newer requirement is reported as "would fail at level X" (an
xfail in pytest's counts, listed with its guidance in the summary), never
skipped. Every failure message ends with its requirement's contract, how to
meet it and the ``docs/conformance.md`` anchor.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import pytest

SUITE_DIR = Path(__file__).resolve().parent / "suite"
SUITE_MODULES: tuple[str, ...] = ("test_protocol.py", "test_numeric.py", "test_cache.py", "test_determinism.py",
                                  "test_robustness.py", "test_random.py", "test_mla.py")
ALL = "all"


@dataclasses.dataclass
class SelectedBackend:
    name: str
    distribution: str
    version: str
    capabilities: Any
    requested_as: str
    #: the level its publisher declares it was checked at (``BackendDescriptor.conformance_level``)
    declared_level: str | None = None


@dataclasses.dataclass
class CaseInfo:
    backend: str
    family: str
    case_id: str
    numeric: bool
    #: the requirement the case checks (a failure may name a more specific one)
    requirement: str = ""


@dataclasses.dataclass
class Outcome:
    outcome: str  # passed | failed | skipped | would_fail (a failure of a requirement newer than the level)
    reason: str = ""
    data: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: the requirement a failure broke
    requirement: str = ""


class ConformanceState:
    """What this run checks, and what happened (held in ``config.stash``)."""

    def __init__(self, backends: list[SelectedBackend], notes: list[str], host: Any, level: str = "") -> None:
        self.backends = backends
        self.notes = notes
        self.host = host
        #: the conformance level checked: failures of newer requirements do not fail the run
        self.level = level
        self.items: dict[str, CaseInfo] = {}
        self.outcomes: dict[str, Outcome] = {}
        #: nodeid -> the requirement its failure broke (set while the case runs)
        self.broken: dict[str, str] = {}

    def names(self) -> list[str]:
        return [b.name for b in self.backends]


STATE_KEY = pytest.StashKey[ConformanceState]()


# -- options ---------------------------------------------------------------------
def _option_taken(parser: pytest.Parser, opt: str) -> bool:
    try:
        groups = list(getattr(parser, "_groups", [])) + [getattr(parser, "_anonymous", None)]
        return any(opt in o.names() for g in groups if g is not None for o in g.options)
    except Exception:  # private API changed: assume free, argparse will say otherwise
        return False


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("attnplug", "attnplug conformance suite")
    names = ["--attnplug-backend"]
    if not _option_taken(parser, "--backend"):
        names.insert(0, "--backend")
    group.addoption(
        *names, action="append", dest="attnplug_backends", default=[], metavar="NAME",
        help="run the attnplug conformance suite against backend NAME (canonical name or alias; "
             "repeatable; 'all' = every backend available on this host). Without it the suite is not collected.",
    )
    group.addoption(
        "--conformance-report", dest="attnplug_report", default=None, metavar="PATH",
        help="write the conformance results (backend, distribution, version, host, every case) as JSON to PATH",
    )
    group.addoption(
        "--conformance-level", dest="attnplug_level", default=None, metavar="LEVEL",
        help="fail the run only on requirements introduced up to attnplug LEVEL (MAJOR.MINOR, e.g. 0.1; "
             "default: the installed attnplug's level); newer requirements still run and their failures are "
             "reported as 'would fail at level X' (docs/conformance.md#conformance-levels)",
    )
    group.addoption(
        "--conformance-examples", dest="attnplug_examples", type=int, default=None, metavar="N",
        help="hypothesis examples per case of the randomised family (test_random; default 12)",
    )
    parser.addini("attnplug_suite_only", type="bool", default=True,
                  help="with --backend and no explicit paths, collect only the conformance suite "
                       "(false: collect testpaths too)")


# -- configure: resolve names, add the suite -----------------------------------------
def _resolve(requested: list[str]) -> ConformanceState:
    from attnplug.errors import AttnplugError, UnknownBackendError
    from attnplug.registry import default_registry

    reg = default_registry()
    host = reg.host
    notes: list[str] = []
    chosen: dict[str, SelectedBackend] = {}
    for raw in requested:
        for name in (n.strip() for n in raw.split(",")):
            if not name:
                continue
            if name == ALL:
                for n in reg.names():
                    avail = reg.availability(n, host)
                    if avail:
                        chosen.setdefault(n, _selected(reg, n, name))
                    else:
                        notes.append(f"{n}: unavailable on this host ({'; '.join(avail.reasons)})")
                continue
            try:
                canonical = reg.canonical(name, host)
            except UnknownBackendError as exc:
                raise pytest.UsageError(f"--backend={name}: {exc}") from None
            except AttnplugError as exc:
                raise pytest.UsageError(f"--backend={name}: {exc}") from None
            avail = reg.availability(canonical, host)
            if not avail:
                others = ", ".join(n for n in reg.available_names(host) if n != canonical) or "none"
                raise pytest.UsageError(
                    f"--backend={name}: attention backend {canonical!r} is unavailable on this host: "
                    f"{'; '.join(avail.reasons)}. Available here: {others}"
                )
            chosen.setdefault(canonical, _selected(reg, canonical, name))
    if not chosen:
        raise pytest.UsageError(
            "--backend=all: no attention backend is available on this host"
            + (" (" + "; ".join(notes) + ")" if notes else "") + ". Run `attnplug list` for details."
        )
    for p in reg.failed_plugins():
        notes.append(f"plugin {p.distribution} set aside: {p.error}")
    return ConformanceState(list(chosen.values()), notes, host)


def _level(value: str | None) -> str:
    """The level to check (``--conformance-level``, default the installed one), every family's
    requirement looked up first: a usage error names what is wrong."""
    from attnplug.testing.suite import requirements as R
    from attnplug.testing.suite.cases import GENERATORS

    for family in (*GENERATORS, "refusal", "protocol"):
        try:
            R.for_family(family)
        except R.RequirementError as exc:
            raise pytest.UsageError(f"conformance family {family!r}: {exc}") from None
    if value is None:
        return R.installed_level()
    try:
        return R.parse_level(value)
    except ValueError as exc:
        raise pytest.UsageError(f"--conformance-level={value}: {exc}") from None


def _selected(reg: Any, name: str, requested_as: str) -> SelectedBackend:
    d = reg.get(name)
    return SelectedBackend(name, d.distribution, d.version, d.capabilities, requested_as,
                           getattr(d, "conformance_level", None))


def _points_into_suite(arg: str, invocation_dir: Path) -> bool:
    path = Path(arg.split("::", 1)[0])
    if not path.is_absolute():
        path = invocation_dir / path
    try:
        path.resolve().relative_to(SUITE_DIR)
        return True
    except ValueError:
        return False


def pytest_configure(config: pytest.Config) -> None:
    requested = config.getoption("attnplug_backends", default=None) or []
    level_opt = config.getoption("attnplug_level", default=None)
    if not requested:
        if level_opt is not None:
            raise pytest.UsageError(f"--conformance-level={level_opt}: needs --backend=NAME (the level of the "
                                    f"conformance suite's run)")
        return
    level = _level(level_opt)
    state = _resolve(requested)
    state.level = level
    config.stash[STATE_KEY] = state
    suite = [str(SUITE_DIR / m) for m in SUITE_MODULES]
    inv = Path(config.invocation_params.dir)
    explicit = config.args_source == pytest.Config.ArgsSource.ARGS
    if explicit:
        if not any(_points_into_suite(a, inv) for a in config.args):
            config.args = list(config.args) + suite
    elif config.getini("attnplug_suite_only"):
        config.args = suite
    else:
        config.args = list(config.args) + suite


def pytest_report_header(config: pytest.Config) -> list[str] | None:
    state = config.stash.get(STATE_KEY, None)
    if state is None:
        return None
    import attnplug
    from attnplug.testing.suite import requirements as R

    full = R.installed_level()
    newer = [lv for lv in R.levels() if R.level_key(lv) > R.level_key(state.level)]
    lines = [f"attnplug conformance level {state.level} (attnplug {attnplug.__version__} checks up to {full})"
             + (f": failures of requirements new since {', '.join(newer)} are reported, not failed" if newer else "")]
    for b in state.backends:
        alias = f" (requested as {b.requested_as!r})" if b.requested_as not in (b.name, ALL) else ""
        lines.append(f"attnplug conformance: backend {b.name}{alias}, distribution {b.distribution} {b.version}, "
                     f"host {state.host.describe()}")
        lines.append(f"  claims: {b.capabilities.summary()}")
        if b.declared_level and b.declared_level != state.level:
            lines.append(f"  declares conformance level {b.declared_level} (BackendDescriptor.conformance_level); "
                         f"this run checks {state.level}")
    lines.extend(f"  note: {n}" for n in state.notes)
    return lines


# -- parametrization -----------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class BoundCase:
    """The value of the ``attnplug_case`` parameter: one case for one backend."""

    backend: str
    case: Any

    def __repr__(self) -> str:
        return f"{self.backend}-{self.case.id if self.case is not None else 'none'}"


def _in_suite(module_file: str | None) -> bool:
    if not module_file:
        return False
    try:
        Path(module_file).resolve().relative_to(SUITE_DIR)
        return True
    except ValueError:
        return False


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    state = metafunc.config.stash.get(STATE_KEY, None)
    if state is None or not _in_suite(getattr(metafunc.module, "__file__", None)):
        return
    from attnplug.testing.suite import cases as C

    if "attnplug_case" in metafunc.fixturenames:
        family = metafunc.function.__name__[len("test_"):]
        has_cuda = state.host.platform == "cuda"
        params = []
        for b in state.backends:
            generated = C.cases_for(family, b.capabilities)
            if not generated:
                params.append(pytest.param(BoundCase(b.name, None), id=f"{b.name}-none", marks=[pytest.mark.skip(
                    reason=f"{family}: no case applies to {b.name}")]))
            for case in generated:
                reason = C.skip_reason(case, b.capabilities, b.name, has_cuda=has_cuda)
                marks = [pytest.mark.skip(reason=reason)] if reason else []
                params.append(pytest.param(BoundCase(b.name, case), id=f"{b.name}-{case.id}", marks=marks))
        metafunc.parametrize("attnplug_case", params)
    elif "attnplug_backend" in metafunc.fixturenames:
        metafunc.parametrize("attnplug_backend", state.names(), ids=state.names())


@pytest.hookimpl(tryfirst=True)
def pytest_pycollect_makeitem(collector: Any, name: str, obj: object) -> Any:
    """Collect the suite's ``test_*`` functions even where ``python_functions`` says otherwise."""
    if STATE_KEY not in collector.config.stash or not name.startswith("test_") or not callable(obj):
        return None
    if not isinstance(collector, pytest.Module) or not _in_suite(str(collector.path)):
        return None
    if collector.funcnamefilter(name) or not hasattr(collector, "_genfunctions"):
        return None  # the default hook collects it
    return list(collector._genfunctions(name, obj))


@pytest.fixture
def attnplug_record(request: pytest.FixtureRequest) -> Any:
    """``attnplug_record(max_abs_err=..., tolerance=...)``: attach numbers to this case's report."""

    def record(**data: Any) -> None:
        request.node.user_properties.append(("attnplug", data))

    return record


def pytest_collection_finish(session: pytest.Session) -> None:
    """Map each selected suite item (after ``-k``/``-m`` deselection) to its backend and case."""
    state = session.config.stash.get(STATE_KEY, None)
    if state is None:
        return
    from attnplug.testing.suite.cases import NUMERIC_FAMILIES

    for item in session.items:
        callspec = getattr(item, "callspec", None)
        if callspec is None or not _in_suite(str(getattr(item, "path", ""))):
            continue
        bound = callspec.params.get("attnplug_case")
        func = getattr(item, "originalname", item.name)
        if isinstance(bound, BoundCase):
            family = func[len("test_"):]
            case_id = bound.case.id if bound.case is not None else "none"
            req = (bound.case.requirement if bound.case is not None else None) or family
            state.items[item.nodeid] = CaseInfo(bound.backend, family, case_id, family in NUMERIC_FAMILIES, req)
        elif "attnplug_backend" in callspec.params:
            state.items[item.nodeid] = CaseInfo(callspec.params["attnplug_backend"], "protocol",
                                                item.name.split("[", 1)[0], False, "protocol")


# -- results ---------------------------------------------------------------------------
def _requirement(req_id: str | None, info: CaseInfo) -> Any:
    from attnplug.testing.suite import requirements as R

    try:
        return R.requirement(req_id or info.requirement)
    except R.RequirementError:  # a check naming an id the table lacks: the case's own requirement
        return R.requirement(info.requirement)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Any:
    """A suite case runs the backend's code as ``isolation`` runs plugin code: a ``SystemExit``, a
    ``GeneratorExit`` or a ``KeyboardInterrupt`` the backend raises itself (from its factory, forward,
    metadata or notes) fails that case with a ``PluginError`` naming the distribution, and the suite
    goes on; a real Ctrl-C still stops it. A failing case notes which requirement it broke and its
    message ends with that requirement's guidance."""
    state = item.config.stash.get(STATE_KEY, None)
    info = state.items.get(item.nodeid) if state is not None else None
    if info is None:
        return (yield)
    from attnplug.errors import PluginError
    from attnplug.isolation import describe_exception, watch_sigint

    with watch_sigint() as interrupted:
        try:
            return (yield)
        except BaseException as exc:
            cause = None
            if isinstance(exc, (KeyboardInterrupt, SystemExit, GeneratorExit)):
                if isinstance(exc, KeyboardInterrupt) and interrupted():
                    raise
                dist = next((b.distribution for b in state.backends if b.name == info.backend), "?")  # type: ignore[union-attr]
                cause, exc = exc, PluginError(dist, f"backend {info.backend!r} raised {describe_exception(exc)} "
                                                    f"during {item.name}")
            elif isinstance(exc, (pytest.skip.Exception, pytest.xfail.Exception, pytest.exit.Exception)):
                raise
            req = _requirement(getattr(exc, "attnplug_requirement", None), info)
            state.broken[item.nodeid] = req.id  # type: ignore[union-attr]
            text = req.guidance()
            if isinstance(exc, pytest.fail.Exception) and not exc.pytrace:
                exc.msg = f"{exc.msg}\n{text}"
            elif hasattr(exc, "add_note"):
                exc.add_note(text)
            if cause is not None:
                raise exc from cause
            raise


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: Any) -> Any:
    rep = yield
    state = item.config.stash.get(STATE_KEY, None)
    if state is not None and item.nodeid in state.items:
        if rep.when == "call" and rep.failed and item.nodeid in state.broken:
            _defer_if_newer(state, item, rep, call)
        _record_outcome(state, item, rep, call)
    return rep


def _clip(text: str, limit: int = 3000) -> str:
    """``text`` cut to ``limit`` characters keeping both ends (a failure's guidance is at its end)."""
    text = text.strip()
    return text if len(text) <= limit else f"{text[:limit // 2]}\n[...]\n{text[-limit // 2:]}"


def _defer_if_newer(state: ConformanceState, item: pytest.Item, rep: pytest.TestReport, call: Any) -> None:
    """A failure of a requirement newer than the checked level does not fail the run: it is reported as
    an expected failure ("would fail at level X") with the failure text kept for the summary and report."""
    from attnplug.testing.suite import requirements as R

    req = R.requirement(state.broken[item.nodeid])
    if not R.newer_than(req, state.level):
        return
    excinfo = getattr(call, "excinfo", None)
    text = excinfo.exconly() if excinfo is not None else (getattr(rep, "longreprtext", "") or str(rep.longrepr))
    rep.outcome = "skipped"
    rep.wasxfail = (f"would fail at conformance level {req.since} (checked at {state.level}): requirement "
                    f"{req.id!r}; see {R.DOC}#{req.anchor}")
    rep.attnplug_would_fail = _clip(text)  # type: ignore[attr-defined]


def _record_outcome(state: ConformanceState, item: pytest.Item, rep: pytest.TestReport, call: Any) -> None:
    prev = state.outcomes.get(item.nodeid)
    if rep.when == "call" or (rep.when == "setup" and not rep.passed) or (rep.when == "teardown" and rep.failed):
        if prev is not None and prev.outcome == "failed":
            return
        data: dict[str, Any] = {}
        for key, value in getattr(item, "user_properties", []):
            if key == "attnplug":
                data.update(value)
        would = getattr(rep, "attnplug_would_fail", None)
        if would is not None:
            state.outcomes[item.nodeid] = Outcome("would_fail", would, data, state.broken.get(item.nodeid, ""))
        elif rep.skipped:
            reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
            reason = reason[len("Skipped: "):] if reason.startswith("Skipped: ") else reason
            state.outcomes[item.nodeid] = Outcome("skipped", reason, data)
        elif rep.failed:
            excinfo = getattr(call, "excinfo", None)
            text = excinfo.exconly() if excinfo is not None else (getattr(rep, "longreprtext", "") or "")
            state.outcomes[item.nodeid] = Outcome("failed", _clip(text), data,
                                                  state.broken.get(item.nodeid, ""))
        else:
            state.outcomes[item.nodeid] = Outcome("passed", "", data)


def _tally(state: ConformanceState, backend: str) -> dict[str, int]:
    from attnplug.testing.suite.cases import NOT_CLAIMED

    t = {"passed": 0, "skipped_by_capability": 0, "skipped_other": 0, "failed": 0, "would_fail": 0, "numeric": 0,
         "not_run": 0}
    for nodeid, info in state.items.items():
        if info.backend != backend:
            continue
        o = state.outcomes.get(nodeid)
        if o is None:
            t["not_run"] += 1
            continue
        if o.outcome == "skipped":
            t["skipped_by_capability" if NOT_CLAIMED in o.reason else "skipped_other"] += 1
            continue
        t[o.outcome] += 1
        if info.numeric:
            t["numeric"] += 1
    return t


def summary_line(state: ConformanceState, backend: str) -> str:
    t = _tally(state, backend)
    parts = [f"{t['passed']} passed", f"{t['skipped_by_capability']} skipped by capability"]
    if t["skipped_other"]:
        parts.append(f"{t['skipped_other']} skipped (other)")
    parts.append(f"{t['failed']} failed")
    if t["would_fail"]:
        parts.append(f"{t['would_fail']} would fail at a newer level")
    if t["not_run"]:
        parts.append(f"{t['not_run']} not run")
    return f"attnplug conformance {backend}: {', '.join(parts)} (numeric cases: {t['numeric']})"


def newer_failures(state: ConformanceState, backend: str) -> dict[str, dict[str, int]]:
    """``{level: {requirement id: cases}}`` of the cases that would fail at a level newer than the one checked."""
    from attnplug.testing.suite import requirements as R

    out: dict[str, dict[str, int]] = {}
    for nodeid, info in state.items.items():
        o = state.outcomes.get(nodeid)
        if info.backend == backend and o is not None and o.outcome == "would_fail":
            req = R.requirement(o.requirement)
            per = out.setdefault(req.since, {})
            per[req.id] = per.get(req.id, 0) + 1
    return dict(sorted(out.items(), key=lambda kv: R.level_key(kv[0])))


def level_lines(state: ConformanceState, backend: str) -> list[str]:
    """What the requirements newer than the checked level found: per level, the cases that would fail
    there and, per requirement, its contract, how to meet it and its docs anchor."""
    from attnplug.testing.suite import requirements as R

    newer = [lv for lv in R.levels() if R.level_key(lv) > R.level_key(state.level)]
    if not newer:
        return []
    failing = newer_failures(state, backend)
    lines = []
    for lv in newer:
        per = failing.get(lv, {})
        ran = sum(1 for nid, info in state.items.items() if info.backend == backend
                  and nid in state.outcomes and state.outcomes[nid].outcome in ("passed", "failed", "would_fail")
                  and R.requirement(state.outcomes[nid].requirement or info.requirement).since == lv)
        if not per:
            lines.append(f"attnplug conformance {backend} at level {state.level}: new since {lv}: every case that "
                         f"ran passes ({ran} cases of its requirements): {backend} meets level {lv} as far as "
                         f"this run checked")
            continue
        total = sum(per.values())
        what = ", ".join(f"{rid} ({n})" for rid, n in per.items())
        lines.append(f"attnplug conformance {backend} at level {state.level}: new since {lv}: {total} cases would "
                     f"fail — {what}; see {R.DOC}#{R.level_anchor(lv)}")
        for rid in per:
            req = R.requirement(rid)
            lines.append(f"  {rid}: {req.contract}. How to meet it: {req.how} ({R.DOC}#{req.anchor})")
    return lines


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    state = config.stash.get(STATE_KEY, None)
    if state is None or config.option.collectonly:
        return
    for b in state.backends:
        terminalreporter.write_line(summary_line(state, b.name))
        for line in level_lines(state, b.name):
            terminalreporter.write_line(line)
    path = config.getoption("attnplug_report", default=None)
    if path:
        terminalreporter.write_line(f"attnplug conformance report written to {path}")


def build_report(state: ConformanceState, exitstatus: int) -> dict[str, Any]:
    import attnplug
    from attnplug.testing.suite import requirements as R

    backends = []
    for b in state.backends:
        cases = []
        for nodeid, info in state.items.items():
            if info.backend != b.name:
                continue
            o = state.outcomes.get(nodeid)
            entry: dict[str, Any] = {"id": nodeid.split("::", 1)[-1], "family": info.family, "case": info.case_id,
                                     "numeric": info.numeric, "outcome": o.outcome if o else "not_run",
                                     "requirement": (o.requirement if o is not None and o.requirement
                                                     else info.requirement)}
            entry["since"] = R.requirement(entry["requirement"]).since
            if o is not None and o.reason:
                entry["reason"] = o.reason
            if o is not None:
                entry.update(o.data)
            cases.append(entry)
        t = _tally(state, b.name)
        backends.append({
            "backend": b.name,
            "requested_as": b.requested_as,
            "declared_conformance_level": b.declared_level,
            "distribution": b.distribution,
            "version": b.version,
            "capabilities": b.capabilities.to_dict(),
            "summary": t,
            "summary_line": summary_line(state, b.name),
            "would_fail_by_level": newer_failures(state, b.name),
            "level_lines": level_lines(state, b.name),
            "cases": cases,
        })
    report: dict[str, Any] = {
        "attnplug_version": attnplug.__version__,
        "conformance_level": state.level,
        "conformance_levels": R.known_levels(),
        "host": state.host.to_dict(),
        "exit_status": int(exitstatus),
        "notes": state.notes,
        "backends": backends,
    }
    if len(backends) == 1:  # a single-backend run is also readable without indexing
        for key in ("backend", "distribution", "version", "summary", "cases"):
            report[key] = backends[0][key]
    return report


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    state = config.stash.get(STATE_KEY, None)
    path = config.getoption("attnplug_report", default=None)
    if state is None or not path or hasattr(config, "workerinput"):
        return
    target = Path(path)
    if not target.is_absolute():
        target = Path(config.invocation_params.dir) / target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(target.suffix + ".tmp")
    tmp.write_text(json.dumps(build_report(state, exitstatus), indent=2, default=str) + "\n", encoding="utf-8")
    os.replace(tmp, target)
