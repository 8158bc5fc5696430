"""Build of attnplug-speedups: one small C++ extension (``attnplug_speedups/_C.cpp``) against torch's headers.

Without a C++ compiler the build stops with a message naming the compiler it looked for; attnplug works
without this package (the skeleton's Python check runs instead).
"""

from __future__ import annotations

import os
import shutil
import sys

from setuptools import setup


def _extensions():  # type: ignore[no-untyped-def]
    cxx = os.environ.get("CXX") or "c++"
    if shutil.which(cxx.split()[0]) is None:
        sys.exit(f"attnplug-speedups: no C++ compiler found: {cxx!r} is not on PATH ($CXX names another). This "
                 f"package compiles one C++ file at install (g++ >= 10 or clang++ >= 12 with C++17); install one "
                 f"(apt-get install g++), or leave this optional package out (attnplug runs without it).")
    from torch.utils.cpp_extension import CppExtension

    return [CppExtension("attnplug_speedups._C", [os.path.join("attnplug_speedups", "_C.cpp")],
                         extra_compile_args=["-O2"])]


def _cmdclass():  # type: ignore[no-untyped-def]
    from torch.utils.cpp_extension import BuildExtension

    return {"build_ext": BuildExtension.with_options(use_ninja=False)}


setup(ext_modules=_extensions(), cmdclass=_cmdclass())
