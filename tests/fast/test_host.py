"""HostInfo: hand-constructible, serialisable, detected once without importing torch."""

from __future__ import annotations

import json

import pytest

from attnplug import HostInfo
from attnplug.host import detect_host
from tests.conftest import run_json


def test_hand_built_hosts_answer_queries():
    sm90 = HostInfo(platform="cuda", compute_capability=(9, 0), libraries={"flash-attn-3": "3.0.0"})
    assert sm90.sm() == 90 and sm90.has_gpu and not sm90.has_amx
    assert sm90.library_version("flash_attn_3") == "3.0.0"  # names compare normalised
    assert sm90.library_version("flashinfer-python") is None
    amx = HostInfo(cpu_flags={"AMX_BF16", "amx_tile", "avx512f"})
    assert amx.has_amx and amx.sm() is None and not amx.has_gpu
    assert not HostInfo(cpu_flags={"amx_tile"}).has_amx


def test_hosts_are_hashable_and_equal_by_value():
    a = HostInfo(platform="rocm", gfx_arch="gfx942", libraries={"aiter": "0.1"})
    b = HostInfo(platform="rocm", gfx_arch="gfx942", libraries=[("aiter", "0.1")])
    assert a == b and hash(a) == hash(b)
    assert len({a, b}) == 1


def test_round_trip_through_dict_and_json(tmp_path):
    h = HostInfo(platform="cuda", compute_capability=(10, 0), device_name="B200",
                 cpu_flags={"avx2"}, libraries={"flashinfer-python": "0.6.1"})
    assert HostInfo.from_dict(json.loads(json.dumps(h.to_dict()))) == h
    p = tmp_path / "host.json"
    p.write_text(json.dumps({"platform": "cuda", "compute_capability": "9.0"}))
    assert HostInfo.from_json_file(str(p)).compute_capability == (9, 0)


def test_bad_host_fields_are_named():
    with pytest.raises(ValueError, match="field 'platform'.*'tpu'"):
        HostInfo(platform="tpu")
    with pytest.raises(ValueError, match="gpu_count"):
        HostInfo.from_dict({"gpu_count": 1})


def test_describe_mentions_what_matters():
    assert "SM90" in HostInfo(platform="cuda", compute_capability=(9, 0)).describe()
    assert "AMX" in HostInfo(cpu_flags={"amx_bf16", "amx_tile"}).describe()
    assert "gfx942" in HostInfo(platform="rocm", gfx_arch="gfx942").describe()


def test_detect_host_is_cached_and_reads_versions_from_metadata():
    h1 = detect_host()
    assert detect_host() is h1
    import importlib.metadata as md

    assert h1.library_version("pluggy") is None  # only kernel libraries are recorded by default
    assert detect_host(("pluggy",)).library_version("pluggy") == md.version("pluggy")


def test_detect_host_does_not_import_torch_and_honours_recorded_host(tmp_path):
    p = tmp_path / "h.json"
    p.write_text(json.dumps({"platform": "cuda", "compute_capability": [9, 0]}))
    out = run_json("""
        import json, sys
        from attnplug.host import detect_host
        live = detect_host()
        print(json.dumps({"torch": "torch" in sys.modules, "platform": live.platform,
                          "torch_version": live.library_version("torch")}))
    """)
    assert out["torch"] is False
    assert out["torch_version"]  # read from metadata, without the import
    recorded = run_json("""
        import json
        from attnplug.host import detect_host
        print(json.dumps(detect_host().to_dict()))
    """, env={"ATTNPLUG_HOST_JSON": str(p)})
    assert recorded["platform"] == "cuda" and recorded["compute_capability"] == [9, 0]
