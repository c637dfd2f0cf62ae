"""Commands on a trained model: ``perplexity``, ``eval``, ``convert``, ``sft``."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from ..validation import ConfigError
from . import args as a


def _mechanism(args):
    """The mechanism config the conversion flags ask for, from the registry: each flag sets the field of
    the same name; a flag the mechanism has no field for is an error, not silently ignored."""
    from .. import registry

    cls = registry.get(args.mechanism).config
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    flags = ("window", "tau", "lam", "sinks", "d_down", "rope_pairs")
    given = {k: getattr(args, k) for k in flags if getattr(args, k) is not None}
    foreign = sorted(set(given) - fields)
    if foreign:
        flags = ", ".join("--" + k.replace("_", "-") for k in foreign)
        raise ConfigError(f"{flags} {'is not a setting' if len(foreign) == 1 else 'are not settings'} of "
                          f"--mechanism {args.mechanism}")
    if "d_down" in fields and "d_down" not in given:
        raise ConfigError(f"--mechanism {args.mechanism} needs --d-down (the bottleneck width, e.g. hidden size / 4)")
    return cls(**given)


def _hf_kinds() -> tuple[str, ...]:
    """The mechanisms ``convert`` can build from its flags: installable in an HF model, with a window
    (the others -- BigBird's blocks, say -- are converted from Python with ``allhere.hf.convert``)."""
    from .. import registry

    return tuple(k for k in registry.kinds() if registry.get(k).module.hf_support
                 and "window" in {f.name for f in dataclasses.fields(registry.get(k).config)})


def _check_out(out: str, model: str, resume: bool | None = None) -> None:
    """The output folder of a model command: never the input model's folder, inside it or holding it; new or empty
    unless ``resume`` (None: the command cannot resume) continues the run it holds."""
    out_p, model_p = Path(out).resolve(), Path(model).resolve()
    if out_p == model_p or model_p in out_p.parents:
        raise ConfigError(f"--out {out} is the input model's folder{'' if out_p == model_p else ' or inside it'}; "
                          "choose a new folder (nothing was written)")
    if out_p in model_p.parents:  # e.g. sft --model RUN/model --out RUN: the run would write over its input
        raise ConfigError(f"--out {out} holds the input model ({model}); choose a folder outside it (nothing was "
                          "written)")
    from ..runtime.atomic_folder import holds_files
    from ..runtime.reporting import stale_events
    from ..runtime.runlock import ensure_free

    ensure_free(out_p)  # a folder another process writes is refused as such
    busy = holds_files(out_p)  # a lock left by a killed run does not count
    if busy and resume is not None and stale_events(out_p) is not None:
        busy = False  # the TensorBoard events of a run killed before its first checkpoint: sft replaces them
    if busy and not resume:
        hint = "choose" if resume is None else "pass --resume to continue the run there, or choose"
        raise ConfigError(f"--out {out} already holds files; {hint} a new folder (nothing was written)")
    if resume and not busy:
        raise ConfigError(f"--resume: {out} holds no run to continue")


# perplexity -------------------------------------------------------------------------------------------

def perplexity_arguments(p: argparse.ArgumentParser) -> None:
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--checkpoint", type=a.existing_file,
                       help="an allhere checkpoint.safetensors (e.g. runs/demo/stdlib/aha/...); this or --model")
    which.add_argument("--model", type=a.model_folder,
                       help="a Hugging Face causal LM folder (plain, or saved by allhere convert / sft), "
                            f"{a.GGUF_HELP}; this or --checkpoint")
    a.data_flag(p)
    p.add_argument("--seq-len", type=a.positive, default=256, help="window length (default 256)")
    p.add_argument("--stride", type=a.positive, default=None, help="window advance (default seq-len / 2)")
    p.add_argument("--min-len", type=a.positive_or_zero, default=0,
                   help="skip documents shorter than this, e.g. the AHA window (default 0: none skipped)")
    p.add_argument("--max-docs", type=a.positive, default=None,
                   help="only the first N validation documents (default: all)")
    a.device_flag(p)
    a.progress_flag(p)


def perplexity(args) -> None:
    from ..data.corpus import stdlib_corpus, text_corpus
    from ..eval.perplexity import hf_perplexity, rolling_perplexity
    from ..runtime.model_checkpoint import load_model

    corpus = stdlib_corpus() if args.data is None else text_corpus(args.data)
    docs = corpus.val_docs[: args.max_docs]
    settings = (args.seq_len, args.stride, args.min_len, args.device, not args.no_progress)
    if args.model is not None:
        res = hf_perplexity(args.model, docs, *settings)
    else:
        res = rolling_perplexity(load_model(args.checkpoint, device=args.device)[0], docs, *settings)
    mu = "" if res["mu_f"] is None else f", mu_f {100 * res['mu_f']:.1f}%"
    if "global_share" in res:
        share = res["global_share"]
        mu += (f"; (layer, head, token) triples reading the whole prefix: {100 * share['before']:.1f}% before "
               f"conversion, {100 * share['after']:.1f}% after")
    print(f"{res['tokens']:,} tokens in {len(docs) - res['skipped_docs']} documents "
          f"({res['skipped_docs']} skipped): loss {res['loss']:.4f} nats, perplexity {res['perplexity']:.3f}, "
          f"{res['bits_per_token']:.4f} bits/token{mu}")


