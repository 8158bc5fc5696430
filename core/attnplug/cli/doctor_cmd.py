"""``attnplug doctor``: check this host end to end.

Discovers plugins, shows the host, resolves the default pair, then builds
every available backend and checks what it claims: a quick subset of the
conformance suite (``claim_cases``: every forward mode, each head layout,
each claimed feature -- window, soft-cap, sinks, verify, cross-attention --
and every claimed dtype), built by the suite's own harness and compared with
the float64 reference. A backend that ignores a claimed feature fails with
that feature named. Exit status 1 when a backend that claims availability
fails (build error, forward error, wrong KV-cache write, error above
tolerance), when the default pair fails to resolve although some
installed backend volunteers as a default here, or when a name conflict
(two distributions registering one name) removed backends and none usable
remains (said in words: the conflict removed them); with none volunteering,
doctor explains that and still checks every backend.

torch is imported inside ``check_backend`` only (``attnplug doctor --help``
stays light).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from typing import Any

DTYPE_PREFERENCE = ("float32", "bfloat16", "float16")
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 32


@dataclasses.dataclass
class ModeResult:
    mode: str
    ok: bool
    max_error: float | None = None
    tolerance: float | None = None
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class BackendReport:
    name: str
    distribution: str
    version: str
    available: bool
    reasons: list[str]
    status: str = "skipped"  # "ok" | "failed" | "skipped" (unavailable)
    effective_name: str | None = None
    device: str | None = None
    dtype: str | None = None
    page_size: int | None = None
    modes: list[ModeResult] = dataclasses.field(default_factory=list)
    error: str | None = None
    seconds: float = 0.0
    #: the built backend's ``runtime_notes()`` (kernel paths chosen at run time)
    notes: list[str] = dataclasses.field(default_factory=list)
    #: the conformance level its publisher checked it at (``BackendDescriptor.conformance_level``)
    conformance_level: str | None = None

    @property
    def max_error(self) -> float | None:
        errs = [m.max_error for m in self.modes if m.max_error is not None]
        return max(errs) if errs else None

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["modes"] = [m.to_dict() for m in self.modes]
        d["max_error"] = self.max_error
        return d


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--backend", action="append", default=None, metavar="NAME",
                        help="check only these backends (repeatable; default: every installed backend)")
    parser.add_argument("--strict", action="store_true",
                        help="also exit 1 when a plugin failed to load or the registry reports a problem")


def _device_for(host: Any, devices: tuple[str, ...]) -> str:
    if host.platform in ("cuda", "rocm") and host.platform in devices:
        return "cuda"  # torch names ROCm devices "cuda" too
    if host.platform == "xpu" and "xpu" in devices:
        return "xpu"
    return "cpu"


def _pick(values: Any, preferred: tuple[Any, ...]) -> Any:
    if values is None:
        return preferred[0]
    for v in preferred:
        if v in values:
            return v
    return values[0]


# -- what doctor checks ------------------------------------------------------
def claim_cases(caps: Any, name: str) -> list[tuple[str, Any]]:
    """``(claim, case)`` pairs: a quick subset of the conformance suite, one or two cases per claim.

    Every forward mode, each head layout (MHA/GQA/MQA), each claimed feature (window, soft-cap,
    sinks and their combinations, in extend, decode and verify), cross-attention, a V head dim
    that differs, and every claimed dtype. Cases come from the suite's own generators
    (``attnplug.testing.suite.cases``) and are kept only when the suite would run them for these
    capabilities, so doctor and ``pytest --backend`` can never disagree on what is claimed.
    """
    from attnplug.testing.suite import cases as C

    dtype = _pick(caps.dtypes, DTYPE_PREFERENCE)
    ps = _pick(caps.page_sizes, (16, 64, 1))
    shape = C.DEFAULT_SHAPE
    if caps.head_dims is not None and shape.head_dim not in caps.head_dims:
        shape = dataclasses.replace(shape, head_dim=caps.head_dims[0])

    layout = caps.kv_layouts[0] if caps.kv_layouts else "nhd"

    def case(label: str, scen: str, **kw: Any) -> tuple[str, Any]:
        c = C.Case("doctor", f"{label}-{scen}", C.scenario(scen, ps), dtype=kw.pop("dtype", dtype),
                   page_size=ps, shape=kw.pop("shape", shape), kv_layout=layout, **kw)
        return label, c

    out = [case(f"mode:{scen}", scen) for scen in C.ALL_MODE_SCENARIOS]
    for lname, h, kv in C.HEAD_LAYOUTS:
        for scen in ("extend_prefix", "decode"):
            out.append(case(f"heads:{lname}", scen, shape=dataclasses.replace(shape, name=lname, num_heads=h,
                                                                            num_kv_heads=kv)))
    for fname, feat in C.FEATURES.items():
        for scen in ("extend_prefix", "decode", "target_verify_custom_mask"):
            out.append(case(f"feature:{fname}", scen, features=feat))
    for scen in ("cross_extend", "cross_decode"):
        out.append(case("cross_attention", scen, features=C.Features(cross_attention=True)))
    dk, dv = C.V_HEAD_DIMS[0]
    out.append(case("v_head_dim", "decode", shape=C.Shape(f"dk{dk}dv{dv}", 8, 2, dk, dv)))
    for dt in caps.dtypes:
        if dt != dtype:
            for scen in ("extend_prefix", "decode"):
                out.append(case(f"dtype:{dt}", scen, dtype=dt))
    return [(label, c) for label, c in out if C.skip_reason(c, caps, name) is None]


def check_backend(registry: Any, name: str, host: Any) -> BackendReport:
    """Build ``name`` and run a quick subset of the conformance cases for every claim."""
    desc = registry.get(name)
    avail = registry.availability(name, host)
    rep = BackendReport(name, desc.distribution, desc.version, avail.available, list(avail.reasons))
    rep.conformance_level = getattr(desc, "conformance_level", None)
    if not avail:
        return rep
    import attnplug.testing.reference  # noqa: F401  (torch's import time is not the backend's)

    start = time.perf_counter()
    try:
        _run_checks(registry, name, host, rep)
    except Exception as exc:  # anything a backend throws is its failure, in words
        rep.error = rep.error or f"{type(exc).__name__}: {exc}"
    rep.seconds = time.perf_counter() - start
    failed = rep.error is not None or any(not m.ok for m in rep.modes)
    rep.status = "failed" if failed else "ok"
    return rep


def _run_checks(registry: Any, name: str, host: Any, rep: BackendReport) -> None:
    from attnplug.backend import runtime_notes_of
    from attnplug.testing.suite import harness as H

    caps = registry.get(name).capabilities
    device = _device_for(host, caps.devices)
    pairs = claim_cases(caps, name)
    if pairs:
        first = pairs[0][1]
        rep.device, rep.dtype, rep.page_size = device, first.dtype, first.page_size
    for label, case in pairs:
        try:
            problem = H.make_problem(case, device)
            ctx = problem.context(name).replace(host=host)
        except Exception as exc:  # the problem itself could not be set up: doctor's fault, say so
            rep.error = f"setting up {label}: {type(exc).__name__}: {exc}"
            return
        try:
            rep.effective_name, backend = registry.build(name, ctx)
        except Exception as exc:  # a backend that cannot be built for a claimed case fails as a whole
            rep.error = f"build: {type(exc).__name__}: {exc}"
            return
        rep.notes.extend(n for n in runtime_notes_of(backend, rep.distribution) if n not in rep.notes)
        try:
            rep.modes.append(_check_case(label, case, backend, problem, H, rep))
        except Exception as exc:  # a claimed case that raises is a failed claim
            rep.modes.append(ModeResult(f"{label} ({case.scenario.name})", False,
                                        error=f"{type(exc).__name__}: {exc}"))


def _check_case(label: str, case: Any, backend: Any, problem: Any, H: Any, rep: BackendReport) -> ModeResult:
    import torch

    from attnplug.isolation import call_plugin_code, output_note
    from attnplug.testing.reference import expected_cache_after
    from attnplug.testing.tolerances import tolerance_for

    where = f"{label} ({case.scenario.name})"
    tol = tolerance_for(case.dtype)
    # the backend's code runs isolated: what it prints stays out of the report (noted once), and a
    # SystemExit or a KeyboardInterrupt it raises itself fails this case naming its distribution
    out, printed = call_plugin_code(rep.distribution, f"the forward of {where}", H.run, backend, problem)
    if printed.strip() and not any("wrote to stdout" in n for n in rep.notes):
        rep.notes.append(output_note(rep.distribution, f"the forward of {where}", printed))
    layer = problem.layers[0]
    want = (problem.batch.num_tokens, layer.num_heads, layer.v_head_dim)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != want:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        return ModeResult(where, False, error=f"forward returned {got}, expected a tensor of shape {want}")
    cmp = H.compare(out, H.expected_output(problem, 0), tol)
    q, k, v = problem.qkv[0]
    kb, vb = problem.before[0]
    if problem.layers[0].is_cross_attention or k is None:
        want_cache = (kb, vb)
    else:
        want_cache = expected_cache_after(kb, vb, k, v, problem.batch.out_cache_loc)
    cache_ok = all(torch.equal(got, exp) for got, exp in zip(problem.cache.read_kv(0), want_cache))
    error = None if cmp.ok else cmp.detail
    if not cache_ok:
        error = (error + "; " if error else "") + "KV-cache write differs from the new k/v at out_cache_loc"
    return ModeResult(where, cmp.ok and cache_ok, cmp.max_abs_err, tol.atol, error)


# -- the report ------------------------------------------------------------
def diagnose(registry: Any, host: Any = None, only: list[str] | None = None) -> dict[str, Any]:
    """Everything doctor checks, as a dict (``ok`` says whether the exit status is 0)."""
    from attnplug.config import AttentionConfig
    from attnplug.resolution import trace

    host = host or registry.host
    res = trace(AttentionConfig(), host=host, registry=registry)
    default = {"prefill": res.pair[0], "decode": res.pair[1], "ok": res.ok,
               "error": None if res.ok else f"{type(res.error).__name__}: {res.error}",
               "explanation": None}
    names = registry.names() if not only else [registry.canonical(n, host) for n in only]
    backends = [check_backend(registry, n, host) for n in names]
    failed = [b.name for b in backends if b.status == "failed"]
    default_failure = not res.ok
    usable = [b.name for b in backends if b.status == "ok"]
    conflicted = sorted(n for n, e in registry.conflicts.items() if getattr(e, "what", "") == "backend name")
    no_usable = None
    if not res.ok:
        ranked = [n for n in registry.names() if registry.get(n).priority_on(host) is not None]
        if not any(registry.availability(n, host) for n in ranked):
            # Nothing installed volunteers as a default here (e.g. only a third-party backend that
            # is chosen by name): that is a fact about this install, not a broken backend -- unless a
            # name conflict removed the backends that would
            default_failure = False
            choose = f"; choose one by name, e.g. --attention-backend {usable[0]}" if usable else ""
            if conflicted:
                default["explanation"] = (
                    f"name conflicts removed {', '.join(repr(n) for n in conflicted)} (each registered by two "
                    f"distributions; see the conflicts above), and no backend that remains declares a default "
                    f"priority for a {host.platform} host{choose}")
            else:
                default["explanation"] = (
                    f"no installed backend declares a default priority for a {host.platform} host{choose}")
    if conflicted and not usable:
        no_usable = (f"no usable backend: name conflicts removed {', '.join(repr(n) for n in conflicted)}; uninstall "
                     f"one distribution of each, or filter one with ATTNPLUG_DISABLE_PLUGINS")
    return {
        "host": host.to_dict(),
        "host_line": host.describe(),
        "speedups": _speedups_note(),
        "plugins": [p.to_dict() for p in registry.plugins],
        "failed_plugins": [p.to_dict() for p in registry.failed_plugins()],
        "conflicts": {n: str(e) for n, e in registry.conflicts.items()},
        "problems": list(registry.problems),
        "empty_hint": registry.empty_hint(),
        "default_pair": default,
        "backends": [b.to_dict() for b in backends],
        "failed": failed,
        "no_usable_backend": no_usable,
        "ok": not failed and not default_failure and no_usable is None,
    }


def _speedups_note() -> str:
    """Whether the skeleton's per-layer check runs compiled (attnplug-speedups) and, if not, why."""
    try:
        from attnplug.paged import SPEEDUPS_NOTE
    except ImportError as exc:  # no torch: no paged backend runs either
        return f"unknown ({exc})"
    return SPEEDUPS_NOTE


