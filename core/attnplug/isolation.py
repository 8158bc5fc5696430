"""Running plugin code: anything it raises or prints is the plugin's, not the program's.

Every call into plugin code (importing a descriptor module, a hook, a probe,
a priority function, a factory) goes through :func:`call_plugin`, which

* turns *any* ``BaseException`` the plugin raises -- ``SystemExit``,
  ``KeyboardInterrupt``, ``GeneratorExit`` included -- into a
  :class:`~attnplug.errors.PluginError` naming the distribution and what was
  being called, **except a real Ctrl-C**;
* keeps what the plugin writes to ``sys.stdout`` away from the program's
  output (``attnplug list --json`` stays valid JSON) and returns it, so the
  caller can report it.

The Ctrl-C rule. A ``KeyboardInterrupt`` is the user's when a SIGINT arrived
while the plugin code ran; then it is re-raised and the program stops as any
Python program does. One the plugin raises itself (``raise
KeyboardInterrupt``) is the plugin's failure. To tell them apart, the main
thread chains a counting SIGINT handler in front of the current Python-level
handler for the duration of the call (restored after; nothing else about the
handler changes). Off the main thread, and when SIGINT is ignored or left to
the OS, Python never turns a signal into a ``KeyboardInterrupt``, so every
``KeyboardInterrupt`` there comes from code.

Output capture is per thread: while a call runs, ``sys.stdout`` is a router
that sends the writes of threads inside plugin code to their buffer and every
other thread's writes to the real stream.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from typing import Any, Callable, Iterator, TextIO, TypeVar

from .errors import PluginError

T = TypeVar("T")

_local = threading.local()
_router_lock = threading.Lock()
_router_users = 0
_saved_stdout: Any = None

_sigint_count = 0
_sigint_depth = 0
_sigint_previous: Any = None


class _StdoutRouter:
    """``sys.stdout`` while plugin code runs: per-thread capture, pass-through otherwise."""

    def __init__(self, target: TextIO) -> None:
        self._target = target

    def write(self, text: str) -> int:
        buf = getattr(_local, "buffer", None)
        if buf is not None:
            buf.append(str(text))
            return len(text)
        return self._target.write(text)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        if getattr(_local, "buffer", None) is None:
            self._target.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._target, name)


@contextlib.contextmanager
def _captured_stdout() -> Iterator[list[str]]:
    global _router_users, _saved_stdout
    outer = getattr(_local, "buffer", None)
    buf: list[str] = []
    with _router_lock:
        if _router_users == 0:
            _saved_stdout = sys.stdout
            sys.stdout = _StdoutRouter(sys.stdout)
        _router_users += 1
    _local.buffer = buf
    try:
        yield buf
    finally:
        _local.buffer = outer
        if outer is not None:  # nested call: the outer call reports everything
            outer.extend(buf)
        with _router_lock:
            _router_users -= 1
            if _router_users == 0:
                if isinstance(sys.stdout, _StdoutRouter):
                    sys.stdout = _saved_stdout
                _saved_stdout = None


def _on_sigint(signum: int, frame: Any) -> Any:
    global _sigint_count
    _sigint_count += 1
    previous = _sigint_previous
    if callable(previous):
        return previous(signum, frame)
    raise KeyboardInterrupt  # pragma: no cover - installed only in front of a callable handler


@contextlib.contextmanager
def _watching_sigint() -> Iterator[None]:
    """Count SIGINTs that arrive while plugin code runs (main thread only; see the module doc)."""
    global _sigint_depth, _sigint_previous
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    installed = False
    if _sigint_depth == 0:
        try:
            current = signal.getsignal(signal.SIGINT)
            if callable(current) and current is not _on_sigint:
                _sigint_previous = current
                signal.signal(signal.SIGINT, _on_sigint)
                installed = True
        except (ValueError, OSError, TypeError):  # no signals here (embedded interpreter)
            pass
    _sigint_depth += 1
    try:
        yield
    finally:
        _sigint_depth -= 1
        if installed:
            try:
                if signal.getsignal(signal.SIGINT) is _on_sigint:
                    signal.signal(signal.SIGINT, _sigint_previous)
            except (ValueError, OSError, TypeError):  # pragma: no cover
                pass
            _sigint_previous = None


@contextlib.contextmanager
def watch_sigint() -> Iterator[Callable[[], bool]]:
    """Count SIGINTs around code that calls plugin code many times without ``call_plugin`` (a timing
    loop, a conformance test); yields ``interrupted()``: whether a real Ctrl-C arrived since."""
    before = _sigint_count
    with _watching_sigint():
        yield lambda: _sigint_count != before


def guarded(distribution: str, what: str, fn: Callable[..., T], interrupted: Callable[[], bool]) -> Callable[..., T]:
    """``fn`` for a hot loop (no per-call cost): an ordinary ``Exception`` passes through as it is,
    while ``SystemExit``, ``GeneratorExit`` and a ``KeyboardInterrupt`` that is not a real Ctrl-C
    (``interrupted()`` from ``watch_sigint``) become a ``PluginError`` naming ``distribution``."""

    def call(*args: Any, **kwargs: Any) -> T:
        try:
            return fn(*args, **kwargs)
        except Exception:
            raise
        except KeyboardInterrupt as exc:
            if interrupted():
                raise
            raise PluginError(distribution, f"{what} raised {describe_exception(exc)}") from exc
        except (SystemExit, GeneratorExit) as exc:
            raise PluginError(distribution, f"{what} raised {describe_exception(exc)}") from exc

    return call


@contextlib.contextmanager
def captured_stdout() -> Iterator[list[str]]:
    """What this thread writes to ``sys.stdout`` inside the block, kept out of the program's output
    (joined: ``"".join(buf)``); other threads' writes pass through."""
    with _captured_stdout() as buf:
        yield buf


