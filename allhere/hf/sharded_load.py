"""Load a Hugging Face causal LM (plain, or saved converted by allhere) straight into FSDP2 shards: no rank
ever holds the whole model.

``load_sharded`` runs on every rank of an initialised process group (torchrun; gloo on CPU, NCCL on GPUs):

1. the folder is checked as ``allhere.hf.load_local`` checks it (same errors), every weight file's header
   is read (names, shapes; nothing else) and matched to the model before anything is allocated;
2. the model is built on the meta device, converted there (the saved mechanism of a folder saved converted,
   else ``mechanism`` on ``layers``), and sharded with FSDP2 as ``allhere.distributed.fsdp.shard_model``
   shards it (each transformer block, then the root);
3. ``to_empty`` allocates each rank's shards, and each parameter's local rows are read from the safetensors
   files (``safe_open(...).get_slice(name)[start:stop]``, one tensor's file mapping open at a time); the
   non-persistent buffers (rotary frequencies, rope scaling included) are recomputed by transformers' own
   ``_init_weights``, checked to be all set;
4. mechanism weights a plain checkpoint lacks (routers, bottlenecks) are initialised on the CPU as
   ``convert(..., seed=seed)`` initialises them (``init_mechanism``), each rank keeping its rows: the model
   equals ``load_local`` + ``convert(model, mechanism, layers, seed=seed)`` on one process. A mechanism that
   initialises from the host's pretrained weights (``has_host_init``: ``dar_latent``) is refused in one line
   for a plain folder: no rank holds those weights whole here; convert on one process, save, and load that.

Why safetensors slices rather than DCP's ``HuggingFaceStorageReader``: the reader wants a state dict of the
checkpoint's names and dtypes, has no place for weights that are not in the files (mechanism weights of a
plain checkpoint, a tied head) and reads whole tensors where a slice is all a rank needs.

What the load cost comes back as ``model.allhere_load_report`` (``LoadReport``); its peak resident memory only
with ``measure_memory=True``, which resets the process's high-water mark (a write to /proc/self/clear_refs, a
side effect on the whole process), so the caller asks for it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import resource
import threading
import time
from pathlib import Path

import torch

from .. import registry
from ..distributed.fsdp import shard_model
from ..hosts import CONFIG_KEY, LAYERS_KEY, SUBMODULE
from ..runtime.model_checkpoint import CheckpointError
from ..validation import ConfigError
from .convert import convert, dims_of, init_mechanism
from .files import weight_files, weight_map
from .io import check_causal_lm, load_tokenizer, meta_model, saved_dtype, saved_mechanism

CHUNK_BYTES = 16 << 20  # the most of one tensor read from a file at a time


@dataclasses.dataclass
class LoadReport:
    """What one rank's load cost."""

    rank: int  # this process's rank in the default group
    world: int  # ranks in the default group
    peak_rss_delta_bytes: int | None  # highest resident memory during the load minus the resident memory before
    # it (a process's first import of the model family's transformers code counts in it too); None: not measured
    full_model_bytes: int  # every parameter of the whole model in the loaded dtype (a tied one once)
    local_bytes: int  # the parameter bytes of this rank's shards
    seconds: float  # wall time of the load
    peak_source: str  # how the peak was measured: "VmHWM" (kernel high-water mark, reset first), "sampled", or
    # "not measured"


class PeakRSS:
    """The peak resident memory of this process inside a ``with`` block, relative to its start: the
    kernel's high-water mark (VmHWM, reset on entry through /proc/self/clear_refs) where it can be reset,
    otherwise a thread sampling /proc/self/statm every millisecond (which can miss short peaks); either with
    ``getrusage``'s maxrss where that grew. After the block: ``before``, ``peak``, ``delta`` in bytes."""

    def __init__(self, interval: float = 0.001) -> None:
        self.interval = interval
        self.before = self.peak = 0
        self.source = "sampled"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @staticmethod
    def current() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    @staticmethod
    def _hwm() -> int | None:
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return None

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.current())
            time.sleep(self.interval)

    def __enter__(self) -> "PeakRSS":
        self.before = self.peak = self.current()
        self._maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
            hwm = self._hwm()
            self.source = "VmHWM" if hwm is not None and hwm <= self.before + (1 << 20) else "sampled"
        except OSError:
            self.source = "sampled"
        if self.source == "sampled":  # only where the kernel's mark cannot be used
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
        self.peak = max(self.peak, self.current())
        if self.source == "VmHWM":
            self.peak = max(self.peak, self._hwm() or 0)
        maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        if maxrss > self._maxrss:  # the process's all-time peak was set inside the block: it is this peak
            self.peak = max(self.peak, maxrss)

    @property
    def delta(self) -> int:
        return self.peak - self.before


