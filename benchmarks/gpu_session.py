"""Every GPU check and measurement of the project, run in one call of a lent device within its time.

    python3 benchmarks/gpu_session.py                         # every part in order, until --deadline
    python3 benchmarks/gpu_session.py bench patterns --deadline 250 --cap bench=400
    python3 benchmarks/gpu_session.py --continue --deadline 200  # what the last call here left, at once
    python3 benchmarks/gpu_session.py --plan                  # the parts and their caps; runs nothing

Run from the repository root; nothing is installed (the device's image has torch, triton and transformers,
and nothing can be fetched there). A lent device gives a session 15 minutes in all, a machine's start
included, and one command at most 10: so the parts run in order of what they are worth, each stopped at
its cap (a guess: none has run on a GPU yet; interrupted, then killed with its children), and none is
started with under 30 s left before --deadline (the device call's timeout: at least the deadline + 20 s).
Each part's output goes to its own file under $OUT (or runs/gpu) as it comes, so a part stopped halfway
still shows how far it got; session.md says for each part what became of it, and what the next call
should run. At most 8 files: what the device tool brings back.

Parts, in order:
  tests       CUDA tests of the kernels: compiled for real, bf16 against the fp32 reference
  bench       allhere bench --profile: where each AHA path's time goes (kernel by kernel), then prefill /
              decode / training against the fastest dense SDPA backend (the goals)
  mechanisms  every mechanism in a Decoder against the CPU, the patterns' FlexAttention path, the AA-MoE
              op, ring attention and FSDP2 (bf16, sharded checkpoint) in a one-rank NCCL group
  patterns    benchmarks/patterns_speed.py at n = 8192 and 32768, block-sparse then FlexAttention
  train       allhere demo --preset tiny on CUDA, then SFT tokens/s of AHA against SDPA
              (benchmarks/sft_throughput.py, one document per row, then packed documents of 512 tokens)
  tiles       benchmarks/kernel_tiles.py: block sizes, warps, stages, decode split of the Triton kernels
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

PY = sys.executable
ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Part:
    cap: int  # seconds: the part is stopped there (a guess, to be replaced by what the GPU shows)
    log: str  # its file under the output folder
    commands: tuple  # argv lists, run one after the other within the cap; "{tmp}" is a scratch folder


PARTS = {
    "tests": Part(200, "tests.log", (
        (PY, "-m", "pytest", "-q", "-rfEsx", "--durations=10", "tests/test_gpu.py", "tests/test_kernels.py"),)),
    "bench": Part(240, "bench.log", (
        (PY, "-m", "allhere.cli", "bench", "--profile", "--out", "{tmp}/bench"),)),
    "mechanisms": Part(200, "mechanisms.log", (
        (PY, "-m", "pytest", "-q", "-rfEsx", "--durations=15", "tests/test_gpu_mechanisms.py"),)),
    "patterns": Part(150, "patterns.md", tuple(
        (PY, "benchmarks/patterns_speed.py", "--device", "cuda", "--n", n, "--backend", backend)
        for n in ("8192", "32768") for backend in ("blocksparse", "flex"))),
    "train": Part(180, "train.log", (
        (PY, "-m", "allhere.cli", "demo", "--preset", "tiny", "--device", "cuda", "--no-progress",
         "--out", "{tmp}/demo"),
        (PY, "benchmarks/sft_throughput.py", "--device", "cuda", "--steps", "60", "--warmup", "10"),
        (PY, "benchmarks/sft_throughput.py", "--device", "cuda", "--steps", "60", "--warmup", "10",
         "--doc-len", "512", "--router-init", "local"))),
    "tiles": Part(200, "tiles.md", ((PY, "benchmarks/kernel_tiles.py"),)),
}
SUMMARY = "session.md"
MIN_START = 30  # seconds: a part is not started with less left before the deadline
GRACE = 10  # seconds between the interrupt at a cap (pytest then prints its failures so far) and the kill
CAPPED = "stopped at the cap"
RUNNING = "running: stopped from outside?"


def _stop(proc) -> None:
    """Interrupt the command's process group, and kill it if it has not ended ``GRACE`` seconds later."""
    for sig, wait in ((signal.SIGINT, GRACE), (signal.SIGKILL, 30)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=wait)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def run_command(argv, log, seconds: float) -> str:
    """Run ``argv``, its output appended to ``log`` (an open file) and echoed, for at most ``seconds``
    (the interrupt's grace included); its whole process group is stopped at the limit, or when this
    process is interrupted. Returns "ok", "exit N" or ``CAPPED``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "PYTHONUNBUFFERED": "1"}  # allhere is not installed on the device: the scripts import it from here
    # Its own process group (so that a cap stops its children too), in this session (so that whatever ends
    # this process's session ends it as well).
    group = {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                            cwd=ROOT, env=env, bufsize=1, **group)

    def pump():
        for line in proc.stdout:
            log.write(line)
            log.flush()
            sys.stdout.write(line)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        rc = proc.wait(timeout=max(seconds - GRACE, 0.1))
    except subprocess.TimeoutExpired:
        _stop(proc)
        rc = None
    except BaseException:
        _stop(proc)
        raise
    reader.join(timeout=5)
    return CAPPED if rc is None else ("ok" if rc == 0 else f"exit {rc}")


def run_part(part: Part, out: Path, seconds: float, tmp: str) -> tuple[str, float]:
    """(what became of the part, seconds it took): its commands in order within ``seconds``. A command that
    fails does not stop the next (they measure apart); one stopped at the cap ends the part."""
    t0, failures = time.monotonic(), []
    with open(out / part.log, "a") as log:
        for argv in part.commands:
            argv = [a.replace("{tmp}", tmp) for a in argv]
            log.write(f"$ {' '.join(argv)}\n")
            log.flush()
            status = run_command(argv, log, seconds - (time.monotonic() - t0))
            if status != "ok":
                failures.append(f"{status} in `{' '.join(argv[1:])}`")
            if status == CAPPED:
                break
    return "; ".join(failures) or "ok", time.monotonic() - t0


def versions() -> str:
    code = ("import torch, triton, transformers; print('torch', torch.__version__, '| triton', triton.__version__, "
            "'| transformers', transformers.__version__, '|', torch.cuda.get_device_name() "
            "if torch.cuda.is_available() else 'no CUDA device')")
    try:
        done = subprocess.run([PY, "-c", code], capture_output=True, text=True, errors="replace", timeout=120)
    except subprocess.TimeoutExpired:
        return "versions: no answer in 120 s (CUDA initialisation hanging?)"
    lines = (done.stdout or done.stderr).strip().splitlines()
    return lines[-1] if lines else "versions: nothing printed"


def write_summary(out: Path, header: str, parts: dict, rows: list, waiting: list, note: str) -> str:
    """session.md: one row per part started (name, result, seconds), then what a next call should run: the
    parts not started, and those stopped at their cap (with a larger cap)."""
    lines = [f"# GPU session, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", "", header, "",
             "| part | cap s | took s | result | file |", "|---|---|---|---|---|"]
    lines += [f"| {name} | {parts[name].cap} | {took:.0f} | {result} | {parts[name].log} |" for name, result, took in rows]
    capped = [name for name, result, _ in rows if CAPPED in result]
    if waiting:
        lines += ["", f"Not started{note}: {' '.join(waiting)}."]
    if capped:
        lines += ["", f"Stopped at the cap: {' '.join(capped)}."]
    if waiting or capped:
        call = ["python3 benchmarks/gpu_session.py", *capped, *waiting, *(f"--cap {n}={2 * parts[n].cap}" for n in capped),
                "--deadline SECONDS"]
        lines += ["", f"Next call: `{' '.join(call)}`, or on the same warm machine `python3 benchmarks/gpu_session.py "
                  "--continue --deadline SECONDS` (the device call's timeout at least SECONDS + 20)"]
    text = "\n".join(lines) + "\n"
    (out / SUMMARY).write_text(text)
    return text


def parse_caps(items: list[str]) -> dict[str, int]:
    caps = {}
    for item in items:
        name, _, value = item.partition("=")
        if name not in PARTS or not value.isdigit() or int(value) <= 0:
            raise SystemExit(f"error: --cap takes PART=SECONDS with a part of {', '.join(PARTS)}, got {item!r}")
        caps[name] = int(value)
    return caps


def read_state(state_file: Path) -> dict:
    """What the earlier calls recorded: {"order": parts planned, "caps": {part: s}, "results": {part: result}}."""
    try:
        return json.loads(state_file.read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: --continue needs the state of an earlier call on this machine: {state_file} "
                         f"could not be read ({e})") from None


def left_by(state: dict) -> tuple[list[str], dict[str, int]]:
    """(parts, caps) that the calls recorded in ``state`` left: those never started or cut short (stopped
    from outside), and those stopped at their cap, which get twice it."""
    results, caps = state["results"], state["caps"]
    names = [n for n in state["order"] if results.get(n, RUNNING) == RUNNING or CAPPED in results[n]]
    return names, {n: 2 * caps[n] for n in names if CAPPED in results.get(n, "")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("parts", nargs="*", metavar="PART", help=f"parts to run, in this order (default: {' '.join(PARTS)})")
    ap.add_argument("--deadline", type=float, default=560, help="seconds from the start after which no part "
                    "starts, and at which a running one is stopped (default 560: one 10-minute device call)")
    ap.add_argument("--cap", action="append", default=[], metavar="PART=SECONDS", help="another cap for a part")
    ap.add_argument("--continue", dest="resume", action="store_true",
                    help="run what the earlier calls on this machine left (read from --state): the parts not started, "
                         "and those stopped at their cap with twice the cap; needs no look at their output first")
    ap.add_argument("--state", type=Path, default=ROOT / "runs" / "gpu_session_state.json",
                    help="where each call records its parts' results for --continue (default runs/gpu_session_state.json, "
                         "which stays on a warm machine between calls)")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "runs/gpu"), help="default $OUT or runs/gpu")
    ap.add_argument("--plan", action="store_true", help="print the parts, their caps and commands; run nothing")
    args = ap.parse_args(argv)
    unknown = [p for p in args.parts if p not in PARTS]
    if unknown:
        ap.error(f"unknown part(s) {', '.join(unknown)}: choose from {', '.join(PARTS)}")
    if args.resume and args.parts:
        ap.error("--continue takes no parts: it runs what the earlier calls left")
    if args.resume:
        state = read_state(args.state)
        names, caps = left_by(state)
    else:
        names, caps = args.parts or list(PARTS), {}
        state = {"order": names, "caps": {}, "results": {}}
    caps.update(parse_caps(args.cap))
    parts = {n: Part(caps.get(n, PARTS[n].cap), PARTS[n].log, PARTS[n].commands) for n in names}
    if args.plan:
        for name, part in parts.items():
            print(f"{name}: cap {part.cap} s -> {part.log}")
            for cmd in part.commands:
                print("   ", " ".join(cmd[1:]))
        print(f"caps add up to {sum(p.cap for p in parts.values())} s; deadline {args.deadline:.0f} s")
        return 0
    if not names:
        print(f"nothing left: every part in {args.state} has run")
        return 0
    def record(name: str, result: str) -> None:
        state["caps"][name], state["results"][name] = parts[name].cap, result
        args.state.parent.mkdir(parents=True, exist_ok=True)
        args.state.write_text(json.dumps(state, indent=1) + "\n")

    args.out.mkdir(parents=True, exist_ok=True)
    start, rows, failed = time.monotonic(), [], False
    header = versions()
    print(header, flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for i, name in enumerate(names):
            left = args.deadline - (time.monotonic() - start)
            if left < MIN_START:
                print("\n" + write_summary(args.out, header, parts, rows, names[i:],
                                           f" (under {MIN_START} s were left before the deadline of "
                                           f"{args.deadline:.0f} s)"))
                return 1
            # Written first, so that a call stopped from outside still says which part it was in.
            write_summary(args.out, header, parts, rows + [(name, RUNNING, 0)], names[i + 1:], "")
            record(name, RUNNING)
            print(f"\n=== {name} (cap {parts[name].cap} s, {left:.0f} s to the deadline) ===", flush=True)
            result, took = run_part(parts[name], args.out, min(parts[name].cap, left), tmp)
            rows.append((name, result, took))
            record(name, result)
            failed |= result != "ok"
    print("\n" + write_summary(args.out, header, parts, rows, [], ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
