"""``attnplug doctor``: check this host end to end.

Discovers plugins, shows the host, resolves the default pair, then builds
every available backend (a small ``BuildContext`` over a ``PagedKVCache``)
and runs one small forward in every mode it claims -- extend, extend over a
cached prefix, decode, mixed, target-verify, draft-extend, idle -- against
the float64 reference. Exit status 1 when a backend that claims availability
fails (build error, forward error, wrong KV-cache write, error above
tolerance) or when no default pair resolves here.

torch is imported inside ``check_backend`` only (``attnplug doctor --help``
stays light).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from typing import Any, Callable

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


# -- scenarios -------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Scenario:
    label: str
    mode: str  # ForwardMode value
    prefix: tuple[int, ...]
    extend: tuple[int, ...]
    needs: str | None = None  # capability flag the mode needs


SCENARIOS: tuple[Scenario, ...] = (
    Scenario("extend", "extend", (0, 0), (5, 3)),
    Scenario("extend+prefix", "extend", (6, 3), (3, 4)),
    Scenario("decode", "decode", (7, 4), (1, 1)),
    Scenario("mixed", "mixed", (0, 5), (4, 1)),
    Scenario("target_verify", "target_verify", (5, 3), (3, 3), needs="speculative_verify"),
    Scenario("draft_extend", "draft_extend", (4, 6), (2, 3), needs="draft_extend"),
    Scenario("idle", "idle", (), ()),
)


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


def check_backend(registry: Any, name: str, host: Any) -> BackendReport:
    """Build ``name`` and run every claimed mode against the float64 reference."""
    desc = registry.get(name)
    avail = registry.availability(name, host)
    rep = BackendReport(name, desc.distribution, desc.version, avail.available, list(avail.reasons))
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
    import torch

    from attnplug.batch import ForwardBatch
    from attnplug.config import AttentionConfig
    from attnplug.context import BuildContext
    from attnplug.kvcache import PageAllocator, PagedKVCache
    from attnplug.layer import LayerSpec
    from attnplug.modes import ForwardMode
    from attnplug.resolution import resolve
    from attnplug.testing.reference import expected_cache_after, reference_attention
    from attnplug.testing.tolerances import tolerance_for

    caps = registry.get(name).capabilities
    device = _device_for(host, caps.devices)
    dtype = _pick(caps.dtypes, DTYPE_PREFERENCE)
    page_size = _pick(caps.page_sizes, (4, 1, 16))
    head_dim = _pick(caps.head_dims, (HEAD_DIM, 64, 128))
    kv_heads = NUM_KV_HEADS if caps.gqa else NUM_HEADS
    rep.device, rep.dtype, rep.page_size = device, dtype, page_size
    try:
        resolved = resolve(AttentionConfig(attention_backend=name, dtype=dtype, page_size=page_size),
                           host=host, registry=registry).config
    except Exception as exc:
        rep.error = f"resolution: {type(exc).__name__}: {exc}"
        return
    layer = LayerSpec(layer_id=0, num_heads=NUM_HEADS, num_kv_heads=kv_heads, head_dim=head_dim)
    max_ctx = 64
    cache = PagedKVCache(1, num_pages=4 * max_ctx // page_size, num_kv_heads=kv_heads, head_dim=head_dim,
                         page_size=page_size, dtype=dtype, device=device, max_requests=4, max_context_len=max_ctx)
    ctx = BuildContext(config=resolved, host=host, device=device, dtype=dtype, num_heads=NUM_HEADS,
                       num_kv_heads=kv_heads, head_dim=head_dim, page_size=page_size, kv_cache=cache,
                       max_batch_size=4, max_context_len=max_ctx, layers=(layer,))
    try:
        effective, backend = registry.build(name, ctx)
    except Exception as exc:
        rep.error = f"build: {type(exc).__name__}: {exc}"
        return
    rep.effective_name = effective
    tol = tolerance_for(dtype)  # the conformance suite's, stated in one place
    atol, rtol = tol.atol, tol.rtol
    gen = torch.Generator().manual_seed(1234)
    tdtype = getattr(torch, dtype)
    for sc in SCENARIOS:
        if sc.needs and not getattr(caps, sc.needs):
            continue
        mode = ForwardMode(sc.mode)
        try:
            rep.modes.append(_one_mode(sc, mode, backend, layer, cache, gen, tdtype, device, atol, rtol,
                                       ForwardBatch, PageAllocator, reference_attention, expected_cache_after))
        except Exception as exc:
            rep.modes.append(ModeResult(sc.label, False, error=f"{type(exc).__name__}: {exc}"))


def _one_mode(sc: Scenario, mode: Any, backend: Any, layer: Any, cache: Any, gen: Any, tdtype: Any, device: str,
              atol: float, rtol: float, ForwardBatch: Any, PageAllocator: Any, reference_attention: Callable[..., Any],
              expected_cache_after: Callable[..., Any]) -> ModeResult:
    import torch

    H, KV, D = layer.num_heads, layer.num_kv_heads, layer.head_dim
    # garbage everywhere: a backend reading a slot it should not shows up as an error
    for buf in (cache.k_buffers[0], cache.v_buffers[0]):
        buf.copy_(torch.randn(buf.shape, generator=gen).to(buf.dtype))
    if mode.is_idle():
        batch = ForwardBatch.idle(device)
        q = torch.zeros(0, H, D, dtype=tdtype, device=device)
        k = torch.zeros(0, KV, D, dtype=tdtype, device=device)
        backend.init_forward_metadata(batch)
        out = backend.forward(q, k, k.clone(), layer, batch, save_kv_cache=True)
        ok = tuple(out.shape) == (0, H, layer.v_head_dim)
        return ModeResult(sc.label, ok, 0.0, atol, None if ok else f"idle output shape {tuple(out.shape)}")
    reqs = [2, 0]  # pool rows out of order: the backend must go through req_to_token
    alloc = PageAllocator(cache.num_pages, shuffle=True, seed=len(sc.label))
    for r, p, e in zip(reqs, sc.prefix, sc.extend):
        n = p + e
        cache.assign_pages(r, n, alloc.alloc(-(-n // cache.page_size)))
    loc = torch.cat([cache.slots(r, p, p + e) for r, p, e in zip(reqs, sc.prefix, sc.extend)])
    kw: dict[str, Any] = {}
    if mode.is_target_verify():
        d = sc.extend[0]
        mask = torch.tril(torch.ones(d, d, dtype=torch.bool))
        mask[d - 1, 1] = False  # a tree: the last draft token does not see the second
        kw = {"spec_num_draft_tokens": d, "spec_custom_mask": mask.expand(len(reqs), d, d).clone().to(device)}
    if mode.is_decode():
        seq = [p + e for p, e in zip(sc.prefix, sc.extend)]
        batch = ForwardBatch.decode(torch.tensor(reqs, device=device), torch.tensor(seq, device=device), loc)
    else:
        batch = ForwardBatch.extend(torch.tensor(reqs, device=device), torch.tensor(sc.prefix, device=device),
                                    torch.tensor(sc.extend, device=device), loc, mode=mode, **kw)
    T = sum(sc.extend)
    q = torch.randn(T, H, D, generator=gen).to(tdtype).to(device)
    k = torch.randn(T, KV, D, generator=gen).to(tdtype).to(device)
    v = torch.randn(T, KV, layer.v_head_dim, generator=gen).to(tdtype).to(device)
    kc0, vc0 = cache.k_buffers[0].clone(), cache.v_buffers[0].clone()
    expected = reference_attention(q, k, v, layer, batch, kc0, vc0, cache.req_to_token)
    backend.init_forward_metadata(batch)
    out = backend.forward(q, k, v, layer, batch, save_kv_cache=True)
    if device == "cuda":
        torch.cuda.synchronize()
    if tuple(out.shape) != tuple(expected.shape):
        return ModeResult(sc.label, False, error=f"output shape {tuple(out.shape)}, expected {tuple(expected.shape)}")
    got = out.detach().to(torch.float64).cpu()
    err = float((got - expected).abs().max()) if got.numel() else 0.0
    ok = bool(torch.allclose(got, expected, atol=atol, rtol=rtol)) and bool(torch.isfinite(got).all())
    kc1, vc1 = expected_cache_after(kc0, vc0, k, v, loc)
    cache_ok = torch.equal(cache.k_buffers[0], kc1) and torch.equal(cache.v_buffers[0], vc1)
    error = None
    if not ok:
        error = f"max |error| {err:.3g} above tolerance (atol={atol}, rtol={rtol})"
    if not cache_ok:
        error = (error + "; " if error else "") + "KV-cache write differs from the new k/v at out_cache_loc"
    return ModeResult(sc.label, ok and cache_ok, err, atol, error)


# -- the report ------------------------------------------------------------
def diagnose(registry: Any, host: Any = None, only: list[str] | None = None) -> dict[str, Any]:
    """Everything doctor checks, as a dict (``ok`` says whether the exit status is 0)."""
    from attnplug.config import AttentionConfig
    from attnplug.resolution import trace

    host = host or registry.host
    res = trace(AttentionConfig(), host=host, registry=registry)
    default = {"prefill": res.pair[0], "decode": res.pair[1], "ok": res.ok,
               "error": None if res.ok else f"{type(res.error).__name__}: {res.error}"}
    names = registry.names() if not only else [registry.canonical(n, host) for n in only]
    backends = [check_backend(registry, n, host) for n in names]
    failed = [b.name for b in backends if b.status == "failed"]
    return {
        "host": host.to_dict(),
        "host_line": host.describe(),
        "plugins": [p.to_dict() for p in registry.plugins],
        "failed_plugins": [p.to_dict() for p in registry.failed_plugins()],
        "conflicts": {n: str(e) for n, e in registry.conflicts.items()},
        "problems": list(registry.problems),
        "empty_hint": registry.empty_hint(),
        "default_pair": default,
        "backends": [b.to_dict() for b in backends],
        "failed": failed,
        "ok": not failed and res.ok,
    }


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
    else:
        lines.append(f"default pair: NOT RESOLVED: {d['error']}")
    rows = [("backend", "distribution", "version", "available", "modes checked", "max error", "time", "result")]
    for b in report["backends"]:
        avail = "yes" if b["available"] else "no: " + "; ".join(b["reasons"])
        modes = ",".join(m["mode"] + ("" if m["ok"] else "!") for m in b["modes"]) or "-"
        err = "-" if b["max_error"] is None else f"{b['max_error']:.2e}"
        secs = "-" if not b["available"] else f"{b['seconds'] * 1000:.0f}ms"
        result = {"ok": "ok", "failed": "FAILED", "skipped": "-"}[b["status"]]
        rows.append((b["name"], b["distribution"], b["version"], avail, modes, err, secs, result))
    avail_col, cap = 3, 40  # the "why not" can be long: cut in the table, spelled out below it
    rows = [r[:avail_col] + (_cut(r[avail_col], cap),) + r[avail_col + 1:] for r in rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    for b in report["backends"]:
        if not b["available"] and len("no: " + "; ".join(b["reasons"])) > cap:
            lines.append(f"  {b['name']} unavailable: " + "; ".join(b["reasons"]))
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
                               "FAILED: " + (", ".join(report["failed"]) or "no default pair")))
    return "\n".join(lines)


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
