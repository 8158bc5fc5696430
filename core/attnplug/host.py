"""What machine this is: ``HostInfo``, detected once, constructible by hand.

Detection never imports torch (``attnplug list`` must stay light): it uses
torch only when the process has already imported it, and otherwise asks
``nvidia-smi`` / ``rocminfo`` when present. Kernel-library versions come from
distribution metadata, never from importing the library.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata as md
import json
import os
import platform as _platform
import shutil
import subprocess
import sys
from typing import Any, Iterable, Mapping

from .errors import HostInfoError

__all__ = [
    "KNOWN_KERNEL_LIBRARIES",
    "PLATFORMS",
    "SAME_MODULE_DISTRIBUTIONS",
    "HostInfo",
    "detect_host",
    "equivalent_distributions",
    "library_versions",
    "module_provider",
]

PLATFORMS: tuple[str, ...] = ("cpu", "cuda", "rocm", "xpu", "npu")

#: Distributions whose versions every ``HostInfo`` records (plugins may ask for more).
KNOWN_KERNEL_LIBRARIES: tuple[str, ...] = (
    "torch", "triton", "pytorch-triton", "pytorch-triton-rocm", "flash-attn", "flash-attn-3", "flashinfer-python", "flashinfer", "aiter",
    "amd-aiter", "sgl-kernel", "sglang-kernel", "sglang-kernel-cpu", "intel-extension-for-pytorch", "numpy",
)

#: Distributions that install the same module under different names, keyed by the name plugins
#: declare. sgl-kernel's releases continue as ``sglang-kernel`` (CUDA) and ``sglang-kernel-cpu``
#: (the CPU build); all three provide the module ``sgl_kernel``. AMD's aiter is the distribution
#: ``amd-aiter`` (module ``aiter``); the PyPI distribution named ``aiter`` is an unrelated
#: async-iterator package and never counts.
SAME_MODULE_DISTRIBUTIONS: dict[str, tuple[str, ...]] = {
    "sgl-kernel": ("sgl-kernel", "sglang-kernel", "sglang-kernel-cpu"),
    "sglang-kernel": ("sgl-kernel", "sglang-kernel", "sglang-kernel-cpu"),
    "sglang-kernel-cpu": ("sgl-kernel", "sglang-kernel", "sglang-kernel-cpu"),
    "amd-aiter": ("amd-aiter",),
}
#: The module each group above installs (what ``module_provider`` looks for on disk).
PROVIDED_MODULE: dict[str, str] = {"sgl-kernel": "sgl_kernel", "sglang-kernel": "sgl_kernel",
                                   "sglang-kernel-cpu": "sgl_kernel", "amd-aiter": "aiter"}


def equivalent_distributions(distribution: str) -> tuple[str, ...]:
    """Every distribution that provides the module ``distribution`` does (itself first)."""
    group = SAME_MODULE_DISTRIBUTIONS.get(_norm(distribution), ())
    return (distribution,) + tuple(d for d in group if _norm(d) != _norm(distribution))


@dataclasses.dataclass(frozen=True)
class HostInfo:
    """The machine a backend would run on.

    ``platform`` is one of ``cpu``, ``cuda``, ``rocm``, ``xpu``, ``npu`` (the
    accelerator kind; ``cpu`` when there is none). ``compute_capability`` is
    ``(major, minor)`` on CUDA; ``gfx_arch`` names a ROCm target such as
    ``gfx942``. ``cpu_flags`` holds lower-case /proc/cpuinfo flags (``amx_bf16``,
    ``amx_tile``, ``avx512f`` …). ``libraries`` maps a distribution name to its
    installed version.
    """

    platform: str = "cpu"
    device_name: str = ""
    compute_capability: tuple[int, int] | None = None
    gfx_arch: str | None = None
    device_count: int = 0
    cpu_flags: frozenset[str] = frozenset()
    libraries: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        problems = _field_problems(self)
        if problems:
            raise HostInfoError("HostInfo: " + "; ".join(problems))
        if isinstance(self.libraries, Mapping):
            object.__setattr__(self, "libraries", tuple(sorted(self.libraries.items())))
        else:
            object.__setattr__(self, "libraries", tuple(sorted(tuple(x) for x in self.libraries)))
        object.__setattr__(self, "cpu_flags", frozenset(f.lower() for f in self.cpu_flags))
        if self.compute_capability is not None:
            object.__setattr__(self, "compute_capability", tuple(int(x) for x in self.compute_capability))

    # -- queries -------------------------------------------------------
    @property
    def has_gpu(self) -> bool:
        return self.platform != "cpu"

    @property
    def has_amx(self) -> bool:
        return "amx_bf16" in self.cpu_flags and "amx_tile" in self.cpu_flags

    def library_version(self, distribution: str) -> str | None:
        """Installed version of kernel-library distribution ``name``, or ``None``."""
        key = _norm(distribution)
        for name, version in self.libraries:
            if _norm(name) == key:
                return version
        return None

    def sm(self) -> int | None:
        """Compute capability as one number (``(9, 0)`` -> 90), or None off CUDA."""
        if self.compute_capability is None:
            return None
        return self.compute_capability[0] * 10 + self.compute_capability[1]

    def describe(self) -> str:
        """One human line: platform, device, compute capability, CPU features, libraries."""
        if self.platform == "cuda":
            where = f"CUDA SM{self.sm()} {self.device_name}".strip()
        elif self.platform == "rocm":
            where = f"ROCm {self.gfx_arch or '?'} {self.device_name}".strip()
        elif self.platform == "cpu":
            where = "CPU" + (" with AMX" if self.has_amx else "")
        else:
            where = self.platform.upper()
        libs = ", ".join(f"{n} {v}" for n, v in self.libraries) or "no kernel libraries"
        return f"{where}; {libs}"

    # -- (de)serialisation, for `--host-json` --------------------------
    def to_dict(self) -> dict[str, Any]:
        """JSON-ready data; ``HostInfo.from_dict`` reads it back."""
        return {
            "platform": self.platform,
            "device_name": self.device_name,
            "compute_capability": list(self.compute_capability) if self.compute_capability else None,
            "gfx_arch": self.gfx_arch,
            "device_count": self.device_count,
            "cpu_flags": sorted(self.cpu_flags),
            "libraries": dict(self.libraries),
        }

    @classmethod
    def from_dict(cls, data: Any, source: str = "HostInfo") -> "HostInfo":
        """A host from plain data (a recorded host). Every field is checked with its type; the
        error names ``source`` (the variable, flag or file), the field and the expected type."""
        if not isinstance(data, Mapping):
            raise HostInfoError(f"{source}: expected a JSON object of HostInfo fields, got {type(data).__name__}")
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(data) - set(known), key=str)
        if unknown:
            raise HostInfoError(f"{source}: unknown field(s) {unknown} (known: {known})")
        kwargs = dict(data)
        if "libraries" in kwargs and not isinstance(kwargs["libraries"], Mapping):
            raise HostInfoError(f"{source}: field 'libraries': expected an object {{distribution: version}}, "
                                f"got {_shown(kwargs['libraries'])}")
        cc = kwargs.get("compute_capability")
        if isinstance(cc, str):  # "9.0" or "90"
            text = cc.strip()
            parts = text.split(".") if "." in text else [text[:-1], text[-1:]]
            if len(parts) != 2 or not all(p.isdigit() for p in parts):
                raise HostInfoError(f"{source}: field 'compute_capability': expected [major, minor] or "
                                    f"\"major.minor\", got {_shown(cc)}")
            kwargs["compute_capability"] = (int(parts[0]), int(parts[1]))
        for field, value in kwargs.items():
            problem = _check_field(field, value, from_json=True)
            if problem:
                raise HostInfoError(f"{source}: {problem}")
        if "cpu_flags" in kwargs:
            kwargs["cpu_flags"] = frozenset(kwargs["cpu_flags"])
        if "libraries" in kwargs:
            kwargs["libraries"] = dict(kwargs["libraries"])
        return cls(**kwargs)

    @classmethod
    def from_json_file(cls, path: str, source: str | None = None) -> "HostInfo":
        """Read a recorded host. ``source`` names where the path came from (``"--host-json"``,
        ``"ATTNPLUG_HOST_JSON"``); every failure is one ``HostInfoError`` line naming it and the file."""
        where = f"{source}={path!r}" if source else f"host file {path!r}"
        if not isinstance(path, str) or not path:
            raise HostInfoError(f"{where}: expected the path of a JSON file")
        try:
            with open(path, encoding="utf-8") as fh:
                text = fh.read()
        except FileNotFoundError:
            raise HostInfoError(f"{where}: no such file") from None
        except IsADirectoryError:
            raise HostInfoError(f"{where}: is a directory, expected a JSON file") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise HostInfoError(f"{where}: cannot read: {exc}") from None
        if not text.strip():
            raise HostInfoError(f"{where}: the file is empty; expected a JSON object of HostInfo fields")
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise HostInfoError(f"{where}: not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})") from None
        return cls.from_dict(data, source=where)


def _shown(value: Any) -> str:
    return f"{type(value).__name__} {value!r}"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_field(field: str, value: Any, from_json: bool = False) -> str | None:
    """The problem with one ``HostInfo`` field's value, or ``None``."""
    if field == "platform":
        if not isinstance(value, str) or value not in PLATFORMS:
            return f"field 'platform': expected one of {list(PLATFORMS)}, got {_shown(value)}"
    elif field in ("device_name",):
        if not isinstance(value, str):
            return f"field {field!r}: expected a str, got {_shown(value)}"
    elif field == "gfx_arch":
        if value is not None and not isinstance(value, str):
            return f"field 'gfx_arch': expected a str or null, got {_shown(value)}"
    elif field == "device_count":
        if not _is_int(value) or value < 0:
            return f"field 'device_count': expected a non-negative int, got {_shown(value)}"
    elif field == "compute_capability":
        if value is not None and not (isinstance(value, (list, tuple)) and len(value) == 2
                                      and all(_is_int(v) and v >= 0 for v in value)):
            return f"field 'compute_capability': expected [major, minor] (two ints) or null, got {_shown(value)}"
    elif field == "cpu_flags":
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple, set, frozenset)) \
                or not all(isinstance(f, str) for f in value):
            return f"field 'cpu_flags': expected a list of str flags, got {_shown(value)}"
    elif field == "libraries":
        items: Iterable[Any] | None = value.items() if isinstance(value, Mapping) else None
        if items is None and not from_json and isinstance(value, (list, tuple)) and all(
                isinstance(x, (list, tuple)) and len(x) == 2 for x in value):
            items = value
        if items is None or not all(isinstance(k, str) and isinstance(v, str) for k, v in items):
            return (f"field 'libraries': expected an object {{distribution: version}} of str, "
                    f"got {_shown(value)}")
    return None


