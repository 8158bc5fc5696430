"""torch_native's fused CPU kernels: built from ``csrc/attention.cpp`` (decode, short extends) and
``csrc/extend_tiled.cpp`` (the tiled kernel for long extends) into one library at first use, cached per
machine.

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
between machines never loads a library built for another CPU. The build is atomic and durable (a
private temporary folder, synced, renamed into place) and records the library's size and SHA-256
beside it (``<name>.so.sha256``); ``load()`` hands a cached file to ``dlopen`` only when it matches that
record, and removes and rebuilds one that does not (cut short, empty, replaced): a truncated library
would crash ``dlopen`` itself with SIGBUS. The library is mode 0755 (a cache shared between users
works). A compiler that runs longer than ``$ATTNPLUG_CXX_TIMEOUT`` seconds (default 120) is killed
with its children. A failed build is not an error:
``load()`` returns the reason, the backend keeps its eager decode and says why
(``TorchNativeBackend.fused_reason``).

Nothing here runs at import: the build happens when a backend is built with
``fused="auto"`` (the default) or ``"on"``.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import platform
import shutil
import signal
import subprocess
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Iterator

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: the kernel is built for Linux only anyway
    fcntl = None  # type: ignore[assignment]

SOURCE = Path(__file__).with_name("csrc") / "attention.cpp"


def sources() -> tuple[Path, Path, Path]:
    """Every file the library is built from (hashed into its cache name): ``SOURCE``, and beside it the
    tiled extend kernel ``extend_tiled.cpp`` and its header, compiled into the same library."""
    return SOURCE, SOURCE.with_name("extend_tiled.cpp"), SOURCE.with_name("extend_tiled.h")

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


class TiledArgs(ctypes.Structure):
    """Mirror of ``struct TiledArgs`` in extend_tiled.h (same order; the size is checked at load)."""

    _fields_ = [
        ("q", ctypes.c_void_p), ("q_st", ctypes.c_int64), ("q_sh", ctypes.c_int64),
        ("k", ctypes.c_void_p), ("k_ss", ctypes.c_int64), ("k_sh", ctypes.c_int64),
        ("v", ctypes.c_void_p), ("v_ss", ctypes.c_int64), ("v_sh", ctypes.c_int64),
        ("kn", ctypes.c_void_p), ("kn_st", ctypes.c_int64), ("kn_sh", ctypes.c_int64),
        ("vn", ctypes.c_void_p), ("vn_st", ctypes.c_int64), ("vn_sh", ctypes.c_int64),
        ("r2t", ctypes.c_void_p), ("r2t_s", ctypes.c_int64),
        ("plan", ctypes.c_void_p),
        ("o", ctypes.c_void_p), ("o_st", ctypes.c_int64), ("o_sh", ctypes.c_int64),
        ("sinks", ctypes.c_void_p),
        ("dtype", ctypes.c_int32), ("isa", ctypes.c_int32),
        ("B", ctypes.c_int32), ("Hkv", ctypes.c_int32), ("G", ctypes.c_int32),
        ("D", ctypes.c_int32), ("Dv", ctypes.c_int32), ("window", ctypes.c_int32),
        ("nthreads", ctypes.c_int32),
        ("scale", ctypes.c_float), ("cap", ctypes.c_float),
        ("num_slots", ctypes.c_int64), ("err", ctypes.c_void_p),
        ("parallel", ctypes.c_void_p),  # null: the library's OpenMP threads (torch's libgomp)
    ]


#: ``attnplug_extend_tiled``'s instruction sets (``TiledArgs.isa``; 0: the best this CPU runs)
TILED_ISAS = {"portable": 1, "avx2": 2, "avx512": 3, "avx512bf16": 4}
#: ``attnplug_extend_tiled``'s return code for an instruction set this CPU lacks
RC_ISA = 6

#: ``attnplug_fused_decode``'s return codes (0: done)
RC_SHAPE, RC_DTYPE, RC_BAD_SLOT, RC_NO_MEMORY, RC_SCRATCH_PLAN = 1, 2, 3, 4, 5
#: what ``DecodeArgs.err`` points at: code, work row, position, slot (the call's first failure)
ErrorRecord = ctypes.c_int64 * 4


def scratch_bytes(threads: int, heads: int, queries: int, group: int, keys: int, d: int, dv: int) -> int:
    """Bytes of per-thread scratch ``attention.cpp`` allocates (all threads) for work items of
    ``heads`` KV heads and up to ``queries`` queries over up to ``keys`` keys: float32 scores
    for every key of every row, the rows' queries, accumulators and sums, one block of widened
    rows."""
    rows, npad = heads * queries * group, -(-max(keys, 1) // 16) * 16
    return 4 * threads * (rows * (npad + d + dv + 2) + 17 * max(d, dv))


def tiled_scratch_bytes(threads: int, d: int, dv: int) -> int:
    """Bytes of per-thread scratch ``extend_tiled.cpp`` allocates (all threads; its ``scratch_floats``:
    128-row query tiles, 48-key tiles)."""
    rows, keys = 128, 48
    return 4 * threads * (d * rows + keys * rows + keys // 2 * rows + keys // 2 * dv + rows * dv + 5 * rows
                          + max(d, dv) + keys * (d + dv) + 64)


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


#: seconds a compile may run before it is killed (``$ATTNPLUG_CXX_TIMEOUT`` sets another limit): the
#: kernel compiles in seconds, so a compiler that hangs costs a process's first build at most this
COMPILE_TIMEOUT_S = 120.0
#: seconds ``$CXX --version`` may take (at most the compile limit)
VERSION_TIMEOUT_S = 10.0
TIMEOUT_ENV = "ATTNPLUG_CXX_TIMEOUT"
#: the cached library's mode: readable and loadable by every user of a shared cache
LIBRARY_MODE = 0o755
#: beside each cached library: ``sha256 <hex digest> size <bytes>`` of what the compiler produced
SIDECAR_SUFFIX = ".sha256"


def compile_timeout() -> float:
    """The compile limit in seconds (``$ATTNPLUG_CXX_TIMEOUT``, else ``COMPILE_TIMEOUT_S``); a
    ``ValueError`` naming the variable for a value that is not a positive number."""
    raw = os.environ.get(TIMEOUT_ENV, "").strip()
    if not raw:
        return COMPILE_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not (value > 0 and value != float("inf")):
        raise ValueError(f"${TIMEOUT_ENV}={raw!r} is not a positive number of seconds")
    return value


def _run(cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``subprocess.run`` in its own process group, killed whole (the compiler's children too) when
    ``timeout`` passes (then ``subprocess.TimeoutExpired``)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        proc.communicate()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def library_path(cxx: str) -> Path:
    try:
        version = _run([cxx, "--version"], min(VERSION_TIMEOUT_S, compile_timeout())).stdout
    except (OSError, ValueError, subprocess.SubprocessError) as exc:
        version = f"unknown ({exc})"
    h = hashlib.sha256()
    for part in (*(f.read_bytes() for f in sources()), version.encode(), " ".join(FLAGS).encode(), _cpu_identity().encode()):
        h.update(part)
        h.update(b"\0")
    return cache_dir() / f"torch_native_fused-{h.hexdigest()[:20]}.so"


def sidecar_path(library: Path) -> Path:
    """Where the size and digest of ``library`` are recorded at build."""
    return library.with_name(library.name + SIDECAR_SUFFIX)


def _digest(path: str | Path) -> tuple[int, str]:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
            size += len(block)
    return size, h.hexdigest()


def _fsync_write(path: str, data: bytes, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.chmod(path, mode)


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def verify(library: Path) -> str | None:
    """``None`` when ``library`` is byte for byte what its build recorded (size, then SHA-256), else
    why not. Nothing is loaded: a file cut short (a crash or a full disk during a copy, power loss
    after an un-synced rename) would crash ``dlopen`` itself (SIGBUS), so it is never handed to it."""
    side = sidecar_path(library)
    try:
        text = side.read_text(encoding="ascii", errors="replace").split()
    except FileNotFoundError:
        return f"its size and digest record {side.name} is missing"
    except OSError as exc:
        return f"its size and digest record {side.name} cannot be read ({exc.strerror or exc})"
    if len(text) != 4 or text[0] != "sha256" or text[2] != "size" or not text[3].isdigit():
        return f"its size and digest record {side.name} is malformed"
    want_digest, want_size = text[1], int(text[3])
    try:
        size = library.stat().st_size
        if size != want_size:
            return f"it is {size} bytes, {want_size} were built (cut short or replaced)"
        _, digest = _digest(library)
    except OSError as exc:
        return f"it cannot be read ({exc.strerror or exc})"
    if digest != want_digest:
        return "its SHA-256 differs from the one recorded at build (the file was changed or replaced)"
    return None


def _remove(library: Path) -> str | None:
    """Remove ``library`` and its record; ``None``, or why not."""
    for p in (library, sidecar_path(library)):
        try:
            p.unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            return f"cannot remove {p}: {exc.strerror or exc}"
    return None


@contextlib.contextmanager
def _build_lock(folder: Path, timeout: float) -> Iterator[str | None]:
    """Hold an exclusive lock on the cache folder (one build at a time per folder, across processes;
    no lock file is left behind). Yields ``None``, or why the lock was not taken within ``timeout``."""
    if fcntl is None:  # pragma: no cover
        yield None
        return
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError as exc:
        yield f"cannot open the kernel cache directory {folder}: {exc.strerror or exc}"
        return
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    yield (f"another process held the kernel cache directory {folder} for more than {timeout:g} s "
                           f"(a build that did not finish)")
                    return
                time.sleep(0.05)
            except OSError:  # a file system without locks: build unlocked (the renames stay atomic)
                break
        yield None
    finally:
        os.close(fd)  # releases the lock


def build(cxx: str, out: Path) -> str | None:
    """Compile ``SOURCE`` into ``out``; ``None`` on success, else why not (the compiler's last lines).

    Atomic and durable: the compiler writes into a private temporary folder (also its ``TMPDIR``);
    the library is made mode 0755, synced, its size and SHA-256 are written beside it
    (``sidecar_path``, synced), and both are renamed into place, the record first. A compiler
    still running after ``compile_timeout()`` seconds is killed with its children, and the
    temporary folder is removed whatever happened."""
    try:
        timeout = compile_timeout()
        out.parent.mkdir(parents=True, exist_ok=True)
        work = tempfile.mkdtemp(prefix=out.stem + ".", suffix=".tmp", dir=out.parent)
    except ValueError as exc:
        return str(exc)
    except OSError as exc:
        return f"cannot write the kernel cache directory {out.parent}: {exc}"
    try:
        tmp = os.path.join(work, out.name)
        env = dict(os.environ, TMPDIR=work)
        try:
            proc = _run([cxx, *FLAGS, *(str(f) for f in sources()[:2]), "-o", tmp], timeout, env)
        except subprocess.TimeoutExpired:
            return (f"{os.path.basename(cxx)} did not finish compiling {SOURCE.name} within {timeout:g} s "
                    f"(killed; ${TIMEOUT_ENV} sets the limit)")
        if proc.returncode != 0:
            tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
            return f"{os.path.basename(cxx)} failed to compile {SOURCE.name} (exit {proc.returncode}): {tail}"
        if not os.path.isfile(tmp):
            return f"{os.path.basename(cxx)} exited 0 but wrote no library for {SOURCE.name}"
        os.chmod(tmp, LIBRARY_MODE)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        size, digest = _digest(tmp)
        side = os.path.join(work, "record")
        _fsync_write(side, f"sha256 {digest} size {size}\n".encode(), 0o644)
        os.replace(side, sidecar_path(out))
        os.replace(tmp, out)
        _fsync_dir(out.parent)
        return None
    except (OSError, subprocess.SubprocessError) as exc:
        return f"running {cxx} failed: {exc}"
    finally:
        shutil.rmtree(work, ignore_errors=True)


@functools.lru_cache(maxsize=None)
def load() -> tuple[Any, str | None]:
    """``(library, None)``, or ``(None, why the fused kernel is unavailable)``; built once per
    machine, loaded once per process.

    A cached library is loaded only after ``verify`` found it byte for byte what its build
    recorded; one that is not (cut short, empty, replaced, its record missing) is removed and
    built again, with a ``RuntimeWarning`` saying why."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None, f"the fused CPU kernel is built for x86-64 Linux only (this is {platform.system()} " \
                     f"{platform.machine()})"
    for src in sources():
        if not src.is_file():
            return None, f"the fused CPU kernel's source {src} is missing (an incomplete install of attnplug-torch-native)"
    cxx = compiler()
    if cxx is None:
        named = f" ($CXX={os.environ['CXX']!r} is not an executable)" if os.environ.get("CXX") else ""
        return None, (f"no C++ compiler found ($CXX, g++ or c++ on PATH){named} to build the fused decode "
                      "kernel; install g++ to enable it")
    try:
        timeout = compile_timeout()
    except ValueError as exc:
        return None, str(exc)
    path = library_path(cxx)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return None, f"cannot write the kernel cache directory {path.parent}: {exc}"
    with _build_lock(path.parent, timeout + 30) as busy:
        if busy is not None and not path.exists():
            return None, busy
        bad = verify(path) if path.exists() else None
        if bad is not None:
            failed = _remove(path)
            if failed is not None:
                return None, f"the cached fused CPU kernel {path} is not loaded: {bad}; {failed}"
            warnings.warn(f"torch_native: the cached fused CPU kernel {path.name} was not loaded: {bad}; "
                          f"removed it and built it again", RuntimeWarning, stacklevel=2)
        if not path.exists():
            if busy is not None:
                return None, busy
            why = build(cxx, path)
            if why is not None:
                return None, why
            bad = verify(path)
            if bad is not None:
                _remove(path)
                return None, f"the fused CPU kernel {path} just built does not match its record: {bad}"
    why = None
    try:
        lib = ctypes.CDLL(str(path))
        lib.attnplug_fused_decode.argtypes = [ctypes.POINTER(DecodeArgs)]
        lib.attnplug_fused_decode.restype = ctypes.c_int
        lib.attnplug_fused_decode_args_size.restype = ctypes.c_int64
        if lib.attnplug_fused_decode_args_size() != ctypes.sizeof(DecodeArgs):
            why = (f"{path.name}: DecodeArgs is {lib.attnplug_fused_decode_args_size()} bytes in the "
                   f"library, {ctypes.sizeof(DecodeArgs)} in fused.py (the two definitions differ)")
        else:
            lib.attnplug_extend_tiled.argtypes = [ctypes.POINTER(TiledArgs)]
            lib.attnplug_extend_tiled.restype = ctypes.c_int
            lib.attnplug_extend_tiled_args_size.restype = ctypes.c_int64
            lib.attnplug_extend_tiled_isa.restype = ctypes.c_int32
        if why is None and lib.attnplug_extend_tiled_args_size() != ctypes.sizeof(TiledArgs):
            why = (f"{path.name}: TiledArgs is {lib.attnplug_extend_tiled_args_size()} bytes in the "
                   f"library, {ctypes.sizeof(TiledArgs)} in fused.py (the two definitions differ)")
    except (OSError, AttributeError) as exc:  # not a library, or not this one
        why = f"cannot load the fused CPU kernel {path}: {exc}"
    if why is None:
        return lib, None
    if _remove(path) is None:  # a bad library is not kept: the next process builds it again
        why += "; removed it, the next build retries"
    return None, why