# eval -------------------------------------------------------------------------------------------------

def eval_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=a.checkpoint_or_model, required=True,
                   help=f"an allhere checkpoint (.safetensors), a transformers causal LM folder, {a.GGUF_HELP} "
                        "(required)")
    p.add_argument("--tasks", type=a.names, required=True,
                   help="comma-separated lm-eval task names, e.g. hellaswag,arc_easy (required)")
    p.add_argument("--include-path", type=a.existing_folder, default=None,
                   help="folder of your own lm-eval task YAMLs (default: lm-eval's tasks only)")
    p.add_argument("--limit", type=a.positive, default=None,
                   help="only the first N documents of each task (default: all)")
    p.add_argument("--num-fewshot", type=a.positive_or_zero, default=None,
                   help="few-shot examples per prompt (default: each task's own setting)")
    a.device_flag(p, "cpu")
    p.add_argument("--batch-size", type=a.positive, default=16,
                   help="requests per forward pass or generation batch, longest first (default 16)")
    a.progress_flag(p)


def evaluate(args) -> None:
    from ..eval.harness import evaluate as harness

    results = harness(args.model, args.tasks, args.include_path, args.limit, args.device, args.num_fewshot,
                      verbose=args.verbose, show_progress=not args.no_progress, batch_size=args.batch_size)
    for task, metrics in results.items():
        shown = ", ".join(f"{k.split(',')[0]} {v:.4f}" for k, v in metrics.items()
                          if isinstance(v, float) and "stderr" not in k)
        print(f"{task}: {shown}")


# convert, sft -----------------------------------------------------------------------------------------

def _print_notes(config, layers: str) -> None:
    from ..hf.convert import conversion_notes

    for note in conversion_notes(config, layers):
        print(note, file=sys.stderr)


def convert_arguments(p: argparse.ArgumentParser) -> None:
    a.model_flag(p)
    p.add_argument("--out", type=a.out_folder, required=True,
                   help="a new or empty folder to save the converted model into (required)")
    a.conversion_flags(p, _hf_kinds())
    p.add_argument("--calibration", type=a.existing_file, default=None, metavar="TEXT",
                   help="a UTF-8 text file the host's own attention reads. aha: the routers are taught from it with "
                        "the weights as they are (what each (token, head) loses by reading locally, on 32 windows "
                        "of the text and 32 of plain sentences, facts planted and asked for beyond the window), a "
                        "usable model with no training; dar_latent: chooses the rotary pairs kept per kv head (the "
                        "pairs of largest |q||k|, MHA2MLA's choice; its first 8 windows of 512 tokens). default: none "
                        "(AHA's routers start open; dar_latent takes the same score on the weights)")
    p.add_argument("--mu-f", type=a.fraction, default=None, metavar="SHARE",
                   help="aha with --calibration: the share of (token, head) pairs the taught routers send to full "
                        "attention on the calibration text, 0 < SHARE < 1 (default 0.1)")
    p.add_argument("--format", choices=("allhere", "faolmo"), default="allhere",
                   help="allhere: transformers' files plus allhere's settings (default); faolmo: the checkpoint "
                        "format of the AHA paper's authors (OLMo-2 and AHA only, tau 0.5, a router without bias: "
                        "every head starts local until fine-tuned)")
    a.progress_flag(p)


def convert(args) -> None:
    from ..runtime.runlock import run_lock

    _check_out(args.out, args.model)  # before the lock creates --out: a refused folder is left as it is
    with run_lock(args.out):  # one writer: a second convert or sft into the same --out is refused in one line
        _convert(args)