def load_sharded(model_path: str | Path, mechanism=None, layers="full", dtype: torch.dtype | str = torch.float32,
                 device: str | torch.device = "cpu", seed: int = 0, mesh=None, measure_memory: bool = False):
    """(tokenizer, model) of the folder ``model_path``, the model sharded with FSDP2 over ``mesh`` (a
    DeviceMesh; default: every rank of the default group) on ``device``, its weights in ``dtype`` ("auto": as
    saved). Call it on every rank. A folder saved converted by allhere loads with its saved mechanism and weights (a
    ``mechanism`` asked for is then ignored, as ``load_local`` ignores it); a plain one is converted with
    ``mechanism`` on ``layers`` (None: left plain), the new weights initialised as
    ``convert(..., seed=seed)`` initialises them. The model comes in eval mode, as ``from_pretrained``
    gives it, with ``model.allhere_load_report`` (``LoadReport``) of this rank; ``measure_memory``: measure the
    load's peak resident memory there too (``PeakRSS``: it resets this process's high-water mark).

    ConfigError for a folder that is no causal LM allhere can convert, or in the AHA authors' format;
    CheckpointError naming the file for a missing or corrupt weight file, or a tensor that is missing or
    has another shape than the config gives it."""
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError("load_sharded runs on every rank of an initialised process group "
                           "(torch.distributed.init_process_group, e.g. under torchrun)")
    start = time.perf_counter()
    with PeakRSS() if measure_memory else contextlib.nullcontext() as peak:
        tokenizer, model, local_bytes = _load(Path(model_path), mechanism, layers, dtype, torch.device(device),
                                              seed, mesh)
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    model.allhere_load_report = LoadReport(dist.get_rank(), dist.get_world_size(), peak.delta if peak else None,
                                           full, local_bytes, time.perf_counter() - start,
                                           peak.source if peak else "not measured")
    return tokenizer, model


def refuse_gguf(p: Path) -> None:
    """ConfigError for a GGUF file: its tensors are de-quantized whole, never read shard by shard."""
    from .gguf import is_gguf

    if is_gguf(p):
        raise ConfigError(f"{p} is a GGUF file, which the sharded load under torchrun does not read: write it as a "
                          "model folder first (allhere convert --model FILE --out FOLDER ..., then train FOLDER with "
                          "the same mechanism settings)")


