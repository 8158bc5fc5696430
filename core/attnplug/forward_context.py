"""The backend serving the current forward, per runner, in a ``ContextVar``.

A host engine enters :func:`forward_context` around every forward pass of
every model runner (target, draft, ...)::

    from attnplug.forward_context import forward_context

    with forward_context(backend, batch, runner="draft"):
        backend.init_forward_metadata(batch)
        logits = model(input_ids, batch)

and model code asks :func:`current_backend` for the backend serving *this*
forward (and ``attnplug.speculative.kernel_for_forward`` for its kernel name)
instead of reading anything process-global. This is the rule that makes the
"draft runner clobbered the target's backend" bug impossible: nothing here is
ever written to a module attribute, ``os.environ`` or a shared object.

Why a ``contextvars.ContextVar``:

* every thread has its own context, so two runners stepping on two threads
  never see each other's backend;
* every ``asyncio`` task runs in a copy of the context it was created in, so
  two tasks that interleave at an ``await`` inside their forwards keep their
  own backends;
* entering pushes a frame onto an immutable tuple and leaving resets the
  variable with its token, so nested forwards (draft steps inside a target
  step) restore the outer frame exactly, even when the inner one raises.

Only the standard library is imported here (plus the error base class).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import TYPE_CHECKING, Iterator

from .errors import NoForwardContextError

if TYPE_CHECKING:  # annotations only: this module imports no torch
    from .backend import AttentionBackend
    from .batch import ForwardBatch

__all__ = [
    "DEFAULT_RUNNER", "ForwardFrame", "active_frames", "current_backend", "current_batch", "current_frame",
    "current_runner", "forward_context", "in_forward",
]

DEFAULT_RUNNER = "target"


@dataclasses.dataclass(frozen=True, eq=False)
class ForwardFrame:
    """One active forward: which runner, the backend serving it, and its batch."""

    runner: str
    backend: AttentionBackend
    batch: ForwardBatch

    def __repr__(self) -> str:
        return f"ForwardFrame(runner={self.runner!r}, backend={type(self.backend).__name__})"


# The active frames of this context, innermost last. Immutable: entering a forward sets a
# new tuple and leaving resets to the previous one, so no frame is ever mutated in place.
_FRAMES: contextvars.ContextVar[tuple[ForwardFrame, ...]] = contextvars.ContextVar(
    "attnplug_forward_frames", default=()
)


@contextlib.contextmanager
def forward_context(backend: AttentionBackend, batch: ForwardBatch, runner: str = DEFAULT_RUNNER) -> Iterator[ForwardFrame]:
    """Make ``backend`` the backend serving the forward of ``runner`` on ``batch``.

    Nests: the innermost frame answers :func:`current_backend` with no runner
    named; each runner's own innermost frame answers ``current_backend(runner)``.
    The previous state is restored on exit, also when the body raises.
    """
    if not isinstance(runner, str) or not runner:
        raise ValueError(f"forward_context: runner={runner!r} (expected a non-empty runner id string)")
    if backend is None:
        raise ValueError(
            f"forward_context(runner={runner!r}): backend is None; pass the backend serving this forward"
        )
    frame = ForwardFrame(runner, backend, batch)
    token = _FRAMES.set(_FRAMES.get() + (frame,))
    try:
        yield frame
    finally:
        _FRAMES.reset(token)


def active_frames() -> tuple[ForwardFrame, ...]:
    """Every active forward of this thread/task, outermost first."""
    return _FRAMES.get()


def current_frame(runner: str | None = None) -> ForwardFrame:
    """The innermost active frame (of ``runner`` when given); raises outside a forward."""
    frames = _FRAMES.get()
    for frame in reversed(frames):
        if runner is None or frame.runner == runner:
            return frame
    if not frames:
        raise NoForwardContextError(
            "no forward is active in this thread/task: the backend serving a forward is only known "
            "inside `with attnplug.forward_context.forward_context(backend, batch, runner=...)`, which "
            "the host engine enters around each forward (model code must not look for a global backend)"
        )
    active = ", ".join(repr(f.runner) for f in frames)
    raise NoForwardContextError(
        f"no forward of runner {runner!r} is active in this thread/task (active runners: {active}); "
        f"the host enters forward_context(backend, batch, runner={runner!r}) around that runner's forwards"
    )


def current_backend(runner: str | None = None) -> AttentionBackend:
    """The backend serving the current forward (of ``runner`` when given)."""
    return current_frame(runner).backend


def current_batch(runner: str | None = None) -> ForwardBatch:
    """The batch of the current forward (of ``runner`` when given)."""
    return current_frame(runner).batch


def current_runner() -> str:
    """The runner id of the innermost active forward."""
    return current_frame().runner


def in_forward(runner: str | None = None) -> bool:
    """True inside a forward (of ``runner`` when given)."""
    return any(runner is None or f.runner == runner for f in _FRAMES.get())