def _convert(args) -> None:
    from ..hf import convert as hf_convert
    from ..hf import save_pretrained
    from ..hf.io import check_causal_lm, load_local, saved_mechanism
    from ..runtime.atomic_folder import write_folder

    mech = _mechanism(args)
    if args.format == "faolmo":  # the AHA authors' format: the paper's router, no bias, gate at 0.5
        from ..hf.faolmo import check_mechanism

        mech = dataclasses.replace(mech, router_bias=False) if getattr(mech, "kind", None) == "aha" else mech
        check_mechanism(mech)
    _check_out(args.out, args.model)  # again, holding the lock: another run may have filled it meanwhile
    config = check_causal_lm(args.model)
    if args.format == "faolmo" and config.model_type != "olmo2":
        raise ConfigError(f"--format faolmo holds OLMo-2 models; {args.model} holds model_type {config.model_type!r}")
    saved = saved_mechanism(config)
    if saved is not None:
        raise ConfigError(f"--model {args.model} is already converted ({type(saved).__name__}); every command "
                          "taking --model loads it as it is (Python: allhere.hf.load_pretrained)")
    teach = args.mechanism == "aha" and args.calibration is not None
    if args.calibration is not None and args.mechanism not in ("aha", "dar_latent"):
        raise ConfigError(f"--calibration teaches AHA's routers or chooses dar_latent's rotary pairs; --mechanism "
                          f"{args.mechanism} takes no calibration text")
    if args.mu_f is not None and not teach:
        raise ConfigError("--mu-f is the budget of routers taught from --calibration TEXT: it needs --mechanism aha "
                          "and --calibration")
    check_causal_lm(args.model, convertible=True, layers=args.layers, mechanism=mech)  # before any weight is read
    text = calibration = None
    if args.calibration is not None:
        from ..hf.calibration import calibration_ids, calibration_text
        from ..teaching import WINDOWS, teaching_length

        text = (calibration_text(args.calibration, WINDOWS, teaching_length(mech.window)) if teach
                else calibration_text(args.calibration))
        if not text.strip():
            raise ConfigError(f"--calibration {args.calibration}: the file holds no text")
    tokenizer, model = load_local(args.model, convertible=True, layers=args.layers)
    if text is not None and not teach:
        calibration = calibration_ids(tokenizer, text)
        print(f"calibration: {calibration.shape[0]} x {calibration.shape[1]} tokens of {args.calibration}",
              file=sys.stderr)
    _print_notes(model.config, args.layers)
    hf_convert(model, mech, layers=args.layers, calibration=calibration)
    taught = _teach(model, tokenizer, text, mech, args) if teach else None
    with write_folder(args.out) as partial:  # whole or not at all: a killed convert leaves no half model
        save_pretrained(model, partial, format=args.format)
        tokenizer.save_pretrained(str(partial))
        _convert_card(model, args, taught, partial)
    fmt = " in the AHA authors' faolmo format" if args.format == "faolmo" else ""
    print(f"{args.mechanism.upper()} model ({mech}) saved to {args.out}{fmt}; load it with allhere.hf.load_pretrained")


def _taught_mu_f(args) -> float:
    return 0.1 if args.mu_f is None else args.mu_f  # --mu-f's default


def _convert_card(model, args, taught, folder) -> None:
    """The converted model's README.md (``allhere.hf.card``) in ``folder`` (the one written before it becomes
    ``--out``): the settings, the teaching's numbers where it taught."""
    from pathlib import Path

    from ..hf.card import teaching_results, write_card

    settings = {"format": args.format if args.format != "allhere" else None,
                "calibration": Path(args.calibration).name if args.calibration is not None else None}
    results = []
    if taught is not None:
        settings["mu_f_target"] = _taught_mu_f(args)
        results = teaching_results(taught)
    write_card(folder, model.config, "allhere convert", source=args.model, settings=settings, results=results,
               shown_as=args.out)


def _teach(model, tokenizer, text: str, mech, args):
    """AHA's routers taught from the calibration text (``allhere.teaching``), with a line per pass; what the teaching
    found (``allhere.teaching.Teaching``)."""
    from ..runtime.progress import progress
    from ..teaching import HAYSTACKS, teach_routers, teaching_windows

    try:
        windows, answers = teaching_windows(tokenizer, text, mech.window)
    except ConfigError as e:
        raise ConfigError(f"--calibration {args.calibration}: {e}") from None
    mu_f = _taught_mu_f(args)
    shown = progress(len(windows), "teaching the routers", enabled=not args.no_progress)
    taught = teach_routers(model, list(windows.split(1)), mu_f, answers=list(answers.split(1)), done=shown.update)
    shown.close()
    print(f"routers taught on {windows.shape[0] - HAYSTACKS} windows of {windows.shape[1]} tokens of "
          f"{args.calibration} and {HAYSTACKS} of plain sentences (facts planted beyond the window): mu_f "
          f"{taught.mu_f:.1%} there, {taught.answer_mu_f:.1%} where a fact is "
          f"answered; of the pairs the full model's attention needs most they send {taught.recall:.0%} to full "
          "attention", file=sys.stderr)
    return taught