def _load(p: Path, mechanism, layers, dtype, device, seed, mesh):
    from .faolmo import read_config as faolmo_config

    refuse_gguf(p)
    if (p / "config.json").exists() and faolmo_config(p) is not None:
        raise ConfigError(f"{p} is in the AHA authors' (faolmo) format, which load_sharded does not read; load it "
                          "with allhere.hf.load_local and save it with allhere.hf.save_pretrained first")
    config = check_causal_lm(p, convertible=mechanism is not None, layers=layers, mechanism=mechanism)
    if dtype == "auto":  # the dtype the weights were saved in, as load_local's "auto"
        dtype = saved_dtype(config, p)
    elif isinstance(dtype, str):
        name, dtype = dtype, getattr(torch, dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ConfigError(f"dtype must be a torch dtype, its name or 'auto', got {name!r}")
    tokenizer = load_tokenizer(p, config)
    model, saved = _converted_meta_model(config, mechanism, layers, dtype, fresh=False)
    sources = _sources(p, model, from_files=saved is not None)
    buffers = _buffers(model)
    shard_model(model, str(device), mesh)
    model.to_empty(device=device)
    with torch.no_grad():
        for name, value in buffers.items():
            model.get_buffer(name).copy_(value)
    try:
        local, error = _fill(p, model, sources, seed), None
    except Exception as e:  # a rank that cannot fill its shards: every rank raises, none waits forever
        local, error = 0, e
    _agree(device, error)
    _tie_check(model)
    _generation_config(model, p)
    return tokenizer, model.eval(), local


def _generation_config(model, p: Path) -> None:
    """The folder's generation settings, as ``from_pretrained`` reads them."""
    if (p / "generation_config.json").exists():
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(str(p), local_files_only=True)


def assemble(model_path: str | Path, state_dict: dict[str, torch.Tensor], mechanism=None, layers="full"):
    """The whole model of the folder ``model_path`` holding ``state_dict`` (e.g. gathered from the shards
    after training) instead of the folder's weights, without a second copy of them: built on the meta device,
    converted (the folder's saved mechanism, else ``mechanism`` on ``layers``), the tensors assigned, the
    non-persistent buffers rebuilt, a tied head tied again. Every key must match the model's."""
    dtype = next(iter(state_dict.values())).dtype
    model, _ = _converted_meta_model(check_causal_lm(model_path), mechanism, layers, dtype, fresh=True)
    buffers = _buffers(model)
    model.load_state_dict(state_dict, strict=True, assign=True)
    for name, value in buffers.items():
        module_name, _, leaf = name.rpartition(".")
        model.get_submodule(module_name).register_buffer(leaf, value, persistent=False)
    if (getattr(model.config.get_text_config(), "tie_word_embeddings", False)
            and model.get_output_embeddings() is not None):
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    _tie_check(model)
    _generation_config(model, Path(model_path))
    return model.eval()


def _converted_meta_model(config, mechanism, layers, dtype, fresh: bool):
    """(the model of ``config`` on the meta device, converted to its saved mechanism or ``mechanism``; the
    saved mechanism or None). ``fresh``: the mechanism weights come from elsewhere (a state dict); otherwise a
    ``mechanism`` initialised from the host's weights is refused (ConfigError, one line)."""
    saved = saved_mechanism(config)
    model = meta_model(config, dtype)
    if saved is not None:
        convert(model, saved, layers=getattr(config, LAYERS_KEY, None) or "full", host_init=False)
    elif mechanism is not None:
        if not fresh and registry.of(mechanism).module.has_host_init():
            raise ConfigError(f"{type(mechanism).__name__} initialises from the host's pretrained weights, which no "
                              "rank holds whole in a sharded load: convert on one process first (allhere.hf.convert "
                              "and save_pretrained, or allhere convert --out FOLDER) and load that folder")
        convert(model, mechanism, layers=layers, host_init=False)
    return model, saved


def _buffers(model) -> dict[str, torch.Tensor]:
    """The non-persistent buffers (rotary frequencies...) of the meta ``model``, computed on the CPU by
    transformers' own ``_init_weights`` of the modules that hold them (what ``from_pretrained`` does); its
    parameters, still on meta, are left as they are. ConfigError naming a buffer it leaves unset, or a
    persistent buffer (saved in the weight files, which this loader does not read)."""
    owners = {}
    for name, buf in model.named_buffers():
        module_name, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_name)
        if leaf not in module._non_persistent_buffers_set:
            raise ConfigError(f"{type(model).__name__} has the persistent buffer {name}, which load_sharded does not "
                              "read from the weight files; use allhere.hf.load_local")
        owners.setdefault(module_name, (module, []))[1].append(leaf)
    out = {}
    for module_name, (module, leaves) in owners.items():
        for leaf in leaves:
            buf = module._buffers[leaf]
            module._buffers[leaf] = torch.full_like(buf, float("nan"), device="cpu") if buf.is_floating_point() \
                else torch.zeros_like(buf, device="cpu")
        model._init_weights(module)
        for leaf in leaves:
            value = module._buffers[leaf]
            name = f"{module_name}.{leaf}" if module_name else leaf
            if value.is_floating_point() and bool(value.isnan().any()):
                raise ConfigError(f"{type(model).__name__}: transformers' _init_weights does not compute the buffer "
                                  f"{name}, so load_sharded cannot rebuild it; use allhere.hf.load_local")
            out[name] = value.clone()
    return out


def _index(p: Path) -> dict[str, Path]:
    """Tensor name -> weight file of the folder (model.safetensors, or the files of its index)."""
    index = weight_map(p)  # CheckpointError for an index that is not one, or names files outside the folder
    if index is not None:
        return index
    (single,) = weight_files(p)  # no index: model.safetensors, or the CheckpointError saying it is missing
    return {k: single for k in _header(single)}


def _header(f: Path) -> dict[str, list[int]]:
    """Name -> shape of every tensor in the safetensors file ``f`` (its header alone is read)."""
    from safetensors import SafetensorError, safe_open

    if not f.exists():
        raise CheckpointError(f"weight file {f} is missing")
    try:
        with safe_open(str(f), framework="pt") as fh:
            return {k: list(fh.get_slice(k).get_shape()) for k in fh.keys()}
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"weight file {f} is corrupt or not safetensors ({' '.join(str(e).split())[:200]})") \
            from None