def call_plugin_code(distribution: str, what: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> tuple[T, str]:
    """``call_plugin`` for a caller that reports a plugin's ordinary exceptions itself (``doctor``,
    ``bench``): an ``Exception`` is re-raised as it is (its class and message are the report), while
    ``SystemExit``, ``GeneratorExit`` and a ``KeyboardInterrupt`` that is not a real Ctrl-C become a
    ``PluginError`` naming ``distribution``; stdout is kept out of the program's output and returned."""
    try:
        return call_plugin(distribution, what, fn, *args, **kwargs)
    except PluginError as exc:
        if isinstance(exc.__cause__, Exception):
            raise exc.__cause__ from None
        raise


def describe_exception(exc: BaseException) -> str:
    """``"SystemExit: 9"``, ``"KeyboardInterrupt"``: the class and message in words."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def call_plugin(distribution: str, what: str, fn: Callable[..., T], *args: Any,
                **kwargs: Any) -> tuple[T, str]:
    """Run ``fn(*args, **kwargs)``, plugin code of ``distribution``; return ``(result, stdout text)``.

    ``what`` says what was called (``"import of 'x'"``, ``"hook attnplug_check_config"``)
    and appears in the error. A ``PluginError`` the plugin code raises passes
    through unchanged (it already names a distribution); every other
    ``BaseException`` becomes ``PluginError(distribution, f"{what} raised ...")``,
    except a real Ctrl-C, which is re-raised.
    """
    before = _sigint_count
    with _watching_sigint(), _captured_stdout() as buf:
        try:
            result = fn(*args, **kwargs)
        except PluginError:
            raise
        except KeyboardInterrupt as exc:
            if _sigint_count != before:
                raise  # the user pressed Ctrl-C: stop, as any Python program does
            raise PluginError(distribution, f"{what} raised {describe_exception(exc)}") from exc
        except BaseException as exc:
            raise PluginError(distribution, f"{what} raised {describe_exception(exc)}") from exc
    return result, "".join(buf)


def echo_output(distribution: str, what: str, text: str) -> None:
    """Move what plugin code printed to stderr, labelled (used outside discovery)."""
    if text:
        sys.stderr.write(f"[plugin {distribution} printed during {what}] {text.rstrip()}\n")


def output_note(distribution: str, what: str, text: str, limit: int = 200) -> str:
    """One line for a report: what a plugin printed, cut to ``limit`` characters."""
    shown = text.strip().replace("\n", "\\n")
    if len(shown) > limit:
        shown = shown[: limit - 3] + "..."
    return f"plugin distribution {distribution!r} wrote to stdout during {what} (kept out of the output): {shown!r}"
