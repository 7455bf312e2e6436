"""megatron-core on a machine without CUDA: every shim the Megatron backend needs, in one place.

megatron-core 0.16 assumes a GPU in a few spots that have nothing to do with
the arithmetic: buffers allocated on `torch.cuda.current_device()`, counters
created with `device="cuda"` (the pipeline schedules, the optimizer's grad
norm), the optimizers' checks that a gradient's `type()` is
`torch.cuda.FloatTensor`, the MoE all-to-all dispatcher's side stream,
`torch.cuda.synchronize()` around checkpoint saves, the CUDA RNG that
activation recomputation saves and restores, and Transformer
Engine's GEMM picked for the router when TE imports. On CPU `install()` points
those at the CPU, and `on_cpu()` (a torch function mode, entered around every
Megatron call) turns the hard-coded `device="cuda"` and `.cuda()` into CPU
ones. On a GPU only the distributed optimizer's load fix (`_torch_adam_loads`,
needed wherever megatron-core falls back to torch's Adam) is installed.

Each shim can go when megatron-core stops assuming CUDA there (checked against
0.16.1): upstream keeps the `device=` of these calls in the callers, so a
release that threads a device through (or reads `torch.get_default_device()`)
makes the shim unnecessary; `tests/integration/test_megatron.py` fails when one
is missing.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch.overrides import TorchFunctionMode

_installed = False


def gpu() -> bool:
    return torch.cuda.is_available()


def install() -> None:
    """Point megatron-core's CUDA-only helpers at the CPU (idempotent; nothing on a GPU machine)."""
    global _installed
    if _installed:
        return
    _installed = True
    _torch_adam_loads()
    if gpu():
        return
    # GlobalMemoryBuffer.get_tensor, the p2p buffers and the optimizer's buffers allocate on
    # `torch.cuda.current_device()`.
    torch.cuda.current_device = lambda: "cpu"
    # dist_checkpointing's save and the timers synchronise the device; the CPU has nothing to wait for.
    torch.cuda.synchronize = lambda *args, **kwargs: None
    # With Transformer Engine importable the router's GEMM would run through it (GPU only).
    from megatron.core.transformer.moe import moe_utils

    moe_utils.te_general_gemm = None
    # The all-to-all dispatcher copies its token counts to the host on a side CUDA stream, which it creates
    # in its constructor; on CPU they are host tensors already, so there is nothing to copy or wait for.
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = _NO_STREAM
    MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = _host_counts
    # Activation recomputation saves and restores the device's RNG around each recomputed layer, so its
    # dropout masks repeat: on CPU the device is the CPU, whose generator torch keeps.
    from megatron.core.tensor_parallel import random as mcore_random

    mcore_random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mcore_random._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)


_NO_STREAM = object()


def _torch_adam_loads() -> None:
    """Without Transformer Engine or Apex megatron-core's distributed optimizer runs torch's Adam, which keeps
    a per-parameter `step`; loading a checkpoint then copies every state entry from the checkpoint's
    tensors, which have no `step` (it is restored from the parameter groups): KeyError. The copy skips it.
    Can go when megatron-core's `_set_main_param_and_optimizer_states` skips keys the checkpoint lacks and
    its `load_state_dict` stops sharing one `step` tensor between parameters."""
    from megatron.core.optimizer import distrib_optimizer

    if distrib_optimizer.HAVE_APEX_OR_TE:
        return
    original = distrib_optimizer.DistributedOptimizer._set_main_param_and_optimizer_states

    def set_states(self, model_param, tensors):
        group_index, group_order = self.model_param_group_index_map[model_param]
        state = self.optimizer.state[self.optimizer.param_groups[group_index]["params"][group_order]]
        step = state.pop("step", None) if "step" not in tensors else None
        try:
            original(self, model_param, tensors)
        finally:
            if step is not None:
                state["step"] = step

    distrib_optimizer.DistributedOptimizer._set_main_param_and_optimizer_states = set_states
    # It also gives every parameter the same `step` tensor, which torch's Adam then increments in place once
    # per parameter: each parameter gets its own copy.
    load = distrib_optimizer.DistributedOptimizer.load_state_dict

    def load_state_dict(self, state_dict):
        load(self, state_dict)
        for state in self.optimizer.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()

    distrib_optimizer.DistributedOptimizer.load_state_dict = load_state_dict


def _host_counts(self, point, tokens_per_expert=None):
    """`_maybe_dtoh_and_synchronize` without a stream: the all-to-all's split sizes become the numpy
    arrays the GPU path makes of them (its copies to the host are no-ops for host tensors)."""
    if not self.drop_and_pad and point == self.cuda_dtoh_point:
        for name in ("input_splits", "output_splits", "output_splits_tp"):
            value = getattr(self, name, None)
            if torch.is_tensor(value):
                setattr(self, name, value.numpy())
    return tokens_per_expert


def _to_cpu(device):
    if device is None:
        return None
    if isinstance(device, int):
        return torch.device("cpu")
    dev = torch.device(device)
    return torch.device("cpu") if dev.type == "cuda" else dev


class _CpuMode(TorchFunctionMode):
    """`device="cuda"` (or an index) becomes the CPU in tensor factories; `.cuda()` is a no-op; `t.type()`
    names a CPU tensor as its CUDA kind (the optimizers assert `torch.cuda.FloatTensor` gradients and
    pick their fp32 master copies by `torch.cuda.BFloat16Tensor`)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        if "device" in kwargs:
            kwargs["device"] = _to_cpu(kwargs["device"])
        if func is torch.Tensor.to and args and len(args) > 1 and isinstance(args[1], (str, torch.device, int)) \
                and not isinstance(args[1], bool):
            args = (args[0], _to_cpu(args[1]), *args[2:])
        return func(*args, **kwargs)


def on_cpu():
    """Context for a megatron-core call: on CPU, hard-coded CUDA devices become the CPU."""
    return contextlib.nullcontext() if gpu() else _CpuMode()


def cpu_safe(fn):
    """Decorator: run `fn` inside `on_cpu()`."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with on_cpu():
            return fn(*args, **kwargs)
    return wrapper