def _field_problems(host: "HostInfo") -> list[str]:
    out = []
    for f in dataclasses.fields(host):
        problem = _check_field(f.name, getattr(host, f.name))
        if problem:
            out.append(problem)
    return out


def _norm(name: str) -> str:
    return name.lower().replace("_", "-")


def library_versions(names: Iterable[str]) -> dict[str, str]:
    """Installed versions of ``names`` from distribution metadata. Where several distributions of
    one ``SAME_MODULE_DISTRIBUTIONS`` group are installed (an upgrade across a rename leaves the old
    metadata behind), only the one whose files provide the module is kept."""
    out: dict[str, str] = {}
    for name in names:
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            continue
    for name in list(out):
        group = [d for d in equivalent_distributions(name) if d in out]
        if len(group) > 1:
            owner = module_provider(PROVIDED_MODULE.get(_norm(name), ""), group)
            if owner is not None:
                for d in group:
                    if d != owner[0]:
                        out.pop(d, None)
    return out


def module_provider(module: str, distributions: Iterable[str]) -> tuple[str, str] | None:
    """``(distribution, version)`` of the one among ``distributions`` whose installed files hold
    ``module`` (found with ``find_spec``, never imported); ``None`` when none of them does."""
    import importlib.util
    import pathlib

    try:
        spec = importlib.util.find_spec(module) if module else None
    except (ImportError, ValueError):
        spec = None
    where = None
    if spec is not None and spec.origin not in (None, "namespace"):
        where = pathlib.Path(spec.origin).resolve()
    for name in distributions:
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue
        for f in dist.files or ():
            parts = pathlib.PurePosixPath(str(f)).parts
            if parts[:1] != (module,):
                continue
            if where is None or pathlib.Path(str(dist.locate_file(f))).resolve() == where:
                return name, dist.version
        # editable installs list a .pth or a finder module instead of the package files
        if where is not None and any(str(f).endswith(".pth") and module in str(f) for f in dist.files or ()):
            return name, dist.version
    return None


