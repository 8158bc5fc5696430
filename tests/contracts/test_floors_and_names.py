"""The recorded signatures cover the versions the plugins claim, and every plugin's probe accepts each
distribution that provides its module (and never an unrelated one)."""

from __future__ import annotations

import pytest

import _fa3_family_helpers as H
import _library_contracts as C
from attnplug import HostInfo

import attnplug_aiter
import attnplug_fa3
import attnplug_flashinfer
import attnplug_trtllm_mha

FLOORS = [
    ("fa3", attnplug_fa3.SGL_KERNEL, H.registry("attnplug-fa3").get("fa3").min_library_version),
    ("fa3 sinks", attnplug_fa3.SGL_KERNEL, getattr(attnplug_fa3, "MIN_SGL_KERNEL_SINKS", None)),
    ("flashinfer", attnplug_flashinfer.LIBRARY, attnplug_flashinfer.MIN_LIBRARY_VERSION),
    ("trtllm_mha", attnplug_trtllm_mha.LIBRARY, attnplug_trtllm_mha.MIN_VERSION),
    ("aiter", attnplug_aiter.LIBRARY, attnplug_aiter.MIN_LIBRARY_VERSION),
]


@pytest.mark.parametrize("what, library, floor", FLOORS, ids=[f[0] for f in FLOORS])
def test_signatures_file_names_each_claimed_floor(what, library, floor):
    assert library in C.recorded(), f"{what}: no signatures recorded for {library!r}"
    assert floor in C.versions(library), (f"{what}: {library} {floor} (the plugin's floor) is not recorded; "
                                          f"run scripts/extract_signatures.py after adding it to SOURCES")
    assert C.source_of(library, floor)


@pytest.mark.parametrize("family, library", [("fa3", "sgl-kernel"), ("flashinfer", "flashinfer-python"),
                                             ("trtllm_mha", "flashinfer-python"), ("aiter", "amd-aiter")])
def test_descriptors_declare_the_recorded_library(family, library):
    reg = H.registry(f"attnplug-{family.replace('_', '-')}")
    assert reg.get(family).library == library


@pytest.mark.parametrize("dist", ["sgl-kernel", "sglang-kernel"])
def test_fa3_is_available_under_either_distribution_name(dist):
    host = H.cuda_host(90, **{dist.replace("-", "_"): "0.4.10" if dist == "sglang-kernel" else "0.3.21"})
    reg = H.registry("attnplug-fa3")
    assert reg.availability("fa3", host), reg.availability("fa3", host).reasons
    assert reg.get("fa3").library_floor_problem(host) is None
    old = H.cuda_host(90, sglang_kernel="0.2.9")
    assert "sgl-kernel (installed as sglang-kernel) >= 0.3.0, found 0.2.9" in reg.get("fa3").library_floor_problem(old)


@pytest.mark.parametrize("dist", ["sgl-kernel", "sglang-kernel", "sglang-kernel-cpu"])
def test_intel_amx_is_available_under_every_distribution_name(dist):
    host = H.cpu_host(True, **{dist.replace("-", "_"): "0.4.10"})
    assert H.registry("attnplug-intel-amx").availability("intel_amx", host)


def test_aiter_needs_amd_aiter_and_never_counts_pypi_aiter():
    reg = H.registry("attnplug-aiter")
    wrong = HostInfo(platform="rocm", gfx_arch="gfx942", libraries={"aiter": "0.1.10"})
    assert not reg.availability("aiter", wrong)
    assert reg.get("aiter").library_floor_problem(wrong) is None  # absent, not old: the probe says so
    right = HostInfo(platform="rocm", gfx_arch="gfx942", libraries={"amd-aiter": "0.1.10"})
    assert reg.availability("aiter", right)


def test_installed_library_reads_the_distribution_that_is_there():
    from attnplug.descriptor import installed_library

    host = HostInfo(libraries={"sglang-kernel": "0.4.10"})
    assert installed_library(host, "sgl-kernel") == ("sglang-kernel", "0.4.10")
    assert installed_library(host, "amd-aiter") is None


