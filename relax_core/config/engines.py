"""The rollout engine kinds (`rollout.engine`), and how they differ: every such difference is read here.

    sglang   `sglang.launch_server` on GPU nodes, `gpus_per_engine` GPUs (TP ranks) each
    cpu      Relax's own engine (relax_core/rollout/cpu_engine), speaking SGLang's HTTP API with no GPU

Code that must behave differently for one kind asks `engine_kind(name)` for the property it depends on,
by its name, and never compares the kind's name itself.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineKind:
    name: str
    on_gpus: bool
    """Each engine runs on `rollout.gpus_per_engine` GPUs (at least 1), every one a TP rank that joins the
    weight-update group; else it needs no GPU and joins the group as one rank."""
    server_args: bool
    """Takes SGLang's server arguments (`rollout.engine_args`, `rollout.deterministic`), checked against
    SGLang's own list."""
    binds_own_port: bool
    """The server binds the port it is given itself (SGLang: a port taken meanwhile is retried on a fresh
    one); else it serves on a socket Relax already listens on, so the port stays Relax's."""
    loads_by_checkpoint_names: bool
    """Takes weight updates by the model directory's own parameter names (what SGLang's loaders map); else
    by the trainer's names."""
    memory_saver: bool
    """Hands its GPU memory back to the trainer between steps only with SGLang's memory saver on
    (`enable_memory_saver`), which colocate on shared GPUs needs."""
    ready_timeout_s: float
    """How long its start may take before the engine is given up: loading a large model onto GPUs and
    capturing CUDA graphs takes minutes."""


ENGINES: dict[str, EngineKind] = {kind.name: kind for kind in (
    EngineKind("sglang", on_gpus=True, server_args=True, binds_own_port=True, loads_by_checkpoint_names=True,
               memory_saver=True, ready_timeout_s=1200.0),
    EngineKind("cpu", on_gpus=False, server_args=False, binds_own_port=False, loads_by_checkpoint_names=False,
               memory_saver=False, ready_timeout_s=300.0),
)}
ENGINE_KINDS = tuple(ENGINES)


def engine_kind(name: str) -> EngineKind:
    """The kind named `name`; a KeyError naming the valid kinds otherwise."""
    if name not in ENGINES:
        raise KeyError(f"unknown engine '{name}'; valid engines: {', '.join(ENGINE_KINDS)}")
    return ENGINES[name]
