"""Build of attnplug-vllm-cpu: the package, and its compiled helper ``attnplug_vllm_cpu._stage`` when it can be built.

``csrc/stage.cpp`` registers the torch ops ``attnplug_vllm_cpu::stage`` (a decode layer's undo copy, K/V write in
vLLM's CPU layout and the new K/V's finite verdict, in one pass) and ``attnplug_vllm_cpu::all_finite`` (the output's
finite check); ``attnplug_vllm_cpu.stage`` loads them. Plain C++ (``-O3``, no ``-march`` flag: one build for every
x86-64 CPU). The helper is optional: without a C++ compiler (or on another platform) the package is built without
it, says so here, and the backend runs its pure-torch path, naming the reason in ``runtime_notes()``
(``attnplug doctor`` / ``bench`` print it) — never silently.
"""

from __future__ import annotations

import os
import platform
import shutil
import sys

from setuptools import setup

SOURCE = os.path.join("attnplug_vllm_cpu", "csrc", "stage.cpp")


def _why_not() -> str | None:
    """Why the helper is not built here (``None``: it is)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"the helper is built for x86-64 only (this machine: {platform.machine()})"
    cxx = os.environ.get("CXX") or "c++"
    if shutil.which(cxx.split()[0]) is None:
        return f"no C++ compiler found ({cxx!r} is not on PATH; $CXX names another)"
    try:
        import torch.utils.cpp_extension  # noqa: F401
    except ImportError:
        return "torch is not importable in the build environment"
    return None


def _extensions():  # type: ignore[no-untyped-def]
    why = _why_not()
    if why is not None:
        print(f"attnplug-vllm-cpu: building without the compiled helper: {why}; the backend uses its pure-torch "
              f"path (runtime_notes() says so)", file=sys.stderr)
        return [], {}
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    ext = CppExtension("attnplug_vllm_cpu._stage", [SOURCE], extra_compile_args=["-O3", "-std=c++17"])
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=False)}


_ext, _cmd = _extensions()
setup(ext_modules=_ext, cmdclass=_cmd)