def _cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def _run(cmd: list[str]) -> str | None:
    if shutil.which(cmd[0]) is None:
        return None
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def _accelerator_from_torch() -> dict[str, Any] | None:
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            if getattr(torch.version, "hip", None):
                return {"platform": "rocm", "device_name": props.name,
                        "gfx_arch": getattr(props, "gcnArchName", "").split(":")[0] or None,
                        "device_count": torch.cuda.device_count()}
            return {"platform": "cuda", "device_name": props.name,
                    "compute_capability": (props.major, props.minor), "device_count": torch.cuda.device_count()}
        xpu = getattr(torch, "xpu", None)
        if xpu is not None and xpu.is_available():
            return {"platform": "xpu", "device_count": xpu.device_count()}
    except Exception:  # a broken driver is "no accelerator", not a crash
        return None
    return {}


def _accelerator_from_tools() -> dict[str, Any]:
    out = _run(["nvidia-smi", "--query-gpu=name,compute_cap", "--format=csv,noheader"])
    if out:
        rows = [r.split(",") for r in out.strip().splitlines() if r.strip()]
        name, cap = rows[0][0].strip(), rows[0][1].strip()
        major, _, minor = cap.partition(".")
        return {"platform": "cuda", "device_name": name, "compute_capability": (int(major), int(minor or 0)),
                "device_count": len(rows)}
    if os.path.exists("/dev/kfd"):
        out = _run(["rocminfo"]) or ""
        arches = sorted({tok for tok in out.split() if tok.startswith("gfx") and tok[3:].isalnum()})
        return {"platform": "rocm", "gfx_arch": arches[0] if arches else None, "device_count": max(1, len(arches))}
    return {}


@functools.cache
def detect_host(extra_libraries: tuple[str, ...] = ()) -> HostInfo:
    """Detect this machine once per process (per set of extra library names).

    ``ATTNPLUG_HOST_JSON=path`` replaces detection with a recorded host, which
    is how one explains a machine one is not on.
    """
    recorded = os.environ.get("ATTNPLUG_HOST_JSON")
    if recorded:
        return HostInfo.from_json_file(recorded, source="ATTNPLUG_HOST_JSON")
    accel = _accelerator_from_torch()
    if accel is None:
        accel = _accelerator_from_tools()
    wanted = KNOWN_KERNEL_LIBRARIES + tuple(d for name in extra_libraries for d in equivalent_distributions(name))
    libs = library_versions(tuple(dict.fromkeys(wanted)))
    return HostInfo(cpu_flags=_cpu_flags() if _platform.system() == "Linux" else frozenset(),
                    libraries=tuple(sorted(libs.items())), **accel)
