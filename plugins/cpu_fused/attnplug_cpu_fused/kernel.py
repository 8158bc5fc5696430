"""The cpu_fused kernel library: the ops ``torch.ops.attnplug_cpu_fused.attend`` (and ``attend_write``) and their fakes.

The library ``attnplug_cpu_fused/_C*.so`` is compiled at install (``setup.py``: ``csrc/attention.cpp``
once per instruction set, ``csrc/ops.cpp`` registering the op with ``TORCH_LIBRARY``); ``load()``
hands it to ``torch.ops.load_library`` once per process and registers the fake (meta)
implementation, so ``torch.library.opcheck`` and ``torch.compile(fullgraph=True)`` see an op
with a schema that mutates ``out`` and ``work`` (its error record) and returns nothing. ``attend_write`` is
``attend`` into a fresh output it returns, then, once the attention returned, the forward's new K/V rows
written into the caches at the given slots (its schema declares ``k_cache``, ``v_cache`` and ``work``
mutated): the skeleton's write after the kernel in the same call. Which variant runs
(``avx512bf16``, ``avx512``, ``avx2``, ``portable``) is chosen inside the library from cpuid
(``isa()``); ``$ATTNPLUG_CPU_FUSED_ISA`` asks for a lower one (tests, benchmarks).

Why a compiled kernel: an eager decode over a paged cache gathers K/V (a copy of everything it
reads) before the matmuls read it again, which costs about as much as the attention itself
(issue 12). ``attention.cpp`` reads every visible row once, in place, widens bf16/fp16/fp8 rows to
float32 in registers a block of 16 keys at a time (or, for bf16 on AVX-512 BF16, dots them as
stored with ``vdpbf16ps``; where AMX is usable, ``tdpbf16ps`` tiles for the scores and the value sum,
the probabilities as two bf16 parts: ``csrc/amx.h``, ``$ATTNPLUG_CPU_FUSED_AMX=0`` turns it off), and
computes scores, softmax and the value sum in float32.
"""

from __future__ import annotations

import functools
import glob
import hashlib
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

#: the op's namespace (TORCH_LIBRARY in ops.cpp)
LIBRARY = "attnplug_cpu_fused"
#: the kernel variants, best first (ops.cpp picks the first this CPU runs)
ISAS = ("avx512bf16", "avx512", "avx2", "portable")
ISA_ENV = "ATTNPLUG_CPU_FUSED_ISA"

#: each ISA variant's translation unit (csrc/isa_<name>.cpp, which includes attention.cpp) and its
#: -m flags; setup.py reads this table (by path: it cannot import the package)
ISA_FLAGS = {
    "avx512bf16": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mfma", "-mf16c"],
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "portable": [],
}

#: the kernel's failure codes (kernel.h), recorded in ``attend``'s ``work`` (``work[0, WORK_ERR:]``: code, work
#: row, position, slot value) and in ``extend_tiled``'s ``err`` tensor
RC_SHAPE, RC_DTYPE, RC_BAD_SLOT, RC_NO_MEMORY, RC_SCRATCH_PLAN = 1, 2, 3, 4, 5
#: ``attend``'s ``work`` tensor (ops.cpp): int64 ``[1 + B + M, 8]``, row 0 the header (B, KV heads per work item,
#: the target-verify mask's side E (0: none), at ``WORK_THREADS`` the distinct threads the last call ran its work
#: items on (written by each call: torch's intra-op pool reached or not), then the error record from column
#: ``WORK_ERR``), the plan's B rows, then the mask ``[B, E, E]`` as bytes in M = ceil(B E E / 64) rows; built once
#: per forward
WORK_COLS, WORK_THREADS, WORK_ERR = 8, 3, 4
#: ``attend``'s ``params`` (float64, once per layer): group, window (-1: none), scale, cap (0: none), k_scale,
#: v_scale, sinks (0 / 1), then the H sinks when that is 1
PARAMS = 7
#: the tiled extend kernel's instruction sets (``extend_tiled``'s ``isa``; 0: the best this CPU runs).
#: ``amx``: AVX-512 BF16 + AMX-TILE + AMX-BF16 with the tile data granted by Linux (bf16 through
#: ``tdpbf16ps`` tiles, float32 as three bf16 parts, six products); ``$ATTNPLUG_CPU_FUSED_AMX=0``
#: makes a process behave as if AMX were refused (its best is then ``avx512bf16``)
TILED_ISAS = {"portable": 1, "avx2": 2, "avx512": 3, "avx512bf16": 4, "amx": 5}
#: ``extend_tiled``'s code for an instruction set this CPU lacks
RC_ISA = 6
#: bf16 long extends on a CPU with AVX-512 BF16 and no usable AMX run through ``vdpbf16ps`` (isa ``avx512bf16``)
#: where its flops a cycle, measured once a process against the float32 FMA's and rounded to a power of two,
#: are at least this many times the FMA's, else widened to float32 and the FMA tiles (isa ``avx512``);
#: ``extend_tiled.cpp``'s ``DP_PAYS_AT`` (docs/performance.md, "Non-AMX extend, fourth round (kext3)")
DPBF16_PAYS_AT = 1.0
#: ``$ATTNPLUG_CPU_FUSED_DPBF16_RATE``: a positive number taken as that measured ratio instead of measuring
#: (tests and what-ifs: "this CPU issues vdpbf16ps at the FMA's rate" is 2)
DPBF16_RATE_ENV = "ATTNPLUG_CPU_FUSED_DPBF16_RATE"


