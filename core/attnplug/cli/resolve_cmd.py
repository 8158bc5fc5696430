"""``attnplug resolve``: resolve the (prefill, decode) pair and explain it pass by pass.

Imports no torch and no kernel library: resolution reads descriptors only.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from attnplug.config import add_attention_args

    parser.add_argument("--arch", default=None, metavar="NAME",
                        help="model architecture (e.g. GptOssForCausalLM): applies the overrides plugins declare")
    g = add_attention_args(parser)
    g.add_argument("--deterministic", dest="deterministic", action="store_true",
                   help="same as --deterministic-inference")
    g.add_argument("--dtype", default=None, help="model dtype (float32, float16, bfloat16)")
    g.add_argument("--page-size", type=int, default=None, help="KV-cache page size in tokens")
    g.add_argument("--cuda-graph", action="store_true", default=False, help="require CUDA-graph capture")
    g.add_argument("--extra", action="append", default=[], metavar="KEY=VALUE", dest="extra_items",
                   help="a host switch rules may read (e.g. diffusion_lm=true, quantization=mxfp4); "
                        "VALUE is parsed as JSON when it can be; repeatable")
    parser.add_argument("--host-json", default=None, metavar="FILE",
                        help="explain a recorded host instead of this one (HostInfo as JSON)")
    parser.add_argument("--json", action="store_true", help="print the resolution as JSON")
    parser.add_argument("--list-overrides", action="store_true",
                        help="list the per-architecture overrides and resolution rules installed plugins declare")


def _extra(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--extra {item!r}: expected KEY=VALUE")
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    return out


def run(args: argparse.Namespace) -> int:
    from attnplug.config import config_from_args
    from attnplug.host import HostInfo
    from attnplug.registry import default_registry
    from attnplug.resolution import trace
    from attnplug.resolution.explain import overrides_table

    from attnplug.errors import AttnplugError, UnknownBackendError

    registry = default_registry()
    if args.list_overrides:
        try:
            view = registry.view()
            overrides, rules = list(view.overrides), list(view.rules)
        except AttnplugError as exc:  # a plugin's hook raised: it is named in the message
            print(f"attnplug resolve: {exc}", file=sys.stderr)
            return 1
        if args.json:
            print(json.dumps({"overrides": [o.to_dict() for o in overrides],
                              "rules": [r.to_dict() for r in rules]}, indent=2, sort_keys=True))
        else:
            print(overrides_table(overrides, rules))
        return 0
    try:
        host = HostInfo.from_json_file(args.host_json, source="--host-json") if args.host_json is not None else None
        config = config_from_args(args, extra=_extra(args.extra_items))
    except (OSError, ValueError, TypeError) as exc:
        print(f"attnplug resolve: {exc}", file=sys.stderr)
        return 2
    result = trace(config, arch=args.arch, host=host, registry=registry)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2, sort_keys=True, default=str))
    else:
        print(result.explain())
    if result.ok:
        return 0
    # a name the user gave that no plugin registers is a bad flag value (2); one whose plugin broke
    # is the plugin's fault, and a resolution that fails its checks is a failed check (1)
    err = result.error
    return 2 if isinstance(err, UnknownBackendError) and not getattr(err, "plugin_fault", False) else 1
