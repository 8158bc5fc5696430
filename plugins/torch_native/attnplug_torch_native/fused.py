"""torch_native's fused CPU kernel: built from ``csrc/attention.cpp`` at first use, cached per machine.

Why a compiled kernel: an eager decode over a paged cache gathers K/V (a copy of everything
it reads) before the matmuls read it again, which costs about as much as the attention
itself (issue 12: 1.4-2.5x the contiguous floor). ``attention.cpp`` reads every visible row
once, in place, widens bf16/fp16/fp8 rows to float32 in registers a block of 16 keys at a
time, and computes scores, softmax and the value sum in float32 (docs/performance.md).

The kernel is plain C++ (no torch header: it compiles in about a second) called through
``ctypes``. It is built with the C++ compiler named by ``$CXX`` (default ``g++``, else
``c++``) and ``-O3 -march=native -fopenmp``, into ``$ATTNPLUG_CACHE_DIR`` (default
``$XDG_CACHE_HOME/attnplug``, else ``~/.cache/attnplug``) under a name hashing the source,
the compiler's version, the flags and this CPU's model and feature flags, so a cache shared
between machines never loads a library built for another CPU. A failed build is not an error:
``load()`` returns the reason, the backend keeps its eager decode and says why
(``TorchNativeBackend.fused_reason``).

Nothing here runs at import: the build happens when a backend is built with
``fused="auto"`` (the default) or ``"on"``.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

SOURCE = Path(__file__).with_name("csrc") / "attention.cpp"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
#: the environment variable the factory reads for the ``fused`` knob
ENV = "ATTNPLUG_TORCH_NATIVE_FUSED"
MODES = ("auto", "on", "off")

#: dtype codes shared with attention.cpp
DTYPE_CODES = {"float32": 0, "bfloat16": 1, "float16": 2, "float8_e4m3fn": 3, "float8_e5m2": 4}


def dtype_code(dtype: Any) -> int:
    """attention.cpp's code of a torch dtype (``KeyError``-free: an unknown dtype is a ``ValueError``)."""
    name = str(dtype).rpartition(".")[2]
    if name not in DTYPE_CODES:
        raise ValueError(f"the fused CPU kernel has no code for dtype {dtype}")
    return DTYPE_CODES[name]


class DecodeArgs(ctypes.Structure):
    """Mirror of ``struct DecodeArgs`` in attention.cpp (same order; the size is checked at load)."""

    _fields_ = [
        ("q", ctypes.c_void_p), ("q_st", ctypes.c_int64), ("q_sh", ctypes.c_int64),
        ("k", ctypes.c_void_p), ("k_ss", ctypes.c_int64), ("k_sh", ctypes.c_int64),
        ("v", ctypes.c_void_p), ("v_ss", ctypes.c_int64), ("v_sh", ctypes.c_int64),
        ("kn", ctypes.c_void_p), ("kn_st", ctypes.c_int64), ("kn_sh", ctypes.c_int64),
        ("vn", ctypes.c_void_p), ("vn_st", ctypes.c_int64), ("vn_sh", ctypes.c_int64),
        ("r2t", ctypes.c_void_p), ("r2t_s", ctypes.c_int64),
        ("plan", ctypes.c_void_p),
        ("mask", ctypes.c_void_p), ("m_sb", ctypes.c_int64), ("m_sq", ctypes.c_int64),
        ("o", ctypes.c_void_p), ("o_st", ctypes.c_int64), ("o_sh", ctypes.c_int64),
        ("sinks", ctypes.c_void_p),
        ("q_dtype", ctypes.c_int32), ("kv_dtype", ctypes.c_int32), ("new_f32", ctypes.c_int32),
        ("B", ctypes.c_int32), ("Hkv", ctypes.c_int32), ("G", ctypes.c_int32),
        ("D", ctypes.c_int32), ("Dv", ctypes.c_int32), ("window", ctypes.c_int32),
        ("heads_per_item", ctypes.c_int32), ("nthreads", ctypes.c_int32),
        ("scale", ctypes.c_float), ("cap", ctypes.c_float),
        ("k_scale", ctypes.c_float), ("v_scale", ctypes.c_float),
        ("num_slots", ctypes.c_int64), ("err", ctypes.c_void_p),
    ]


#: ``attnplug_fused_decode``'s return codes (0: done)
RC_SHAPE, RC_DTYPE, RC_BAD_SLOT, RC_NO_MEMORY = 1, 2, 3, 4
#: what ``DecodeArgs.err`` points at: code, work row, position, slot (the call's first failure)
ErrorRecord = ctypes.c_int64 * 4


