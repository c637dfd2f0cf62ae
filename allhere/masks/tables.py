"""The lookup tables a predicate reads (per-head dilations, global-token flags, BigBird's random blocks):
kept on the CPU, copied once to each device the predicate runs on, and ready before the predicate is traced
(``prepare``), since a traced evaluation cannot copy."""

from __future__ import annotations

import torch


def _device(device) -> torch.device:
    """A device with its index ("cuda" is the current CUDA device), so that equal devices compare equal."""
    device = torch.device(device or "cpu")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


class DeviceTables:
    """The CPU tensors a predicate reads, with one copy per device they are read on: made by ``prepare``
    ahead of tracing (a traced evaluation cannot copy), or by the first eager read there."""

    def __init__(self, **tensors: torch.Tensor) -> None:
        self.cpu = tensors
        self.copies: dict[torch.device, dict[str, torch.Tensor]] = {}

    def replace(self, **tensors: torch.Tensor) -> None:
        """New contents (a table that grew), copied again to every device it was on."""
        self.cpu = tensors
        for device in list(self.copies):
            self.prepare(device=device, again=True)

    def prepare(self, heads: int = 0, length: int = 0, device=None, again: bool = False) -> None:
        device = _device(device)
        if device.type != "cpu" and (again or device not in self.copies):
            self.copies[device] = {k: v.to(device) for k, v in self.cpu.items()}

    def get(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """The table ``name`` on ``like``'s device."""
        if like.device.type == "cpu":
            return self.cpu[name]
        device = _device(like.device)
        if device not in self.copies:
            if is_tracing(like):
                raise RuntimeError("a mask predicate's tables must be on the device before it is traced: call its "
                                   "prepare(heads, length, device) first (allhere.ops.flex does)")
            self.prepare(device=device)
        return self.copies[device][name]


def is_tracing(t) -> bool:
    """Whether ``t`` is being traced (vmapped by ``create_block_mask``, compiled), where no value can be read."""
    return (torch.compiler.is_compiling() or type(t) is not torch.Tensor
            or torch._C._functorch.is_batchedtensor(t))