def sft_arguments(p: argparse.ArgumentParser) -> None:
    a.model_flag(p)
    p.add_argument("--data", type=a.data_path, required=True,
                   help="chat data: .jsonl/.json/.parquet with a 'messages' column, or a folder of them (required)")
    p.add_argument("--out", type=a.out_folder, required=True,
                   help="a new or empty run folder for the checkpoint(s) and the final model/, or with --resume "
                        "the folder of the run to continue (required)")
    a.conversion_flags(p, ("aha", "dar"))  # the fine-tuning recipes allhere.hf.sft knows
    p.add_argument("--seq-len", type=a.positive, default=2048, help="packed sequence length (default 2048)")
    p.add_argument("--batch-size", type=a.positive, default=4, help="sequences per micro-batch (default 4)")
    p.add_argument("--global-batch", type=a.positive, default=128,
                   help="sequences per optimizer step, a multiple of --batch-size (default 128)")
    p.add_argument("--epochs", type=a.positive_number, default=1.0, help="passes over the data, > 0 (default 1)")
    p.add_argument("--max-steps", type=a.positive, default=None,
                   help="stop after this many optimizer steps (default: when the epochs are done)")
    p.add_argument("--lr", type=a.positive_number, default=3e-5,
                   help="peak learning rate (default 3e-5; DAR: stage 2)")
    p.add_argument("--stage1-lr", type=a.positive_number, default=3e-4,
                   help="DAR stage 1 (bottleneck only) learning rate (default 3e-4)")
    p.add_argument("--target-mu-f", type=a.fraction, default=None,
                   help="AHA: train lambda too, towards this share of full attention, 0 < x < 1 "
                        "(default: none, lambda fixed at --lam)")
    a.device_flag(p)
    p.add_argument("--context-parallel", type=a.positive, default=1, metavar="N",
                   help="under torchrun: split each sequence over N ranks, attention through the ring (the "
                        "processes form a (processes / N) data-parallel x N context-parallel mesh; default 1)")
    p.add_argument("--cp-layout", choices=("zigzag", "contiguous"), default="zigzag",
                   help="how --context-parallel cuts a sequence: zigzag balances the causal work (default)")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --out where it stopped (default: start a new run)")
    a.report_flag(p)
    a.progress_flag(p)


def sft(args) -> None:
    from ..hf import sft as run_sft
    from ..runtime.reporting import report_to

    mech = _mechanism(args)
    if args.target_mu_f is not None and args.mechanism != "aha":
        raise ConfigError(f"--target-mu-f is a setting of --mechanism aha (it steers the routers), not of "
                          f"{args.mechanism}")
    _check_out(args.out, args.model, resume=args.resume)
    from ..hf.io import check_causal_lm

    _print_notes(check_causal_lm(args.model, convertible=True, layers=args.layers, mechanism=mech), args.layers)
    with report_to(args.report_to, root=args.out):  # TensorBoard: <out>/tensorboard (DAR: a folder per stage)
        state = run_sft(args.model, args.data, args.out, window=args.window, seq_len=args.seq_len,
                        batch_size=args.batch_size, global_batch=args.global_batch, epochs=args.epochs, lr=args.lr,
                        lam=getattr(mech, "lam", 3e-4), tau=getattr(mech, "tau", 0.5), max_steps=args.max_steps,
                        device=args.device, resume=args.resume, progress=not args.no_progress,
                        d_down=getattr(mech, "d_down", None), stage1_lr=args.stage1_lr,
                        target_mu_f=args.target_mu_f, layers=args.layers, context_parallel=args.context_parallel,
                        cp_layout=args.cp_layout, sinks=getattr(mech, "sinks", 0))
    from ..distributed.env import detect

    env = detect()
    if env is not None and not env.main:  # under torchrun: one report, from rank 0
        return
    last = state["history"][-1]
    mu = f", mu_f {last['mu_f']:.3f}" if last.get("mu_f") is not None else ""
    mu += f", lambda {state['lam']:.3g}" if "lam" in state else ""
    print(f"{state['step']} steps; last step: loss {last['lm']:.4f}{mu}. Model saved to {args.out}/model")
    if "load" in state:  # under torchrun: the mesh and the sharded load's memory
        load, cp = state["load"], args.context_parallel
        world = len(load["peak_rss_delta_bytes"])
        print(f"trained on {world} processes: {world // cp} data parallel x {cp} context parallel ({args.cp_layout})"
              if cp > 1 else f"trained on {world} processes, data parallel")
        print(f"loaded straight into {world} FSDP2 shards: peak memory per rank at load "
              f"{max(load['peak_rss_delta_bytes']) / 2**20:.1f} MiB (largest of the ranks, {load['measured_by']}), "
              f"the whole model {load['full_model_bytes'] / 2**20:.1f} MiB")
