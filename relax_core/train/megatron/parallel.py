"""Megatron's process groups over an initialised torch.distributed world."""

from __future__ import annotations

from relax_core.train.megatron.model import Parallel


def initialize(par: Parallel, seed: int, device: str = "cpu") -> None:
    """TP/PP/CP/EP/DP groups over the default group (its size must be a multiple of TP x PP x CP), and
    Megatron's seeded RNG tracker (the same on every data-parallel rank, offset per TP/EP rank).

    The tracker is the training one Megatron-LM makes (`inference_rng_tracker=False`): its named states
    (`model-parallel-rng`, `data-parallel-rng`, `expert-parallel-rng`) go into every checkpoint's
    `rng_state`, and Megatron-LM's first `fork()` after loading one needs them (the inference tracker
    saves none). `device`: the trainer's (megatron-core's CUDA allocations go there without a GPU)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from relax_core.train.megatron import compat

    compat.install(device)
    world = dist.get_world_size()
    if world % par.model_parallel:
        raise ValueError(f"{world} trainer ranks are not a multiple of tensor x pipeline x context parallel "
                         f"= {par.model_parallel}")
    if not ps.model_parallel_is_initialized():
        with compat.on_device():
            ps.initialize_model_parallel(tensor_model_parallel_size=par.tp, pipeline_model_parallel_size=par.pp,
                                         context_parallel_size=par.cp, expert_model_parallel_size=par.ep)
    with compat.on_device():
        tensor_parallel.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)


def destroy() -> None:
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
