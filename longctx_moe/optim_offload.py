"""AdamW with its state in host memory (optim.offload=cpu): the device keeps only the weights it
computes with and their gradients.

For each tensor the optimizer steps (a parameter, or with the distributed optimizer this rank's
slab of one) host memory holds its master (an fp32 copy of a bf16 tensor; of an fp32 tensor a
host copy of it), AdamW's two moments and a gradient buffer, pinned where the device is CUDA so
that the copies run asynchronously. The device optimizer kept 8 bytes an element there (the
moments) with fp32 parameters, 12 (masters and moments) with bf16 ones; this one keeps none.

One step, after the gradients were reduced and clipped on the device as before:

    device -> host   each tensor's gradient into its host buffer (a bf16 one widened to fp32),
                     all issued, then one synchronize
    AdamW            on the host masters: torch's fused CPU kernel (optim.impl=auto: the masters
                     are contiguous; torch >= 2.4), else foreach
    host -> device   each updated master into its tensor (rounded where the tensor is bf16),
                     queued on the device's stream ahead of the next read of the weights

The LR schedule sets the host optimizer's param groups, as it does the device optimizer's.

Arithmetic: the copies are exact (widening a bf16 gradient is, and a master is rounded into bf16
as MasterAdamW rounds it), so the update is the device optimizer's wherever both run the same
AdamW implementation: bitwise on a CPU run with the same optim.impl. Where the implementations
differ the results differ by rounding: on a GPU the device optimizer runs CUDA's fused kernel and
this one the CPU's; on a CPU run with optim.impl=auto the distributed optimizer's strided slabs
take foreach where the host copies (contiguous) take fused. Both compute AdamW's formula with
their operations in a different order: a few ulps of the update per step
(tests/trainer/test_optim_offload.py states the tolerance).

To checkpoints it is a MasterAdamW: the state is keyed by the host masters (`param_of` maps each
to the device tensor) and carries "master" for bf16 tensors only, so a checkpoint written with
optim.offload=cpu resumes without it and the other way.

The distributed optimizer's reduce-scatter leaves a slab's fp32 gradient on `master_of(slab)`:
the slab itself where it is fp32; for a bf16 slab, whose master is on the host, a device stand-in
of its shape (a zero-stride view of one fp32 element) that holds the gradient in `.grad`.
"""

from __future__ import annotations

import torch
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

from longctx_moe.config import ConfigError, OptimConfig
from longctx_moe.optim import LOW_PRECISION, MasterAdamW


def host_empty(shape: torch.Size, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """Host memory for the optimizer's tensors (`pin`: page-locked, for asynchronous copies).
    The one place it is allocated."""
    return torch.empty(shape, dtype=dtype, pin_memory=pin)


class HostAdamW(MasterAdamW):
    """A MasterAdamW whose masters, moments and gradient buffers are in host memory and whose
    step runs there (module docstring). `tensors`: the device tensors the optimizer updates, on
    one device."""

    def __init__(self, tensors: list[torch.Tensor], cfg: OptimConfig):
        if cfg.impl == "fused" and "cpu" not in _get_fused_kernels_supported_devices():
            raise ConfigError(f"optim.offload=cpu with optim.impl=fused needs fused AdamW on CPU tensors "
                              f"(torch >= 2.4, this is {torch.__version__}); set optim.impl=auto or upgrade torch")
        self.device = tensors[0].device if tensors else torch.device("cpu")
        self.pin = self.device.type == "cuda"  # page-locked memory is a CUDA host's
        super().__init__(tensors, cfg)
        self._grads = [host_empty(m.shape, m.dtype, self.pin) for m in self.masters]
        # A bf16 tensor's fp32 gradient from the distributed optimizer's reduction
        self._slots = {id(t): torch.zeros((), dtype=torch.float32, device=t.device).expand(t.shape)
                       for t in self.tensors if t.dtype in LOW_PRECISION}

    def _master(self, t: torch.Tensor) -> torch.Tensor:
        dtype = torch.float32 if t.dtype in LOW_PRECISION else t.dtype
        return host_empty(t.shape, dtype, self.pin).copy_(t.detach())

    def master_of(self, t: torch.Tensor) -> torch.Tensor:
        """Where the reduction of `t`'s gradient in fp32 lands (module docstring)."""
        return self._slots.get(id(t), t)

    def _device_grad(self, t: torch.Tensor) -> torch.Tensor | None:
        slot = self._slots.get(id(t))
        return slot.grad if slot is not None and slot.grad is not None else t.grad

    def device_grads(self) -> list[torch.Tensor]:
        """The gradients the next step reads, on the device (rl_hooks' offload moves them)."""
        return [g for t in self.tensors if (g := self._device_grad(t)) is not None]

    def _synchronize(self) -> None:
        if self.pin:
            torch.cuda.current_stream(self.device).synchronize()

    @torch.no_grad()
    def step(self) -> None:
        for t, m, buf in zip(self.tensors, self.masters, self._grads, strict=True):
            grad = self._device_grad(t)
            m.grad = None if grad is None else buf.copy_(grad, non_blocking=self.pin)
        self._synchronize()  # every gradient has landed (and the last step's weights have left)
        self.optimizer.step()
        for t, m in zip(self.tensors, self.masters, strict=True):
            if m.grad is not None:  # AdamW leaves a tensor without a gradient as it was
                t.copy_(m, non_blocking=self.pin)

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for slot in self._slots.values():
            slot.grad = None

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        self._synchronize()  # the masters are rewritten: the last step's copies have left them
        super().load_state_dict(state)
