"""The forward context: the backend serving a forward, per runner, thread- and task-safe."""

from __future__ import annotations

import asyncio
import importlib
import threading

import pytest

from attnplug.errors import AttnplugError
from attnplug.forward_context import (
    ForwardFrame,
    NoForwardContextError,
    active_frames,
    current_backend,
    current_batch,
    current_frame,
    current_runner,
    forward_context,
    in_forward,
)


# the module itself (not a same-named export of the package)
fc_module = importlib.import_module("attnplug.forward_context")


class _B:
    def __init__(self, tag):
        self.tag = tag

    def __repr__(self):
        return f"_B({self.tag})"


def _module_state():
    return {k: repr(v) for k, v in vars(fc_module).items() if not k.startswith("__")}


def test_outside_a_forward_is_a_clear_error():
    assert active_frames() == () and not in_forward()
    with pytest.raises(NoForwardContextError, match="no forward is active") as e:
        current_backend()
    assert "forward_context(backend, batch, runner=" in str(e.value)
    assert isinstance(e.value, AttnplugError) and isinstance(e.value, RuntimeError)


def test_sets_and_restores():
    t, batch = _B("t"), object()
    with forward_context(t, batch) as frame:
        assert isinstance(frame, ForwardFrame) and frame.runner == "target"
        assert current_backend() is t and current_batch() is batch and current_runner() == "target"
        assert current_backend("target") is t and in_forward("target") and not in_forward("draft")
    assert active_frames() == ()


def test_nested_draft_inside_target_restores_the_target():
    t, d0, d1 = _B("t"), _B("d0"), _B("d1")
    with forward_context(t, "tb", runner="target"):
        for d in (d0, d1):
            with forward_context(d, "db", runner="draft"):
                assert current_backend() is d and current_runner() == "draft"
                assert current_backend("draft") is d
                assert current_backend("target") is t  # the outer runner is still answerable by name
                assert current_batch("target") == "tb"
            assert current_backend() is t
        assert [f.runner for f in active_frames()] == ["target"]
    assert not in_forward()


def test_exception_inside_restores():
    t, d = _B("t"), _B("d")
    with forward_context(t, None):
        with pytest.raises(ZeroDivisionError):
            with forward_context(d, None, runner="draft"):
                1 / 0  # noqa: B018 (raises)
        assert current_backend() is t
    assert active_frames() == ()


def test_missing_runner_names_the_active_ones():
    with forward_context(_B("t"), None, runner="target"):
        with pytest.raises(NoForwardContextError, match=r"runner 'draft'.*active runners: 'target'"):
            current_backend("draft")
        with pytest.raises(NoForwardContextError):
            current_frame("draft")


@pytest.mark.parametrize("runner", ["", None, 3])
def test_bad_runner_is_rejected(runner):
    with pytest.raises(ValueError, match="runner"):
        with forward_context(_B("x"), None, runner=runner):
            pass


def test_none_backend_is_rejected():
    with pytest.raises(ValueError, match="backend is None"):
        with forward_context(None, None):
            pass


def test_two_threads_interleaved_each_see_their_own_backend():
    before = _module_state()
    backends = {"target": _B("t"), "draft": _B("d")}
    barrier = threading.Barrier(2)
    errors: list[str] = []

    def run(runner):
        mine = backends[runner]
        for i in range(200):
            with forward_context(mine, i, runner=runner):
                barrier.wait()  # both threads are inside their forward now
                if current_backend() is not mine or current_batch() != i or current_runner() != runner:
                    errors.append(f"{runner} step {i} saw {current_frame()!r}")
                barrier.wait()
            if active_frames():
                errors.append(f"{runner} step {i}: frames left after exit")

    threads = [threading.Thread(target=run, args=(r,)) for r in backends]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert errors == []
    assert active_frames() == ()
    assert _module_state() == before


def test_two_asyncio_tasks_interleaved_each_see_their_own_backend():
    before = _module_state()
    backends = {"target": _B("t"), "draft": _B("d")}

    async def run(runner, log):
        mine = backends[runner]
        for i in range(100):
            with forward_context(mine, i, runner=runner):
                await asyncio.sleep(0)  # the other task enters its own forward here
                log.append((runner, current_backend() is mine, current_batch() == i))
                with forward_context(_B("inner"), None, runner=runner + "-inner"):
                    await asyncio.sleep(0)
                assert current_backend() is mine
        return log

    async def main():
        log: list = []
        await asyncio.gather(run("target", log), run("draft", log))
        return log

    log = asyncio.run(main())
    assert len(log) == 200
    assert all(ok and batch_ok for _, ok, batch_ok in log)
    # really interleaved: the runners alternate in the log
    assert sum(1 for a, b in zip(log, log[1:]) if a[0] != b[0]) > 50
    assert active_frames() == ()
    assert _module_state() == before