def render(report: dict[str, Any]) -> str:
    lines = [f"host: {report['host_line']}"]
    lines.append("plugins: " + (", ".join(f"{p['distribution']} {p['version']} ({p['status']})"
                                           for p in report["plugins"]) or "none installed"))
    for p in report["failed_plugins"]:
        lines.append(f"  plugin {p['distribution']} {p['version']} failed to load: {p['error']}")
    for msg in report["conflicts"].values():
        lines.append(f"  conflict: {msg}")
    for msg in report["problems"]:
        lines.append(f"  note: {msg}")
    d = report["default_pair"]
    if d["ok"]:
        lines.append(f"default pair: prefill={d['prefill']} decode={d['decode']}  (attnplug resolve explains it)")
    elif d.get("explanation"):
        lines.append(f"default pair: none: {d['explanation']}")
    else:
        lines.append(f"default pair: NOT RESOLVED: {d['error']}")
    if report.get("speedups"):
        lines.append(f"per-layer check (attnplug-speedups): {report['speedups']}")
    rows: list[tuple[str, ...]] = [("backend", "distribution", "version", "level", "available", "claims checked", "max error", "time",
             "result")]
    for b in report["backends"]:
        avail = "yes" if b["available"] else "no: " + "; ".join(b["reasons"])
        modes = _claims_summary(b["modes"])
        err = "-" if b["max_error"] is None else f"{b['max_error']:.2e}"
        secs = "-" if not b["available"] else f"{b['seconds'] * 1000:.0f}ms"
        result = {"ok": "ok", "failed": "FAILED", "skipped": "-"}[b["status"]]
        rows.append((b["name"], b["distribution"], b["version"], b.get("conformance_level") or "-", avail, modes,
                     err, secs, result))
    avail_col, cap = 4, 40  # the "why not" can be long: cut in the table, spelled out below it
    rows = [r[:avail_col] + (_cut(r[avail_col], cap),) + r[avail_col + 1:] for r in rows]
    claims_col = 5  # long too: cut in the table; a failing claim is spelled out below it
    rows = [r[:claims_col] + (_cut(r[claims_col], 56),) + r[claims_col + 1:] for r in rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    for b in report["backends"]:
        if not b["available"] and len("no: " + "; ".join(b["reasons"])) > cap:
            lines.append(f"  {b['name']} unavailable: " + "; ".join(b["reasons"]))
        for note in b.get("notes", ()):
            lines.append(f"  {b['name']}: {note}")
        lines.extend(_level_notes(b))
        if b["status"] == "failed":
            where = f" [{b['device']}, {b['dtype']}, page_size={b['page_size']}]" if b["device"] else ""
            if b["error"]:
                lines.append(f"  {b['name']} FAILED{where}: {b['error']}")
            for m in b["modes"]:
                if not m["ok"]:
                    lines.append(f"  {b['name']} FAILED{where} in {m['mode']}: {m['error']}")
    if not report["backends"]:
        lines.append(report.get("empty_hint") or "no backends found")
    lines.append("doctor: " + ("all checks passed" if report["ok"] else
                               "FAILED: " + (", ".join(report["failed"]) or report.get("no_usable_backend")
                                             or "no default pair")))
    return "\n".join(lines)


def _level_notes(b: dict[str, Any]) -> list[str]:
    """What the installed attnplug requires beyond the level a backend was checked at."""
    from attnplug.testing.suite import requirements as R

    level = b.get("conformance_level")
    if not level or not b["available"]:
        return []
    mine = R.installed_level()
    if R.level_key(level) > R.level_key(mine):
        return [f"  {b['name']}: checked at conformance level {level}, newer than this attnplug ({mine}): "
                f"upgrade attnplug"]
    newer = [r for r in R.REQUIREMENTS if R.newer_than(r, level)]
    if not newer:
        return []
    since = sorted({r.since for r in newer}, key=R.level_key)
    return [f"  {b['name']}: checked at conformance level {level}; this attnplug requires {mine}, adding "
            f"{', '.join(r.id for r in newer)}: run pytest --backend={b['name']} to see which it meets "
            f"({R.DOC}#{R.level_anchor(since[0])})"]


def _claims_summary(modes: list[dict[str, Any]]) -> str:
    """``"41 cases: modes, heads, window, softcap, sinks, cross, dtypes"``; failing claims marked ``!``."""
    if not modes:
        return "-"
    groups: dict[str, bool] = {}
    for m in modes:
        label = m["mode"].split(" ", 1)[0]
        kind, _, detail = label.partition(":")
        key = {"mode": "modes", "heads": "heads", "dtype": "dtypes"}.get(kind, detail or kind)
        groups[key] = groups.get(key, True) and m["ok"]
    return f"{len(modes)} cases: " + ",".join(k + ("" if ok else "!") for k, ok in groups.items())


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def run(args: argparse.Namespace) -> int:
    from attnplug.registry import default_registry

    from attnplug.errors import AttnplugError

    registry = default_registry()
    try:
        report = diagnose(registry, only=args.backend)
    except AttnplugError as exc:  # an unknown --backend name: say what is installed
        print(f"attnplug doctor: {exc}", file=sys.stderr)
        return 2
    ok = report["ok"] and not (args.strict and (report["failed_plugins"] or report["problems"]
                                                or report["conflicts"]))
    report["ok"] = ok
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True, default=str))
    else:
        print(render(report))
    return 0 if ok else 1
