"""``attnplug`` entry point: one subcommand per module, each imported only when chosen."""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Sequence

#: subcommand -> (module under attnplug.cli, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "list": ("list_cmd", "list discovered backends: distribution, aliases, availability, capabilities"),
    "doctor": ("doctor_cmd", "check this host end to end: discover, resolve, build and run every backend"),
    "resolve": ("resolve_cmd", "resolve and explain the (prefill, decode) pair pass by pass"),
    "bench": ("bench_cmd", "benchmark backends against the per-request loop and the contiguous floor, side by side"),
    "lint": ("lint_cmd", "static guard: report reads of the base attention_backend field"),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser. Only the chosen subcommand's module is imported (``attnplug list``
    pays for nothing else); ``command=None`` imports all of them (docs, tests)."""
    parser = argparse.ArgumentParser(
        prog="attnplug",
        description="Pluggable attention backends for LLM serving engines.",
        epilog="Environment: ATTNPLUG_PLUGINS (allow-list of plugin distributions or entry-point names), "
        "ATTNPLUG_DISABLE_PLUGINS (deny-list), ATTNPLUG_HOST_JSON (explain a recorded host).",
    )
    from attnplug import __version__

    parser.add_argument("--version", action="version", version=f"attnplug {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        if command is None or command == name:
            _add_arguments(module, p)
    return parser


def _add_arguments(module: str, parser: argparse.ArgumentParser) -> None:
    """Each subcommand module defines ``add_arguments(parser)`` and ``run(args) -> int``;
    modules stay light at import time (torch is imported inside ``run``)."""
    mod = importlib.import_module(f"attnplug.cli.{module}")
    mod.add_arguments(parser)


#: Exit statuses every subcommand shares (``docs/reliability.md``).
EXIT_FAILED = 1  # a check failed, a plugin broke its contract, or an internal error
EXIT_USAGE = 2  # a bad argument, flag value, environment variable or input file
EXIT_BROKEN_PIPE = 141  # the reader went away (``attnplug doctor --json | head``): 128 + SIGPIPE, like Unix tools
EXIT_INTERRUPTED = 130  # Ctrl-C: 128 + SIGINT
TRACEBACK_ENV = "ATTNPLUG_TRACEBACK"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    chosen = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(chosen if chosen in SUBCOMMANDS else None)
    args = parser.parse_args(argv)  # usage errors: argparse prints one line and exits 2
    if not getattr(args, "command", None):
        parser.print_help()
        return EXIT_USAGE
    return run_guarded(args)


def run_guarded(args: argparse.Namespace) -> int:
    """Run the chosen subcommand; every error becomes one line on stderr and an exit status.

    A user error (bad value, unknown or unavailable backend, a malformed
    ``ATTNPLUG_*`` variable or input file) exits 2; a plugin at fault or a
    failed check exits 1; a closed pipe exits 141 quietly; Ctrl-C exits 130.
    Never a traceback, unless ``ATTNPLUG_TRACEBACK=1``.
    """
    from attnplug.errors import AttnplugError, PluginError

    prog = f"attnplug {args.command}"
    try:
        mod = importlib.import_module(f"attnplug.cli.{args._module}")
        status = int(mod.run(args) or 0)
        sys.stdout.flush()
        return status
    except BrokenPipeError:
        _drop_stdout()
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt:
        _say(prog, "interrupted")
        return EXIT_INTERRUPTED
    except PluginError as exc:
        return _fail(prog, exc, EXIT_FAILED)
    except AttnplugError as exc:
        return _fail(prog, exc, EXIT_USAGE if isinstance(exc, _user_errors()) else EXIT_FAILED)
    except (ValueError, TypeError, OSError, LookupError) as exc:
        return _fail(prog, exc, EXIT_USAGE)
    except Exception as exc:  # a bug: still one line (the traceback with ATTNPLUG_TRACEBACK=1)
        return _fail(prog, exc, EXIT_FAILED, internal=True)


def _user_errors() -> tuple[type[BaseException], ...]:
    from attnplug.errors import BackendUnavailableError, ConfigError, NotSupportedError, ShapeError, UnknownBackendError

    return (ConfigError, UnknownBackendError, BackendUnavailableError, NotSupportedError, ShapeError)


def _fail(prog: str, exc: BaseException, status: int, internal: bool = False) -> int:
    import os

    from attnplug.errors import AttnplugError

    if os.environ.get(TRACEBACK_ENV):
        import traceback

        traceback.print_exception(type(exc), exc, exc.__traceback__)
    if isinstance(exc, OSError) and exc.strerror:
        text = f"{exc.strerror}: {exc.filename!r}" if exc.filename else exc.strerror
    else:
        text = str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)
    text = " ".join(text.split()) or type(exc).__name__  # one line, whatever the message holds
    if internal:
        text = f"internal error: {type(exc).__name__}: {text} (set {TRACEBACK_ENV}=1 for the traceback)"
    elif not isinstance(exc, (AttnplugError, ValueError, OSError)):
        text = f"{type(exc).__name__}: {text}"
    _say(prog, f"error: {text}")
    return status


def _say(prog: str, message: str) -> None:
    try:
        print(f"{prog}: {message}", file=sys.stderr)
    except (BrokenPipeError, ValueError):  # pragma: no cover - stderr gone too
        pass


def _drop_stdout() -> None:
    """After a closed pipe: point stdout at /dev/null so the exit-time flush stays quiet."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # pragma: no cover - no real stdout
        pass


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
