"""Slow tier: attnplug-cpu-fused is compiled when its wheel is built, never at first use.

Builds the wheels of the core, torch_native and cpu_fused (the kernel compiled here, once per
instruction set), installs them into a fresh virtual environment that sees this environment's torch (a ``.pth`` naming the
directory torch is installed in: the tox environment's, which a venv made from it with
``--system-site-packages`` would not see, since that names the base interpreter's), and runs a forward through the kernel there with a PATH that holds no C++
compiler (no g++, c++, cc, clang++): the installed wheel needs none.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

import _flow

ROOT = Path(__file__).resolve().parents[2]
_IGNORE = shutil.ignore_patterns("build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", "_C*.so")

COMPILERS = ("g++", "c++", "cc", "gcc", "clang++", "clang")


#: a command or a wheel build may take this long (seconds)
TIMEOUT = 1800
_run = functools.partial(_flow.run, timeout=TIMEOUT)
_wheel = functools.partial(_flow.wheel, timeout=TIMEOUT)

_FORWARD = textwrap.dedent("""
    import attnplug_cpu_fused, torch
    from attnplug import AttentionConfig, BuildContext, ForwardBatch, HostInfo, LayerSpec, PagedKVCache
    from attnplug.registry import default_registry
    from attnplug.testing.reference import reference_attention
    print("PACKAGE", attnplug_cpu_fused.__file__)
    g = torch.Generator().manual_seed(0)
    cache = PagedKVCache(1, 16, 2, 64, page_size=16, dtype="bfloat16", max_requests=4, max_context_len=64)
    cache.set_kv(0, torch.arange(cache.num_slots), torch.randn(cache.num_slots, 2, 64, generator=g).bfloat16(),
                 torch.randn(cache.num_slots, 2, 64, generator=g).bfloat16(), stored=True)
    for r, n in ((0, 40), (1, 7)):
        cache.assign_pages(r, n, list(range(r * 4, r * 4 + 4)))
    ctx = BuildContext(config=AttentionConfig(attention_backend="cpu_fused"), host=HostInfo(platform="cpu"),
                       dtype="bfloat16", kv_cache_dtype="bfloat16", num_heads=8, num_kv_heads=2, head_dim=64,
                       page_size=16, kv_cache=cache, max_batch_size=4, max_context_len=64)
    name, backend = default_registry().build("cpu_fused", ctx)
    batch = ForwardBatch.decode([0, 1], [40, 7], torch.stack([cache.req_to_token[0, 39], cache.req_to_token[1, 6]]))
    layer = LayerSpec(0, 8, 2, 64)
    q = torch.randn(2, 8, 64, generator=g).bfloat16()
    k, v = torch.randn(2, 2, 64, generator=g).bfloat16(), torch.randn(2, 2, 64, generator=g).bfloat16()
    kc0, vc0 = cache.read_kv(0)
    backend.init_forward_metadata(batch)
    out = backend.forward(q, k, v, layer, batch)
    ref = reference_attention(q, k, v, layer, batch, kc0, vc0, cache.req_to_token)
    err = float((out.double() - ref).abs().max())
    assert backend.workspace.grows == 0, "the eager paths ran"
    print("RESULT", name, backend.isa, err)
""")


@pytest.mark.slow
def test_the_wheel_runs_the_kernel_in_a_fresh_venv_without_a_compiler(tmp_path: Path) -> None:
    if shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("building the cpu_fused wheel needs a C++ compiler here")
    core_src = tmp_path / "core_src"
    core_src.mkdir()
    shutil.copy(ROOT / "pyproject.toml", core_src)
    shutil.copy(ROOT / "README.md", core_src)
    shutil.copytree(ROOT / "core", core_src / "core", ignore=_IGNORE)
    wheels = tmp_path / "wheels"
    built = [_wheel(core_src, wheels)]
    for plugin in ("torch_native", "cpu_fused"):
        src = tmp_path / plugin
        shutil.copytree(ROOT / "plugins" / plugin, src, ignore=_IGNORE)
        built.append(_wheel(src, wheels))
    with zipfile.ZipFile(built[-1]) as zf:
        libs = [n for n in zf.namelist() if n.startswith("attnplug_cpu_fused/_C") and n.endswith(".so")]
    assert len(libs) == 1, f"the wheel holds no compiled kernel: {libs}"

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], cwd=tmp_path)
    py = venv / "bin" / "python"
    _run([str(py), "-m", "pip", "install", "-q", "--no-deps", *map(str, built)], cwd=tmp_path)
    # then torch (and its dependencies) from the environment running this test, after the venv's own packages
    # (written after pip ran, so pip installs the wheels instead of finding them there): the wheels are found
    # first, which the assertion on ``PACKAGE`` checks
    import torch

    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "_parent_torch.pth").write_text(str(Path(torch.__file__).resolve().parent.parent) + "\n")
    # a PATH with the venv's tools only: no compiler reachable, and none named by $CXX/$CC
    path = str(venv / "bin")
    assert all(shutil.which(c, path=path) is None for c in COMPILERS)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ATTNPLUG_", "PYTEST_", "PYTHONPATH", "VIRTUAL_ENV", "CXX", "CC"))}
    env.update(PATH=path, ATTNPLUG_PLUGINS="cpu_fused,torch_native")
    work = tmp_path / "elsewhere"
    work.mkdir()
    proc = subprocess.run([str(py), "-c", _FORWARD], cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    pkg = next(ln.split(" ", 1)[1] for ln in proc.stdout.splitlines() if ln.startswith("PACKAGE"))
    assert pkg.startswith(str(venv)), pkg  # the installed wheel, not this checkout
    _, name, isa, err = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")).split()
    assert name == "cpu_fused" and isa in ("avx512bf16", "avx512", "avx2", "portable")
    assert float(err) < 2e-2, err