def test_module_provider_finds_the_owner_on_disk_and_not_another_distribution():
    from attnplug.host import module_provider

    import importlib.metadata as im

    assert module_provider("pluggy", ("pytest", "pluggy")) == ("pluggy", im.version("pluggy"))
    assert module_provider("pluggy", ("pytest",)) is None


def test_core_version_key_orders_releases_as_packaging_does():
    """The floors compare with ``attnplug.descriptor.version_key``; this tier compares with ``packaging``."""
    from packaging.version import Version

    from attnplug.descriptor import version_key

    seq = ["0.1.9", "0.1.9.post1", "0.1.10rc1", "0.1.10", "0.1.10.post1", "0.3.0", "0.3.4", "0.3.4.post1",
           "0.3.5.dev1", "0.3.5", "0.4.10", "0.6.4+cu128", "0.7.4"]
    assert sorted(seq, key=version_key) == sorted(seq, key=Version) == seq


def test_the_pinned_flashinfer_is_a_recorded_release():
    from pathlib import Path

    pins = dict(line.split("==", 1) for line in (Path(__file__).parents[2] / "constraints.txt").read_text().split()
                if "==" in line)
    assert pins["flashinfer-python"] in C.versions("flashinfer-python")


@pytest.mark.parametrize("module, library", [
    ("attnplug_fa3.backend", "sgl-kernel"), ("attnplug_flashinfer.backend", "flashinfer-python"),
    ("attnplug_trtllm_mha.backend", "flashinfer-python"), ("attnplug_aiter.backend", "amd-aiter")])
def test_every_declared_library_call_is_recorded_and_has_preconditions(module, library):
    """``LIBRARY_CALLS`` is the one checkable list per plugin: each entry has a real signature at every
    recorded version at or above the floor, and a precondition check."""
    import importlib

    calls = importlib.import_module(module).LIBRARY_CALLS
    for qualname in calls:
        assert qualname in C.PRECONDITIONS, qualname
        for version in C.versions(library)[-1:]:
            assert C.signature(library, version, qualname) is not None, (qualname, version)


def test_contract_runs_only_make_declared_calls():
    """The calls the contract tier recorded for fa3/trtllm_mha are exactly those the plugins declare."""
    import torch

    import test_fa3_contract as F
    import test_trtllm_mha_contract as T
    from attnplug import ForwardMode
    from attnplug_fa3.backend import LIBRARY_CALLS as FA3
    from attnplug_trtllm_mha.backend import LIBRARY_CALLS as TRT

    p = H.make_problem(dtype=torch.bfloat16, head_dim=64, page_size=16, mode=ForwardMode.DECODE, ext=(1, 1, 1))
    _, calls = F._run_at(p)("sgl-kernel", "0.3.21")
    assert {c.qualname for c in calls} <= set(FA3)
    p = H.make_problem(dtype=torch.bfloat16, head_dim=64, page_size=16)
    assert {c.qualname for c in T._calls(p)} <= set(TRT)


def test_detection_keeps_only_the_distribution_that_provides_the_module(monkeypatch):
    """Mocked metadata: sgl-kernel's metadata left behind by an upgrade to sglang-kernel is dropped."""
    import importlib.metadata as im

    import attnplug.host as host

    fake = {"sgl-kernel": "0.3.21", "sglang-kernel": "0.4.10"}
    monkeypatch.setattr(host.md, "version", lambda n: fake[n] if n in fake else (_ for _ in ()).throw(
        im.PackageNotFoundError(n)))
    monkeypatch.setattr(host, "module_provider", lambda module, dists: ("sglang-kernel", "0.4.10")
                        if module == "sgl_kernel" and "sglang-kernel" in dists else None)
    assert host.library_versions(["sgl-kernel", "sglang-kernel", "numpy"]) == {"sglang-kernel": "0.4.10"}
