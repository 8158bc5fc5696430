"""Build of attnplug-cpu-fused: the fused CPU kernel compiled at install, once per instruction set.

``attention.cpp`` is compiled four times (``csrc/isa_<name>.cpp``, each with the flags in
``ISA_FLAGS``); ``ops.cpp`` registers the op ``attnplug_cpu_fused::attend`` and picks, when the
library loads, the variant this CPU runs (cpuid), so one wheel serves every x86-64 CPU: no
``-march=native``. ``ops.cpp`` is built with ``-fopenmp`` only for ``at::parallel_for``; its
``libgomp.so.1`` resolves to the one torch already loaded (one OpenMP runtime, checked by
tests/plugins/test_cpu_fused.py). Without a C++ compiler the build stops with a message naming
the compiler it looked for (there is no compile-at-first-use fallback).
"""

from __future__ import annotations

import os
import platform
import shutil
import sys

from setuptools import setup

CSRC = os.path.join("attnplug_cpu_fused", "csrc")


def _isa_flags() -> dict[str, list[str]]:
    """kernel.py's ISA_FLAGS, read by path (the package's __init__ needs attnplug, absent in a build env)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_attnplug_cpu_fused_kernel", os.path.join("attnplug_cpu_fused",
                                                                                            "kernel.py"))
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return {f"isa_{name}": flags for name, flags in mod.ISA_FLAGS.items()}


ISA_FLAGS = _isa_flags()
#: compiled with -fopenmp (their libgomp.so.1 is torch's, already loaded: one runtime); extend_tiled.cpp
#: (the tiled extend kernel) carries its own per-ISA bodies (target attributes, chosen by cpuid), its AMX
#: body included: no -mamx-* flag, so a build machine without AMX builds it (a compiler older than GCC 11
#: / clang 12 leaves that body out, and the best body is then avx512bf16)
OPENMP_SOURCES = ("extend_tiled",)


def _compiler() -> str:
    cxx = os.environ.get("CXX") or "c++"
    found = shutil.which(cxx.split()[0])
    if found is None:
        sys.exit(f"attnplug-cpu-fused: no C++ compiler found: {cxx!r} is not on PATH ($CXX names another). This "
                 f"package compiles its kernel at install (g++ >= 10 or clang++ >= 12 with C++17); install one "
                 f"(apt-get install g++), or install a prebuilt attnplug-cpu-fused wheel.")
    return found


def _extensions():  # type: ignore[no-untyped-def]
    if platform.machine().lower() not in ("x86_64", "amd64"):
        sys.exit(f"attnplug-cpu-fused: the kernel is built for x86-64 only (this machine: {platform.machine()})")
    _compiler()
    from torch.utils.cpp_extension import CppExtension

    sources = [os.path.join(CSRC, f"{name}.cpp") for name in ("ops", *OPENMP_SOURCES)] + \
        [os.path.join(CSRC, f"{name}.cpp") for name in ISA_FLAGS]
    return [CppExtension("attnplug_cpu_fused._C", sources, extra_compile_args=["-O3", "-std=c++17"],
                         extra_link_args=["-fopenmp"])]


def _build_ext():  # type: ignore[no-untyped-def]
    from torch.utils.cpp_extension import BuildExtension

    class Build(BuildExtension):
        """torch's BuildExtension with per-source flags: each isa_*.cpp gets its ISA's -m flags,
        ops.cpp (torch's at::parallel_for) and extend_tiled.cpp get -fopenmp."""

        def build_extensions(self) -> None:
            inner = self.compiler._compile

            def _compile(obj, src, ext, cc_args, extra_postargs, pp_opts):  # type: ignore[no-untyped-def]
                stem = os.path.splitext(os.path.basename(src))[0]
                extra = ISA_FLAGS.get(stem, ["-fopenmp"] if stem == "ops" or stem in OPENMP_SOURCES else [])
                post = extra_postargs.get("cxx", []) if isinstance(extra_postargs, dict) else list(extra_postargs)
                return inner(obj, src, ext, cc_args, [*post, *extra], pp_opts)

            self.compiler._compile = _compile
            super().build_extensions()

    return Build.with_options(use_ninja=False)


setup(ext_modules=_extensions(), cmdclass={"build_ext": _build_ext()})
