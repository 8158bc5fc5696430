#!/usr/bin/env python3
"""Run shell command lines side by side, each line of their output prefixed with its name, and wait for all.

    python scripts/side_by_side.py NAME=COMMAND [NAME=COMMAND ...]

Each ``COMMAND`` runs under ``/bin/sh -c`` (so ``a && b`` chains steps of one stream) from the current directory,
with the current environment. Their output is printed live, line by line, as ``[NAME] line``; when all have
ended, one summary line per stream gives its exit status and wall time. The exit status is 0 when every
stream exited 0, else the first failing stream's (in the order given); a stream that fails does not stop the
others, so one run reports every failure.

CI (``tox -e tests``, tox.ini) runs the conformance suite beside the other test tiers this way: one
environment installed once, both CPU cores busy (the two streams take about as long).
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time


def parse(args: list[str]) -> list[tuple[str, str]]:
    """``NAME=COMMAND`` arguments as ``(name, command)`` pairs (a usage error for anything else)."""
    streams = []
    for arg in args:
        name, sep, command = arg.partition("=")
        if not sep or not name.strip() or not command.strip() or " " in name:
            raise SystemExit(f"side_by_side.py: expected NAME=COMMAND (NAME without spaces), got {arg!r}")
        streams.append((name, command))
    if not streams:
        raise SystemExit("side_by_side.py: nothing to run (give one or more NAME=COMMAND arguments)")
    if len({n for n, _ in streams}) != len(streams):
        raise SystemExit("side_by_side.py: stream names must differ")
    return streams


def _pump(name: str, pipe: object, lock: threading.Lock) -> None:
    for raw in iter(pipe.readline, b""):  # type: ignore[attr-defined]
        line = raw.decode("utf-8", "replace").rstrip("\n")
        with lock:
            sys.stdout.write(f"[{name}] {line}\n")
            sys.stdout.flush()


def run(streams: list[tuple[str, str]]) -> int:
    """Start every stream, print their output as it comes, wait for all; returns the exit status."""
    lock = threading.Lock()
    started = time.monotonic()
    procs, pumps = [], []
    for name, command in streams:
        with lock:
            print(f"[{name}] $ {command}", flush=True)
        proc = subprocess.Popen(["/bin/sh", "-c", command], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        pump = threading.Thread(target=_pump, args=(name, proc.stdout, lock), daemon=True)
        pump.start()
        procs.append(proc)
        pumps.append(pump)
    ended: dict[str, tuple[int, float]] = {}
    while len(ended) < len(procs):
        for (name, _), proc in zip(streams, procs):
            if name not in ended and proc.poll() is not None:
                ended[name] = (proc.returncode, time.monotonic() - started)
        time.sleep(0.2)
    for pump in pumps:
        pump.join()
    status = 0
    for name, _ in streams:
        code, wall = ended[name]
        print(f"side_by_side: {name} exited {code} after {wall / 60:.1f} min", flush=True)
        if code and not status:
            status = code
    return status


def main(argv: list[str] | None = None) -> int:
    return run(parse(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
