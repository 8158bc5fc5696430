"""``attnplug list``: every discovered backend. Imports neither torch nor any kernel library."""

from __future__ import annotations

import argparse
import json
from typing import Any

from ..capabilities import RESTRICTIONS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON (backends, plugins, host, problems)")


def collect(registry: Any) -> dict[str, Any]:
    host = registry.host
    # first ask every probe and priority function: a plugin that answers with the wrong type is
    # set aside (its record says why), so the table below only lists what is still registered
    registry.settle(host)
    # and every resolution hook (the default resolution, once per declared architecture): a plugin whose
    # hook raises or answers with a malformed value is set aside and listed as failed, with the reason
    from ..resolution.chain import vet_hooks

    vet_hooks(registry, host)
    backends = []
    for name in registry.names():
        desc = registry.get(name)
        avail = registry.availability(name, host)
        entry = desc.to_dict()
        entry.update(available=avail.available, reasons=list(avail.reasons), priority=registry.priority(name, host))
        backends.append(entry)
    return {
        "host": host.to_dict(),
        "backends": backends,
        "plugins": [p.to_dict() for p in registry.plugins],
        "kv_layouts": registry.layout_names(),
        "kv_layout_conflicts": dict(registry.layout_conflicts),
        "conflicts": {n: str(e) for n, e in registry.conflicts.items()},
        "problems": list(registry.problems),
        "empty_hint": registry.empty_hint(),
    }


def run(args: argparse.Namespace) -> int:
    from attnplug.registry import default_registry

    data = collect(default_registry())
    if args.json:
        print(json.dumps(data, indent=2, sort_keys=True))
        return 0
    print(f"host: {_host_line(data['host'])}")
    rows: list[tuple[str, ...]] = [("backend", "distribution", "version", "aliases", "available")]
    for b in data["backends"]:
        aliases = ",".join(b["aliases"] + [f"{a}(deprecated)" for a in b["deprecated_aliases"]]) or "-"
        status = "yes" if b["available"] else "no: " + "; ".join(b["reasons"])
        rows.append((b["name"], b["distribution"], b["version"], aliases, status))
    _table(rows)
    for b in data["backends"]:
        caps = b["capabilities"]
        flags = [k for k, v in sorted(caps.items()) if v is True and k not in RESTRICTIONS]
        kv = ",".join(caps["kv_cache_dtypes"]) or "model dtype"
        if caps.get("kv_cache_dtype_follows_model"):
            kv += " (non-fp8: the model dtype only)"
        layouts = ",".join(caps["kv_layouts"]) if caps["kv_layouts"] is not None else "any"
        print(f"  {b['name']}: dtypes={','.join(caps['dtypes'])} kv_cache_dtypes={kv} kv_layouts={layouts} "
              f"devices={','.join(caps['devices'])} head_dims={caps['head_dims'] or 'any'} "
              f"page_sizes={caps['page_sizes'] or 'any'} features={','.join(flags) or '-'}")
        if b["description"]:
            print(f"    {b['description']}")
    print("kv layouts: " + ", ".join(f"{n} ({owner})" for n, owner in sorted(data["kv_layouts"].items())))
    for msg in data["kv_layout_conflicts"].values():
        print(f"conflict: {msg}")
    for p in data["plugins"]:
        if p["status"] != "loaded":
            print(f"plugin {p['distribution']} {p['version']} ({p['name']}): {p['status']}: {p['error']}")
    for msg in data["conflicts"].values():
        print(f"conflict: {msg}")
    for msg in data["problems"]:
        print(f"note: {msg}")
    if not data["backends"]:
        print(data["empty_hint"])
    return 0


def _host_line(h: dict[str, Any]) -> str:
    from attnplug.host import HostInfo

    return HostInfo.from_dict(h).describe()


def _table(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1])