def _sources(p: Path, model, from_files: bool) -> dict[str, tuple[str, Path] | None]:
    """Parameter name -> (tensor name, file) it is read from, or None for a mechanism weight initialised
    here (a plain checkpoint). Every file's header is checked first: CheckpointError for a missing or corrupt
    file, a missing tensor, or one whose shape is not the parameter's."""
    index = _index(p)
    shapes = {f: _header(f) for f in sorted(set(index.values()))}
    out: dict[str, tuple[str, Path] | None] = {}
    aliases: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
    for name, param in model.named_parameters():
        mech = f".{SUBMODULE}." in name
        if mech and not from_files:
            out[name] = None
            continue
        names = aliases[id(param)]  # a tied head: whichever of its names the files hold
        key = next((k for k in names if k in index), None)
        if key is None:
            raise CheckpointError(f"{p}: the weight files lack {name}" + (f" (or {', '.join(names[1:])})"
                                                                           if len(names) > 1 else ""))
        f = index[key]
        shape = shapes[f].get(key)
        if shape is None:
            raise CheckpointError(f"weight file {f} lacks {key}, which its index places there")
        if shape != list(param.shape):
            raise CheckpointError(f"weight file {f}: {key} has shape {shape}, the model's config gives "
                                  f"{list(param.shape)}")
        out[name] = (key, f)
    return out


def _local_slices(param) -> tuple[torch.Tensor, tuple[slice, ...]]:
    """The local tensor of a parameter (a DTensor under FSDP2, or a plain tensor) and the slices of the
    full tensor it holds."""
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        return param.data, tuple(slice(0, n) for n in param.shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local = param.to_local()
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    if tuple(shape) != tuple(local.shape):
        raise RuntimeError(f"unexpected shard layout {param.placements}: local {tuple(local.shape)}, "
                           f"computed {tuple(shape)}")
    return local, tuple(slice(o, o + n) for o, n in zip(offset, shape))


def _read_into(local: torch.Tensor, f: Path, key: str, slices: tuple[slice, ...]) -> None:
    """Copy rows ``slices`` of tensor ``key`` of file ``f`` into ``local`` (cast on the way), at most
    ``CHUNK_BYTES`` of the file at a time, its mapping closed after each chunk: what this costs beyond the
    shard is two chunks (the mapped pages and the read copy), not a tensor."""
    from safetensors import SafetensorError, safe_open

    rows = slices[0]
    per_row = max(1, local[:1].numel()) * max(4, local.element_size())  # a bound on the file's row bytes too
    step = max(1, CHUNK_BYTES // per_row)
    try:
        for r in range(rows.start, rows.stop, step):
            stop = min(rows.stop, r + step)
            with safe_open(str(f), framework="pt") as fh:
                part = fh.get_slice(key)[(slice(r, stop), *slices[1:])]
            local[r - rows.start:stop - rows.start].copy_(part)
            del part
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"weight file {f}: {key} could not be read ({' '.join(str(e).split())[:200]})") \
            from None


def _fill(p: Path, model, sources, seed: int) -> int:
    """Write every parameter's local shard: rows read from the files, or the seeded mechanism init. Returns
    the local parameter bytes."""
    mechs = {}
    if any(src is None for src in sources.values()):
        cfg = registry.from_dict(getattr(model.config, CONFIG_KEY))
        entry, dims = registry.of(cfg), dims_of(model.config)
    total = 0
    with torch.no_grad():
        for name, param in model.named_parameters():
            local, slices = _local_slices(param)
            total += local.numel() * local.element_size()
            src = sources[name]
            if src is None:  # a mechanism weight: layer `index`'s mechanism as convert(seed=) builds it
                attn_name, _, leaf = name.partition(f".{SUBMODULE}.")
                index = model.get_submodule(attn_name).layer_idx
                if index not in mechs:
                    mechs = {index: init_mechanism(entry.module(cfg, dims), seed, index)}  # one layer at a time
                full = mechs[index].get_parameter(leaf)
                local.copy_(full[slices].to(local.dtype))
            elif local.numel():
                _read_into(local, src[1], src[0], slices)
    return total


def _tie_check(model) -> None:
    """A tied head must still be the embedding's parameter after sharding and ``to_empty``."""
    if getattr(model.config.get_text_config(), "tie_word_embeddings", False):
        head = model.get_output_embeddings()
        if head is not None and head.weight is not model.get_input_embeddings().weight:
            raise RuntimeError("the output head lost its tie to the input embedding while sharding")


def _agree(device: torch.device, error: Exception | None) -> None:
    """Raise on every rank when one of them could not read its part of the weights (its own error on that
    rank), so no rank goes on to a collective the others never join."""
    import torch.distributed as dist

    ok = torch.tensor([0 if error else 1], device=device if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if error is not None:
        raise error
    if not int(ok.item()):
        raise CheckpointError("another rank could not read its part of the weights (its error names the file)")
