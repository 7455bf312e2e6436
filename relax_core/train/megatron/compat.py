"""megatron-core on a machine without CUDA: every shim the Megatron backend needs, in one place.

megatron-core 0.16 assumes a GPU in a few spots that have nothing to do with
the arithmetic: buffers allocated on `torch.cuda.current_device()`, counters
created with `device="cuda"` (the pipeline schedules, the optimizer's grad
norm), the optimizers' checks that a gradient's `type()` is
`torch.cuda.FloatTensor`, the MoE all-to-all dispatcher's side stream,
`torch.cuda.synchronize()` around checkpoint saves, the CUDA RNG that
activation recomputation and its RNG tracker save and restore, and Transformer
Engine's GEMM picked for the router when TE imports. Without a GPU
`install(device)` points those at the trainer's device (the CPU; in the
placement tests a simulated accelerator, `tests/sim_device.py`), and
`on_device()` (a torch function mode, entered around every Megatron call)
turns the hard-coded `device="cuda"` and `.cuda()` into that device. On a GPU
only the distributed optimizer's fixes for torch's Adam (`_torch_adam_loads`,
`_torch_adam_template`: wherever megatron-core falls back to torch's Adam) are
installed.

Each shim can go when megatron-core stops assuming CUDA there (checked against
0.16.1): upstream keeps the `device=` of these calls in the callers, so a
release that threads a device through (or reads `torch.get_default_device()`)
makes the shim unnecessary; `tests/integration/test_megatron.py` fails when one
is missing.
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

_installed = False
_device = torch.device("cpu")  # where megatron-core's CUDA allocations go on a machine without a GPU


def gpu() -> bool:
    return torch.cuda.is_available()


def install(device: str | torch.device = "cpu") -> None:
    """Point megatron-core's CUDA-only helpers at `device` (the trainer's; nothing on a GPU machine). The
    patches are made once; the device is the last one asked for (one trainer per process)."""
    global _installed, _device
    _device = torch.device(device)
    if _installed:
        return
    _installed = True
    _torch_adam_loads()
    _torch_adam_template()
    if gpu():
        return
    # GlobalMemoryBuffer.get_tensor, the p2p buffers, the optimizer's buffers and the rotary embedding's
    # frequencies allocate on `torch.cuda.current_device()`.
    torch.cuda.current_device = lambda: _device
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
    # The tracker's `add` seeds each named state through `torch.cuda.manual_seed` / `get_rng_state`, which a
    # torch without CUDA does not have: a CPU generator seeded alike stands in.
    mcore_random.CudaRNGStatesTracker = _host_tracker(mcore_random.CudaRNGStatesTracker)


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


def _torch_adam_template() -> None:
    """The distributed optimizer's loading template (`sharded_state_dict(is_loading=True)`) first reads its
    own `state_dict()`, which with torch's Adam takes the step from the per-parameter state and asserts
    there is one: a fresh optimizer (resuming before any step) has none. Each parameter without state
    gets zero moments at step 0 first (the load replaces them). Only for torch's Adam: Transformer
    Engine's and Apex's FusedAdam keep the step in the parameter group and their `state_dict()` refuses a
    state entry other than exp_avg, exp_avg_sq and master_param (TE `FusedAdam.get_unscaled_state`).
    Can go when megatron-core's `DistributedOptimizer.state_dict` accepts a torch Adam without state."""
    from megatron.core.optimizer import distrib_optimizer

    if distrib_optimizer.HAVE_APEX_OR_TE:
        return
    original = distrib_optimizer.DistributedOptimizer.sharded_state_dict

    def sharded_state_dict(self, model_sharded_state_dict=None, is_loading=False, *args, **kwargs):
        if is_loading:
            inner = self.optimizer
            for group in inner.param_groups:
                for param in group["params"]:
                    if not inner.state[param]:
                        inner.state[param].update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(param),
                                                  exp_avg_sq=torch.zeros_like(param))
        return original(self, model_sharded_state_dict or {}, is_loading, *args, **kwargs)

    distrib_optimizer.DistributedOptimizer.sharded_state_dict = sharded_state_dict


def _host_counts(self, point, tokens_per_expert=None):
    """`_maybe_dtoh_and_synchronize` without a stream: the all-to-all's split sizes become the numpy
    arrays the GPU path makes of them (its copies to the host are no-ops for host tensors)."""
    if not self.drop_and_pad and point == self.cuda_dtoh_point:
        for name in ("input_splits", "output_splits", "output_splits_tp"):
            value = getattr(self, name, None)
            if torch.is_tensor(value):
                setattr(self, name, value.numpy())
    return tokens_per_expert


def _host_tracker(base: type) -> type:
    """megatron-core's RNG tracker (`base`) with its named states made by a seeded CPU generator."""

    class HostRNGStatesTracker(base):
        def add(self, name, seed):
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"cuda rng state {name} already exists")
            self._is_initialized = True
            self.seeds_.add(seed)
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    return HostRNGStatesTracker


def _to_device(device):
    if device is None:
        return None
    if isinstance(device, int):
        return _device
    dev = torch.device(device)
    return _device if dev.type == "cuda" else dev


class _DeviceMode(TorchFunctionMode):
    """`device="cuda"` (or an index) becomes the trainer's device in tensor factories; `.cuda()` moves
    there; `t.type()` names a tensor as its CUDA kind (the optimizers assert `torch.cuda.FloatTensor`
    gradients and pick their fp32 master copies by `torch.cuda.BFloat16Tensor`)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0].to(_device)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args).replace(f"torch.{_device.type}.", "torch.", 1)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        if "device" in kwargs:
            kwargs["device"] = _to_device(kwargs["device"])
        if func is torch.Tensor.to and args and len(args) > 1 and isinstance(args[1], (str, torch.device, int)) \
                and not isinstance(args[1], bool):
            args = (args[0], _to_device(args[1]), *args[2:])
        return func(*args, **kwargs)


def on_device():
    """Context for a megatron-core call: without a GPU, hard-coded CUDA devices become the trainer's."""
    return contextlib.nullcontext() if gpu() else _DeviceMode()
