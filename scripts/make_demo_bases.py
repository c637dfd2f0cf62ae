"""Make the pretrained bases that ``allhere demo`` starts from (``allhere_recipes/bases/``).

    python3 scripts/make_demo_bases.py                  # both tasks of the cpu preset, bf16, run folder runs/bases
    python3 scripts/make_demo_bases.py --task recall --dtype fp32 --run runs/bases-fp32

For each task it runs the demo's own pretraining (``allhere_recipes.tasks.start_task`` with the ``cpu``
preset's plan and seed; ``allhere demo --pretrain`` runs the same), in ``--run`` (a finished pretraining
there is reused, an interrupted one resumed), then writes the pretrained model in ``--dtype`` as
``cpu-<task>.safetensors`` and its provenance ``cpu-<task>.json``: this command, the git commit, the data
with a fingerprint of the corpus split, Python, torch, the CPU, the configs, the pretraining curve and the
held-out numbers of the saved file (and of the fp32 model before it was rounded). Run it from a clean
checkout of the repository: the provenance names the commit and says whether the tree was modified.
"""

from __future__ import annotations

import argparse
import hashlib
import platform
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from allhere.model import Decoder
from allhere_recipes import bases
from allhere_recipes.bases import base_files, heldout, load_base, restore, save_base
from allhere_recipes.plans import TASKS, plans
from allhere_recipes.rundir import write_json
from allhere_recipes.tasks import start_task

ROOT = Path(__file__).resolve().parents[1]
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def git(*args: str) -> str:
    try:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def source() -> dict:
    """The commit this checkout is at and whether its tracked files differ from it (read before anything runs)."""
    return {"commit": git("rev-parse", "HEAD") or "unknown",
            "tree_modified": bool(git("status", "--porcelain", "--untracked-files=no"))}


def make(name: str, run: Path, dtype: str, folder: Path | None, command: str, code: dict | None = None) -> dict:
    """Pretrain (or reuse) ``name``'s base in ``run``, save it in ``folder`` with its provenance; return that."""
    plan = plans(bases.PRESET, "cpu")[name]
    t0 = time.time()
    task = start_task(run, name, plan, None, progress=True, base=None)
    seconds = time.time() - t0
    path, prov_path = base_files(name, folder)
    before = heldout(name, plan, task.data, task.full)
    save_base(path, task.full, {"step": plan.pretrain.steps, "train_config": plan.pretrain.to_dict()}, DTYPES[dtype])
    saved = Decoder(plan.model)
    restore(saved, path)
    data = path.read_bytes()
    prov = {
        "file": path.name, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data), "dtype": dtype,
        "what": f"the full-attention model of `allhere demo --preset {bases.PRESET}`, task {name}, after its "
                "pretraining",
        "command": command, **(code or source()),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(), "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads(),
        "pretrain_seconds": round(seconds, 1),  # 0-ish when --run held the finished pretraining already
        "data": {"description": task.data.description, "fingerprint": task.data.fingerprint},
        "steps": plan.pretrain.steps, "seed": plan.pretrain.seed, "seq_len": plan.seq_len,
        "model_config": plan.model.to_dict(), "train_config": plan.pretrain.to_dict(),
        "heldout": heldout(name, plan, task.data, saved.eval()), "heldout_fp32": before,
        "pretrain_evals": task.pretrain_curve,
    }
    write_json(prov_path, prov)
    load_base(name, plan, folder)  # what the demo will do with it
    return prov


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", default="runs/bases", help="run folder of the pretraining (default runs/bases)")
    p.add_argument("--task", dest="tasks", action="append", choices=TASKS, help="only this task (default: both)")
    p.add_argument("--dtype", default="bf16", choices=tuple(DTYPES), help="weights of the saved base (default bf16)")
    p.add_argument("--folder", default=None, help="where the bases go (default allhere_recipes/bases)")
    args = p.parse_args(argv)
    command = " ".join(["python3", "scripts/make_demo_bases.py", *(sys.argv[1:] if argv is None else argv)])
    code = source()
    for name in args.tasks or TASKS:
        prov = make(name, Path(args.run), args.dtype, args.folder, command, code)
        h, h32 = prov["heldout"], prov["heldout_fp32"]
        print(f"{prov['file']}: {prov['bytes']:,} bytes, held-out loss {h['loss']:.5f} ({args.dtype}; fp32 "
              f"{h32['loss']:.5f})" + (f", accuracy {h['accuracy']:.4f}" if "accuracy" in h else ""), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
