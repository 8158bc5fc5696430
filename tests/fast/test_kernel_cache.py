"""torch_native's compiled-kernel cache under a broken disk, a hanging compiler and other users
(issue 26, items 1 and 16).

A cached library is handed to ``dlopen`` only after its size and SHA-256 match the record written
beside it at build: a file cut short would crash ``dlopen`` itself (SIGBUS, exit 135, in every later
process). Every scenario runs ``fused.load()`` in a fresh interpreter and asserts a clean exit
status (never a signal), the library loaded again, and one warning line saying what was wrong.

The "compiler" is a script copying a library built once with the real g++ (a rebuild costs
nothing), so the scenarios run in seconds; ``$ATTNPLUG_CACHE_DIR`` is a temporary folder.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from attnplug_torch_native import fused

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64") or shutil.which("g++") is None,
    reason="the fused kernel is built for x86-64 Linux with g++",
)

LOAD = """
import json, warnings
from attnplug_torch_native import fused
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    lib, why = fused.load()
print(json.dumps({"loaded": lib is not None, "why": why, "warnings": [str(w.message) for w in caught]}))
"""


@pytest.fixture(scope="module")
def prebuilt(tmp_path_factory) -> Path:
    """The real kernel, compiled once with g++ (about 5 s)."""
    out = tmp_path_factory.mktemp("prebuilt") / "kernel.so"
    subprocess.run(["g++", *fused.FLAGS, str(fused.SOURCE), "-o", str(out)], check=True, timeout=600)
    return out


def script(folder: Path, name: str, body: str) -> Path:
    path = folder / name
    path.write_text("#!/bin/sh\n" + textwrap.dedent(body))
    path.chmod(0o755)
    return path


@pytest.fixture
def copycxx(tmp_path, prebuilt) -> Path:
    """A "compiler" that writes the prebuilt library to its ``-o`` path and counts its builds."""
    return script(tmp_path, "copycxx", f"""\
        [ "$1" = "--version" ] && {{ echo "copycxx 1.0"; exit 0; }}
        while [ "$#" -gt 0 ]; do [ "$1" = "-o" ] && out="$2"; shift; done
        echo built >> "{tmp_path}/builds"
        [ -n "$COPYCXX_SLEEP" ] && sleep "$COPYCXX_SLEEP"
        cp "{prebuilt}" "$out"
    """)


def child(cache: Path, cxx: Path, env: dict[str, str] | None = None, timeout: float = 120,
          umask: int | None = None) -> subprocess.Popen:
    full = {k: v for k, v in os.environ.items() if not k.startswith("ATTNPLUG_")}
    full.update(ATTNPLUG_CACHE_DIR=str(cache), CXX=str(cxx), **(env or {}))
    pre = (lambda: os.umask(umask)) if umask is not None else None
    return subprocess.Popen([sys.executable, "-c", LOAD], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=full, preexec_fn=pre)


def load_in_child(cache: Path, cxx: Path, **kw) -> dict:
    proc = child(cache, cxx, **kw)
    out, err = proc.communicate(timeout=kw.get("timeout", 120))
    assert proc.returncode == 0, f"fused.load() ended the process with status {proc.returncode}: {err}"
    return json.loads(out.strip().splitlines()[-1])


def the_library(cache: Path) -> Path:
    libs = sorted(cache.glob("*.so"))
    assert len(libs) == 1, libs
    return libs[0]


def builds(tmp_path: Path) -> int:
    f = tmp_path / "builds"
    return len(f.read_text().split()) if f.exists() else 0


def foreign_elf(data: bytes) -> bytes:
    import _ctypes

    return Path(_ctypes.__file__).read_bytes()  # a real shared object, not this kernel


def corrupt_record(lib: Path, text: str | None) -> None:
    side = fused.sidecar_path(lib)
    if text is None:
        side.unlink()
    else:
        side.write_text(text)


LIBRARY_DAMAGE = {
    "empty": (lambda d: b"", "it is 0 bytes"),
    "truncated-64": (lambda d: d[:64], "it is 64 bytes"),
    "truncated-4096": (lambda d: d[:4096], "it is 4096 bytes"),
    "truncated-half": (lambda d: d[: len(d) // 2], "cut short or replaced"),
    "truncated-one-byte": (lambda d: d[:-1], "cut short or replaced"),
    "grown": (lambda d: d + b"\0" * 100, "cut short or replaced"),
    "random-bytes": (lambda d: bytes((i * 7919 + 13) % 256 for i in range(len(d))), "its SHA-256 differs"),
    "foreign-elf": (foreign_elf, "cut short or replaced"),
    "one-byte-flipped": (lambda d: d[:100] + bytes([d[100] ^ 0xFF]) + d[101:], "its SHA-256 differs"),
}

RECORD_DAMAGE = {
    "record-missing": (None, "is missing"),
    "record-malformed": ("not a record\n", "is malformed"),
    "record-other-digest": ("sha256 " + "0" * 64 + " size {size}\n", "its SHA-256 differs"),
    "record-other-size": ("sha256 {digest} size 12\n", "cut short or replaced"),
}


def check_repaired(tmp_path: Path, cache: Path, cxx: Path, fragment: str, prebuilt: Path) -> None:
    before = builds(tmp_path)
    got = load_in_child(cache, cxx)  # a clean exit status is asserted inside: never a signal
    assert got["loaded"] and got["why"] is None, got
    assert len(got["warnings"]) == 1, got["warnings"]
    lib = the_library(cache)
    assert lib.name in got["warnings"][0] and fragment in got["warnings"][0], got["warnings"][0]
    assert "removed it and built it again" in got["warnings"][0]
    assert builds(tmp_path) == before + 1
    assert lib.read_bytes() == prebuilt.read_bytes() and fused.verify(lib) is None
    again = load_in_child(cache, cxx)  # repaired for good: the next process loads it silently
    assert again == {"loaded": True, "why": None, "warnings": []}
    assert builds(tmp_path) == before + 1


@pytest.mark.parametrize("damage", sorted(LIBRARY_DAMAGE))
def test_a_damaged_cached_library_is_rebuilt_never_loaded(tmp_path, copycxx, prebuilt, damage):
    cache = tmp_path / "cache"
    first = load_in_child(cache, copycxx)
    assert first == {"loaded": True, "why": None, "warnings": []}
    lib = the_library(cache)
    change, fragment = LIBRARY_DAMAGE[damage]
    lib.write_bytes(change(lib.read_bytes()))
    check_repaired(tmp_path, cache, copycxx, fragment, prebuilt)


@pytest.mark.parametrize("damage", sorted(RECORD_DAMAGE))
def test_a_missing_or_wrong_record_is_rebuilt(tmp_path, copycxx, prebuilt, damage):
    cache = tmp_path / "cache"
    assert load_in_child(cache, copycxx)["loaded"]
    lib = the_library(cache)
    size, digest = len(lib.read_bytes()), __import__("hashlib").sha256(lib.read_bytes()).hexdigest()
    text, fragment = RECORD_DAMAGE[damage]
    corrupt_record(lib, None if text is None else text.format(size=size, digest=digest))
    check_repaired(tmp_path, cache, copycxx, fragment, prebuilt)


def test_a_library_left_by_an_older_version_without_a_record_is_rebuilt(tmp_path, copycxx, prebuilt):
    """The cache of a version before records: same name, no record; verified like any damage."""
    cache = tmp_path / "cache"
    assert load_in_child(cache, copycxx)["loaded"]
    lib = the_library(cache)
    fused.sidecar_path(lib).unlink()
    lib.write_bytes(prebuilt.read_bytes()[:5000])  # and cut short, as a crash during a copy leaves it
    check_repaired(tmp_path, cache, copycxx, "is missing", prebuilt)


def test_the_cached_library_is_usable_by_other_users_whatever_the_umask(tmp_path, copycxx):
    cache = tmp_path / "cache"
    assert load_in_child(cache, copycxx, umask=0o077)["loaded"]
    lib = the_library(cache)
    assert stat.S_IMODE(lib.stat().st_mode) == 0o755
    assert stat.S_IMODE(fused.sidecar_path(lib).stat().st_mode) == 0o644
    assert sorted(p.name for p in cache.iterdir()) == [lib.name, fused.sidecar_path(lib).name]


def test_processes_starting_at_once_build_once(tmp_path, copycxx):
    """Three processes with an empty cache: one builds (under a lock on the cache folder, no lock
    file left), the others wait and load what it built."""
    cache = tmp_path / "cache"
    procs = [child(cache, copycxx, env={"COPYCXX_SLEEP": "1"}) for _ in range(3)]
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        assert json.loads(out.strip().splitlines()[-1]) == {"loaded": True, "why": None, "warnings": []}
    assert builds(tmp_path) == 1
    lib = the_library(cache)
    assert sorted(p.name for p in cache.iterdir()) == [lib.name, fused.sidecar_path(lib).name]


HANGS = {
    # the compile hangs (after writing part of its output), holding a child of its own
    "compile": """\
        [ "$1" = "--version" ] && {{ echo "hangcxx 1.0"; exit 0; }}
        while [ "$#" -gt 0 ]; do [ "$1" = "-o" ] && out="$2"; shift; done
        echo partial > "$out"
        echo partial > "$TMPDIR/ccXXXX.s"
        sleep 600 &
        echo $! > "{pidfile}"
        wait
    """,
    # --version hangs too
    "version-and-compile": """\
        sleep 600 &
        echo $! >> "{pidfile}"
        wait
    """,
}


@pytest.mark.parametrize("where", sorted(HANGS))
def test_a_hanging_compiler_is_killed_after_the_timeout_and_leaves_nothing(tmp_path, where):
    pidfile = tmp_path / "pids"
    cxx = script(tmp_path, "hangcxx", HANGS[where].format(pidfile=pidfile))
    cache = tmp_path / "cache"
    start = time.monotonic()
    got = load_in_child(cache, cxx, env={fused.TIMEOUT_ENV: "2"}, timeout=60)
    took = time.monotonic() - start
    assert not got["loaded"]
    assert got["why"] == ("hangcxx did not finish compiling attention.cpp within 2 s (killed; "
                          "$ATTNPLUG_CXX_TIMEOUT sets the limit)")
    assert took < 30, f"a hanging compiler held the first build for {took:.0f} s"
    assert list(cache.iterdir()) == [], "a killed build left files in the cache"
    for pid in map(int, pidfile.read_text().split()):
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        else:
            os.kill(pid, 9)
            pytest.fail(f"the compiler's child {pid} outlived the timeout")


@pytest.mark.parametrize("value", ["0", "-1", "abc", "inf", "nan"])
def test_a_bad_timeout_value_is_a_reason_naming_the_variable(tmp_path, copycxx, value):
    got = load_in_child(tmp_path / "cache", copycxx, env={fused.TIMEOUT_ENV: value})
    assert got == {"loaded": False, "why": f"$ATTNPLUG_CXX_TIMEOUT={value!r} is not a positive number of seconds",
                   "warnings": []}
