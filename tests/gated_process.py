"""Processes held at a point of their run: a command-line run started as ``python -c SCRIPT ARGS`` whose script
waits at the point the test names until the gate file it is given is removed, and tells the test (a file
``<gate>.reached``) it got there; the kill tests send signals to it there."""

from __future__ import annotations

import os
import subprocess
import sys
import time


def launch_gated(started: list, script: str, args, gate, env: dict, what: str) -> subprocess.Popen:
    """Start ``script`` with ``args`` and the gate file ``gate`` (created here) in its environment as GATE, with
    ``env`` added; wait until it reaches the gate (at most 120 s; ``what`` names the point in the failure). The
    process is appended to ``started`` (``stop_all`` kills what is left)."""
    gate.write_text("")
    proc = subprocess.Popen([sys.executable, "-c", script, *args],
                            env=dict(os.environ, GATE=str(gate), OMP_NUM_THREADS="1", **env),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    started.append(proc)
    reached, deadline = gate.with_name(gate.name + ".reached"), time.time() + 120
    while not reached.exists():
        assert proc.poll() is None, proc.communicate()[1]
        assert time.time() < deadline, f"never reached {what}"
        time.sleep(0.02)
    return proc


def stop_all(started: list) -> None:
    """Kill whatever of ``started`` still runs (a failed test's leftovers) and collect them all."""
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
