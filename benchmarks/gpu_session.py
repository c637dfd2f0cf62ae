"""Every GPU check and measurement of the project, run in one call of a lent device within its time.

    python3 benchmarks/gpu_session.py --deadline 560          # one 10-minute device call (timeout >= 580)
    python3 benchmarks/gpu_session.py --continue --deadline 200  # at once, on the warm machine: what is left
    python3 benchmarks/gpu_session.py model train --deadline 250 --cap model=300   # chosen parts
    python3 benchmarks/gpu_session.py --plan                  # parts, caps, commands, expected times; runs nothing

Run from the repository root; nothing is installed (the device's image has torch, triton and transformers,
and nothing can be fetched there). A lent device gives a session 15 minutes in all, a machine's start
(1-2 minutes) included, and one command at most 10: so the plan is one call with --deadline 560 and, on the
same warm machine, one ``--continue`` call with what is left (about 250 s). The parts run in order of
worth, each stopped at its cap (the time it took on the H200 of 2026-11-26 with a margin; an estimate for
those that have not run yet; interrupted, then killed with its children), and none is started with under
30 s, or under its expected time, left before --deadline (the device call's timeout: at least
the deadline + 20 s). Each part's output goes to its file under $OUT (or runs/gpu) as it comes, so a part
stopped halfway still shows how far it got; session.md says for each part what became of it, and what the
next call should run. At most 8 files: what the device tool brings back (the pattern parts share one).

Parts, in order (seconds each took on the H200 of 2026-11-26's fourth session from a cold machine,
mechanisms the third's, tiles, flexcost and blocksparse the second's; ~: an estimate). Tiles moved late: the
autotuner now times the same settings in the first calls of bench.
  tests        took 164  CUDA tests of the kernels (compiled for real, bf16 against the fp32 reference) and
                         of the paged kernels
  bench        took 216  allhere bench --profile: where each AHA path's time goes (kernel by kernel), then
                         the op's prefill / decode / training against the fastest dense SDPA backend, and the
                         launch settings the autotuner chose (164 s of it tuning)
  model        ~125      allhere bench --tables model: a Llama-3.2-1B-shaped model, plain SDPA (under torch's
                         backend choice and under flash/efficient only) against AHA (mu_f 7%): prefill
                         tokens/s at 8k and 32k, decode tokens/s at B = 8 with 32k and 128k contexts through
                         generate on allhere's in-place cache, and both models' decode step captured as a
                         CUDA graph over a StaticCache (took 90 s before the second backend choice and the
                         captured steps)
  darlatent    ~90       benchmarks/dar_latent_decode.py: dar_latent's decode kernel (B = 8 at 32k and 128k,
                         three model shapes) against plain SDPA's fastest backend, checked against its PyTorch
                         path (its 10 tests come in the tests part, ~15 s more)
  mechanisms   took 83   every mechanism in a Decoder against the CPU, the patterns' FlexAttention path, the
                         AA-MoE op, ring attention and FSDP2 (bf16, sharded checkpoint) in a one-rank NCCL
                         group
  train        ~180      SFT tokens/s of AHA against plain SDPA at the Llama-3.2-1B shape, 10 timed steps
                         (benchmarks/sft_throughput.py: one document per row, then packed documents of 512;
                         the first took ~115 s with the training kernels' tuning)
  patterns     ~110      benchmarks/patterns_speed.py, FlexAttention (the patterns' path on CUDA) at 8k: each
                         pattern compiles its mask builder and kernel on a cold machine
  patterns32k  ~130      the same at 32k (never finished inside one cap of 150 s with 8k before it)
  tiles        took 102  benchmarks/kernel_tiles.py: every launch setting the kernels' autotuner may pick on
                         this GPU, checked against the fp32 reference and timed; then the autotuner's first
                         calls (tuning included) and choices
  flexcost     ~80       benchmarks/flex_mask_cost.py at 32k: FlexAttention's time per pattern on the same
                         tiles with the pattern's predicate, its earlier table forms and no mask
  blocksparse  ~60       benchmarks/patterns_speed.py, the block-sparse op at 8k and 32k (measured twice on
                         an H200 and unchanged since: last)

The demo's ``tiny`` preset is not run on CUDA: its 2-minute models say nothing there (7.4 bits/byte, mu_f
100% on that H200).
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
    cap: int  # seconds: the part is stopped there (what it took on a GPU with a margin, or a guess)
    log: str  # its file under the output folder (parts may share one: each appends)
    commands: tuple  # argv lists, run one after the other within the cap; "{tmp}" is a scratch folder
    expect: int = 0  # seconds it is expected to take (measured where it ran; for --plan)


def _patterns(backend: str, *lengths: str) -> tuple:
    return tuple((PY, "benchmarks/patterns_speed.py", "--device", "cuda", "--n", n, "--backend", backend)
                 for n in lengths)


PARTS = {  # in order of worth; expected: seconds on the H200 of 2026-11-26 (fourth session), from a cold machine
    "tests": Part(215, "tests.log", (
        (PY, "-m", "pytest", "-q", "-rfEsx", "--durations=10", "tests/ops/test_gpu.py",
         "tests/ops/test_kernels.py", "tests/ops/test_aha_paged.py", "tests/ops/test_kernel_dar_latent.py",
         "tests/hf/test_captured_decode.py"),), 164),  # 87 tests, the captured decode's (~10 s), dar_latent's (~15 s)
    "bench": Part(290, "bench.log", (  # cold, 164 s of it tuning
        (PY, "-m", "allhere.cli", "bench", "--profile", "--out", "{tmp}/bench"),), 216),
    "model": Part(165, "model.log", (  # 90 s before the second SDPA choice and the captured steps
        (PY, "-m", "allhere.cli", "bench", "--tables", "model", "--out", "{tmp}/model"),), 125),
    "darlatent": Part(150, "model.log", ((PY, "benchmarks/dar_latent_decode.py"),), 90),  # never run
    "mechanisms": Part(120, "mechanisms.log", (
        (PY, "-m", "pytest", "-q", "-rfEsx", "--durations=15", "tests/mechanisms/test_gpu_mechanisms.py"),),
        83),  # 57 tests
    "train": Part(240, "train.log", tuple(
        (PY, "benchmarks/sft_throughput.py", "--device", "cuda", "--shape", "llama-1b", "--router-init", "global",
         "--steps", "10", "--warmup", "3", *extra) for extra in ((), ("--doc-len", "512"))),
        180),  # the first command ~115 s (the training kernels' tuning)
    "patterns": Part(150, "patterns.md", _patterns("flex", "8192"), 110),  # compiles a mask builder per pattern
    "patterns32k": Part(180, "patterns.md", _patterns("flex", "32768"), 130),
    "tiles": Part(150, "tiles.md", ((PY, "benchmarks/kernel_tiles.py", "--repeats", "5"),), 102),
    "flexcost": Part(150, "patterns.md", ((PY, "benchmarks/flex_mask_cost.py", "--device", "cuda"),), 80),
    "blocksparse": Part(100, "patterns.md", _patterns("blocksparse", "8192", "32768"), 60),
}
SUMMARY = "session.md"
MIN_START = 30  # seconds: no part is started with less left before the deadline (``needs``)
GRACE = 10  # seconds between the interrupt at a cap (pytest then prints its failures so far) and the kill
CAPPED = "stopped at the cap"


def needs(part: Part) -> float:
    """Seconds a part must have left before the deadline to be started: MIN_START, or its expected time (a
    part cut short is run again whole by --continue: the minutes it had were lost)."""
    return max(MIN_START, part.expect)


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
    lines += [f"| {name} | {parts[name].cap} | {took:.0f} | {result} | {parts[name].log} |"
              for name, result, took in rows]
    capped = [name for name, result, _ in rows if CAPPED in result]
    if waiting:
        lines += ["", f"Not started{note}: {' '.join(waiting)}."]
    if capped:
        lines += ["", f"Stopped at the cap: {' '.join(capped)}."]
    if waiting or capped:
        call = ["python3 benchmarks/gpu_session.py", *capped, *waiting,
                *(f"--cap {n}={2 * parts[n].cap}" for n in capped), "--deadline SECONDS"]
        lines += ["", f"Next call: `{' '.join(call)}`, or on the same warm machine `python3 benchmarks/gpu_session.py "
                  "--continue --deadline SECONDS` (the device call's timeout at least SECONDS + 20)"]
    text = "\n".join(lines) + "\n"
    (out / SUMMARY).write_text(text)
    return text


def print_plan(parts: dict, deadline: float) -> None:
    """Each part's cap, file, expected time and commands; then which parts the expected times fit before
    ``deadline`` (a part past it is stopped there and left to --continue)."""
    at, fits = 0, []
    for name, part in parts.items():
        print(f"{name}: cap {part.cap} s, expected ~{part.expect} s -> {part.log}")
        for cmd in part.commands:
            print("   ", " ".join(cmd[1:]))
        if deadline - at >= needs(part):
            fits.append(name)
        at += part.expect
    print(f"caps add up to {sum(p.cap for p in parts.values())} s, expected times to ~{at} s; deadline "
          f"{deadline:.0f} s: this call starts {' '.join(fits)}"
          + (f"; --continue runs {' '.join(n for n in parts if n not in fits)} and any part cut short"
             if len(fits) < len(parts) else ""))


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
    ap.add_argument("parts", nargs="*", metavar="PART",
                    help=f"parts to run, in this order (default: {' '.join(PARTS)})")
    ap.add_argument("--deadline", type=float, default=560, help="seconds from the start after which no part "
                    "starts, and at which a running one is stopped (default 560: one 10-minute device call)")
    ap.add_argument("--cap", action="append", default=[], metavar="PART=SECONDS", help="another cap for a part")
    ap.add_argument("--continue", dest="resume", action="store_true",
                    help="run what the earlier calls on this machine left (read from --state): the parts not started, "
                         "and those stopped at their cap with twice the cap; needs no look at their output first")
    ap.add_argument("--state", type=Path, default=ROOT / "runs" / "gpu_session_state.json",
                    help="where each call records its parts' results for --continue "
                         "(default runs/gpu_session_state.json, which stays on a warm machine between calls)")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "runs/gpu"),
                    help="default $OUT or runs/gpu")
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
    parts = {n: Part(caps.get(n, PARTS[n].cap), PARTS[n].log, PARTS[n].commands, PARTS[n].expect) for n in names}
    if args.plan:
        print_plan(parts, args.deadline)
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
            if left < needs(parts[name]):
                print("\n" + write_summary(args.out, header, parts, rows, names[i:],
                                           f" (under the {needs(parts[name]):.0f} s that {name} needs were left "
                                           f"before the deadline of {args.deadline:.0f} s)"))
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