def scratch_bytes(threads: int, heads: int, queries: int, group: int, keys: int, d: int, dv: int) -> int:
    """Bytes of per-thread scratch ``attention.cpp`` allocates (all threads) for work items of
    ``heads`` KV heads and up to ``queries`` queries over up to ``keys`` keys: float32 scores
    for every key of every row, the rows' queries, accumulators and sums, one block of widened
    rows."""
    rows, npad = heads * queries * group, -(-max(keys, 1) // 16) * 16
    return 4 * threads * (rows * (npad + d + dv + 2) + 17 * max(d, dv))


def parse_mode(value: str | None, where: str) -> str:
    """``fused`` as given (``None``: ``"auto"``); a clear error naming ``where`` otherwise."""
    mode = "auto" if value in (None, "") else str(value).strip().lower()
    if mode not in MODES:
        raise ValueError(f"torch_native: {where} must be one of {', '.join(MODES)}, got {value!r}")
    return mode


def cache_dir() -> Path:
    explicit = os.environ.get("ATTNPLUG_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "attnplug"


def compiler() -> str | None:
    """The C++ compiler to use: ``$CXX``, else ``g++``, else ``c++`` (``None``: none on PATH)."""
    cxx = os.environ.get("CXX")
    if cxx:
        return shutil.which(cxx) or (cxx if os.path.isfile(cxx) else None)
    return shutil.which("g++") or shutil.which("c++")


def _cpu_identity() -> str:
    """This CPU's model and feature flags (what ``-march=native`` compiles for)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [ln for ln in text.splitlines() if ln.split(":")[0].strip() in ("model name", "flags", "Features")]
    return "\n".join(sorted(set(keep))) + platform.machine()


def library_path(cxx: str) -> Path:
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        version = f"unknown ({exc})"
    h = hashlib.sha256()
    for part in (SOURCE.read_bytes(), version.encode(), " ".join(FLAGS).encode(), _cpu_identity().encode()):
        h.update(part)
        h.update(b"\0")
    return cache_dir() / f"torch_native_fused-{h.hexdigest()[:20]}.so"


def build(cxx: str, out: Path) -> str | None:
    """Compile ``SOURCE`` into ``out`` (atomically: a temporary file, then a rename); ``None`` on
    success, else why not (the compiler's last lines)."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=out.stem + ".", suffix=".tmp.so", dir=out.parent)
        os.close(fd)
    except OSError as exc:
        return f"cannot write the kernel cache directory {out.parent}: {exc}"
    try:
        proc = subprocess.run([cxx, *FLAGS, str(SOURCE), "-o", tmp], capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
            return f"{os.path.basename(cxx)} failed to compile {SOURCE.name} (exit {proc.returncode}): {tail}"
        os.replace(tmp, out)
        return None
    except (OSError, subprocess.SubprocessError) as exc:
        return f"running {cxx} failed: {exc}"
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.lru_cache(maxsize=None)
def load() -> tuple[Any, str | None]:
    """``(library, None)``, or ``(None, why the fused kernel is unavailable)``; built once per
    machine, loaded once per process."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None, f"the fused CPU kernel is built for x86-64 Linux only (this is {platform.system()} " \
                     f"{platform.machine()})"
    if not SOURCE.is_file():
        return None, f"the fused CPU kernel's source {SOURCE} is missing (an incomplete install of attnplug-torch-native)"
    cxx = compiler()
    if cxx is None:
        named = f" ($CXX={os.environ['CXX']!r} is not an executable)" if os.environ.get("CXX") else ""
        return None, (f"no C++ compiler found ($CXX, g++ or c++ on PATH){named} to build the fused decode "
                      "kernel; install g++ to enable it")
    path = library_path(cxx)
    if not path.exists():
        why = build(cxx, path)
        if why is not None:
            return None, why
    why = None
    try:
        lib = ctypes.CDLL(str(path))
        lib.attnplug_fused_decode.argtypes = [ctypes.POINTER(DecodeArgs)]
        lib.attnplug_fused_decode.restype = ctypes.c_int
        lib.attnplug_fused_decode_args_size.restype = ctypes.c_int64
        if lib.attnplug_fused_decode_args_size() != ctypes.sizeof(DecodeArgs):
            why = (f"{path.name}: DecodeArgs is {lib.attnplug_fused_decode_args_size()} bytes in the "
                   f"library, {ctypes.sizeof(DecodeArgs)} in fused.py (the two definitions differ)")
    except (OSError, AttributeError) as exc:  # not a library, or not this one
        why = f"cannot load the fused CPU kernel {path}: {exc}"
    if why is None:
        return lib, None
    try:  # a bad library is not kept: the next process builds it again
        path.unlink()
        why += "; removed it, the next build retries"
    except OSError:
        pass
    return None, why
