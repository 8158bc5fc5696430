"""Resolution records are what they were: every configuration the tests resolve, on every host they
describe, against the snapshot recorded before the registry and the chain were reshaped (issue 21).

Re-record (only for a deliberate change of behaviour, said so in the commit):
``python -m tests.fast.resolution_snapshot``. See that module for the cases and what is recorded.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.fast import resolution_snapshot as S


@pytest.fixture(scope="module")
def snapshot() -> dict[str, Any]:
    return S.load()


@pytest.fixture(scope="module")
def now() -> dict[str, Any]:
    return S.compute()


def _differences(path: str, old: Any, new: Any) -> list[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        out = [f"{path}.{k}: only in the snapshot" for k in old if k not in new]
        out += [f"{path}.{k}: not in the snapshot" for k in new if k not in old]
        for k in old:
            if k in new:
                out += _differences(f"{path}.{k}", old[k], new[k])
        return out
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        return [d for i, (a, b) in enumerate(zip(old, new)) for d in _differences(f"{path}[{i}]", a, b)]
    return [] if old == new else [f"{path}: was {old!r}, now {new!r}"]


def test_the_snapshot_covers_every_case_and_both_outcomes(snapshot: dict[str, Any]) -> None:
    keys = [k for k, *_ in S.cases()]
    assert len(keys) == len(set(keys))
    assert sorted(snapshot) == sorted(["passes", *keys])
    records = [v for k, v in snapshot.items() if k != "passes"]
    # successes and failures of every kind the CLI explains are recorded
    assert sum(r["ok"] for r in records) > 500
    errors = {r["error"].split(":", 1)[0] for r in records if not r["ok"]}
    assert {"ConfigError", "UnknownBackendError", "BackendUnavailableError"} <= errors
    assert any(r["overruled"] for r in records) and any(r["config"]["kv_layout"] == "hnd" for r in records)


@pytest.mark.parametrize("registry", sorted(S.REGISTRIES))
def test_every_resolution_record_is_unchanged(snapshot: dict[str, Any], now: dict[str, Any], registry: str) -> None:
    diffs = _differences("passes", snapshot["passes"], now["passes"])
    for key in snapshot:
        if key.startswith(registry + "/"):
            diffs += _differences(key, snapshot[key], now.get(key))
    assert not diffs, f"{len(diffs)} field(s) changed, first ones:\n" + "\n".join(diffs[:40])


def test_a_fresh_registry_records_what_a_warm_one_does(snapshot: dict[str, Any]) -> None:
    """compute() reuses one registry per host; a fresh registry per case answers the same."""
    layers = S.layer_sets()
    for key, regname, hostname, arch, fields, lname in list(S.cases())[::37]:
        host = S.HOSTS[hostname]
        data = S.record(S.REGISTRIES[regname](host), host, arch, fields, layers[lname] if lname else ())
        assert S.compact(key, data, host, dict(snapshot["passes"])) == snapshot[key], key