def library_path() -> str | None:
    """The compiled library installed with this package (``None``: not built, an incomplete install)."""
    here = os.path.dirname(os.path.abspath(__file__))
    found = sorted(glob.glob(os.path.join(here, "_C*.so")))
    return found[0] if found else None


def scratch_bytes(threads: int, heads: int, queries: int, group: int, keys: int, d: int, dv: int,
                  amx: bool = False) -> int:
    """Bytes of per-thread scratch ``attention.cpp`` allocates (all threads) for work items of
    ``heads`` KV heads and up to ``queries`` queries over up to ``keys`` keys: float32 scores
    for every key of every row, the rows' queries, accumulators and sums, one block of widened
    rows. ``amx``: a bf16 layer that may run on AMX tiles (its ``tl_amx`` buffer too: each head's queries
    in the VNNI layout, one block of key rows and a score tile, and, where ``dv`` is a multiple of 32, P
    as two bf16 parts over the keys rounded up to 32 and one block's V pairs)."""
    rows, npad = heads * queries * group, -(-max(keys, 1) // 16) * 16
    floats = rows * (npad + d + dv + 2) + 17 * max(d, dv)
    if amx:
        floats += heads * d * 8 + 16 * d // 2 + 16 * 16
        if dv % 32 == 0:
            floats += rows * (-(-npad // 32) * 32) + 16 * dv
    return 4 * threads * floats


def tiled_scratch_bytes(threads: int, d: int, dv: int) -> int:
    """Bytes of per-thread scratch ``extend_tiled.cpp`` allocates (all threads; its ``scratch_floats``:
    the larger of the FMA tiles' (128-row query tiles, 48-key tiles) and the AMX tiles' (256-row query
    tiles, 64-key tiles, D padded to 32, every operand in three bf16 parts for float32) layouts)."""
    rows, keys = 128, 48
    fma = (d * rows + keys * rows + keys // 2 * rows + keys // 2 * dv + rows * dv + 5 * rows
           + max(d, dv) + keys * (d + dv) + 64)
    dp, akt, am = -(-d // 32) * 32, 64, 256
    amx = (am * dv + am * akt + 3 * am * akt // 2 + 3 * am * dp // 2 + 3 * dp * akt // 2 + 3 * akt * dv // 2
           + 4 * am + max(dp, dv) + 16)
    return 4 * threads * max(fma, amx)


@functools.cache
def load() -> tuple[Any, str | None]:
    """``(op, None)`` — the ``attend`` OpOverload — or ``(None, why there is no compiled kernel)``;
    loaded once per process."""
    path = library_path()
    if path is None:
        return None, ("no compiled kernel for this platform: attnplug_cpu_fused/_C*.so is missing (the package "
                      "was installed without its extension; reinstall it with a C++ compiler, or a wheel)")
    import torch

    try:
        torch.ops.load_library(path)
        op = torch.ops.attnplug_cpu_fused.attend.default
        isa = torch.ops.attnplug_cpu_fused.isa()
    except (OSError, RuntimeError, AttributeError) as exc:
        return None, f"no compiled kernel for this CPU / platform: {os.path.basename(path)} does not load ({exc})"
    _register_fake()
    _ = isa
    return op, None


def tiled_bf16_body() -> tuple[str, str]:
    """The body a bf16 long extend runs at ``tiled_isa = 0`` in this process — ``amx``, ``vdpbf16ps`` or
    ``widened`` (to float32, the FMA tiles) — and why, in words (the measured ``vdpbf16ps`` rate where it
    decided). Loads the library; the rate is measured on the first call (about 20 us). Raises ``ValueError``
    naming ``$ATTNPLUG_CPU_FUSED_DPBF16_RATE`` when it is set to anything but a positive number."""
    import math

    import torch

    op, why = load()
    if op is None:
        raise RuntimeError(why)
    env = os.environ.get(DPBF16_RATE_ENV, "")
    if env:
        try:
            ok = math.isfinite(float(env)) and float(env) > 0
        except ValueError:
            ok = False
        if not ok:
            raise ValueError(f"${DPBF16_RATE_ENV}={env!r}: expected a positive number (vdpbf16ps flops a cycle "
                             f"over the float32 FMA's, e.g. 2), or unset to measure it")
    code, ratio, rounded, how = torch.ops.attnplug_cpu_fused.tiled_bf16_isa()
    best = int(torch.ops.attnplug_cpu_fused.tiled_isa())
    if code == TILED_ISAS["amx"]:
        return "amx", "AMX tiles (tdpbf16ps)"
    if best < TILED_ISAS["avx512bf16"]:
        return "widened", "widened to float32, the FMA tiles (this CPU has no AVX-512 BF16)"
    if env and how != 2:
        raise ValueError(f"${DPBF16_RATE_ENV}={env!r} was not taken by the kernel library (it read it as "
                         f"{ratio:g})")
    src = f"set by ${DPBF16_RATE_ENV}" if how == 2 else "measured"
    rate = (f"vdpbf16ps {src} at {ratio:.2f}x the float32 FMA's flops a cycle, which rounds to {rounded:g}; "
            f"vdpbf16ps from {DPBF16_PAYS_AT:g}")
    if code == TILED_ISAS["avx512bf16"]:
        return "vdpbf16ps", f"vdpbf16ps ({rate})"
    return "widened", f"widened to float32, the FMA tiles ({rate})"


def isa() -> str:
    """The kernel variant this process runs (loads the library)."""
    import torch

    op, why = load()
    if op is None:
        raise RuntimeError(why)
    return str(torch.ops.attnplug_cpu_fused.isa())


@functools.cache
def _register_fake() -> None:
    import torch

    @torch.library.register_fake(f"{LIBRARY}::attend")
    def _attend_fake(q, k_new, v_new, k_cache, v_cache, req_to_token, params, work, out):  # type: ignore[no-untyped-def]
        """Shapes and dtypes only: the op writes rows of ``out`` and ``work``'s error record in place, returns
        nothing."""
        torch._check(q.dim() == 3 and out.dim() == 3, lambda: "attnplug_cpu_fused::attend: q and out must be 3-d")
        torch._check(out.dtype == q.dtype, lambda: f"attnplug_cpu_fused::attend: out is {out.dtype}, q is {q.dtype}")
        torch._check(work.dtype == torch.int64 and work.dim() == 2 and work.shape[1] == WORK_COLS,
                     lambda: "attnplug_cpu_fused::attend: work must be int64 [1 + B + M, 8]")
        torch._check(params.dtype == torch.float64 and params.dim() == 1,
                     lambda: "attnplug_cpu_fused::attend: params must be float64 [7] or [7 + H]")
        return None

    @torch.library.register_fake(f"{LIBRARY}::attend_write")
    def _attend_write_fake(q, k_new, v_new, k_cache, v_cache, req_to_token, params, work, slots):  # type: ignore[no-untyped-def]
        """Shapes and dtypes only: a fresh ``[T, H, Dv]`` output in q's dtype; the op writes the new rows into
        ``k_cache`` / ``v_cache`` (and ``work``'s error record) in place."""
        torch._check(q.dim() == 3 and k_cache.dim() == 3 and v_cache.dim() == 3,
                     lambda: "attnplug_cpu_fused::attend_write: q, k_cache and v_cache must be 3-d")
        torch._check(k_new.dtype == k_cache.dtype and v_new.dtype == v_cache.dtype,
                     lambda: "attnplug_cpu_fused::attend_write: k_new/v_new must be in the caches' dtype")
        torch._check(slots.dtype == torch.int64 and slots.dim() == 1,
                     lambda: "attnplug_cpu_fused::attend_write: slots must be int64 [T]")
        torch._check(work.dtype == torch.int64 and work.dim() == 2 and work.shape[1] == WORK_COLS,
                     lambda: "attnplug_cpu_fused::attend_write: work must be int64 [1 + B + M, 8]")
        return q.new_empty((q.shape[0], q.shape[1], v_cache.shape[2]))

    @torch.library.register_fake(f"{LIBRARY}::extend_tiled")
    def _extend_tiled_fake(q, k_new, v_new, k_cache, v_cache, req_to_token, plan, sinks, out, err,  # type: ignore[no-untyped-def]
                           group, window, isa, scale, cap):
        """Shapes and dtypes only: the op writes rows of ``out`` and ``err`` in place, returns nothing."""
        torch._check(out.dtype == q.dtype, lambda: f"attnplug_cpu_fused::extend_tiled: out is {out.dtype}, q is {q.dtype}")
        return None


def build_inplace(cxx: str | None = None) -> str:
    """Compile ``csrc/`` into this package folder's ``_C`` library with ``setup.py``'s flags and return
    its path: a developer tool (``scripts/mutate.py``'s build check rebuilds a mutated
    ``attention.cpp``), never called by the backend. ``ops.cpp``'s object is kept in ``csrc/build/``
    and rebuilt only when ``ops.cpp`` or ``kernel.h`` change; the ISA variants compile in parallel."""
    import sysconfig

    import torch
    from torch.utils.cpp_extension import include_paths, library_paths

    here = os.path.dirname(os.path.abspath(__file__))
    csrc = os.path.join(here, "csrc")
    out_dir = os.path.join(csrc, "build")
    os.makedirs(out_dir, exist_ok=True)
    cxx = cxx or os.environ.get("CXX") or "c++"
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    common = ["-O3", "-std=c++17", "-fPIC", f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]
    torch_flags = [*(f"-I{p}" for p in include_paths()), f"-I{sysconfig.get_paths()['include']}",
                   "-DTORCH_EXTENSION_NAME=_C", "-DTORCH_API_INCLUDE_EXTENSION_H", "-fopenmp"]

    def compile_one(src: str, flags: list[str], obj: str) -> None:
        proc = subprocess.run([cxx, *common, *flags, "-c", os.path.join(csrc, src), "-o", obj],
                              capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(f"{cxx} failed on {src}: {proc.stderr.strip().splitlines()[-1:]}")

    key = hashlib.sha256(b"".join(open(os.path.join(csrc, f), "rb").read()
                                  for f in ("ops.cpp", "kernel.h", "extend_tiled.h")))
    ops_obj = os.path.join(out_dir, f"ops-{key.hexdigest()[:16]}.o")
    jobs = [(f"isa_{name}.cpp", flags, os.path.join(out_dir, f"isa_{name}.o")) for name, flags in ISA_FLAGS.items()]
    jobs.append(("extend_tiled.cpp", ["-fopenmp"], os.path.join(out_dir, "extend_tiled.o")))
    if not os.path.exists(ops_obj):
        jobs.insert(0, ("ops.cpp", torch_flags, ops_obj))
    def stale(src: str, obj: str) -> bool:  # an object older than its source or a shared header
        deps = [src, "attention.cpp", "kernel.h", "amx.h", "extend_tiled.h"] if src.startswith("isa_") else [src, "extend_tiled.h"]
        return not os.path.exists(obj) or any(os.path.getmtime(os.path.join(csrc, d)) > os.path.getmtime(obj)
                                              for d in deps)

    todo = [job for job in jobs if job[0] == "ops.cpp" or stale(job[0], job[2])]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        for f in [pool.submit(compile_one, *job) for job in todo]:
            f.result()
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    lib = os.path.join(here, f"_C{suffix}")
    objs = [ops_obj, *(job[2] for job in jobs if job[0] != "ops.cpp")]
    link = [cxx, "-shared", "-fopenmp", *objs, *(f"-L{p}" for p in library_paths()), "-lc10", "-ltorch_cpu",
            "-ltorch", "-o", lib + ".tmp"]
    proc = subprocess.run(link, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"linking {lib} failed: {proc.stderr.strip().splitlines()[-1:]}")
    os.replace(lib + ".tmp", lib)
    return lib


if __name__ == "__main__":  # python -m attnplug_cpu_fused.kernel build: build_inplace()
    if sys.argv[1:] == ["build"]:
        print(build_inplace())
    else:
        sys.exit("usage: python -m attnplug_cpu_fused.kernel build")
