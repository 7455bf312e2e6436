"""The torch.distributed group that carries new weights from trainer to engines.

Rank 0 is the trainer process that holds the full (gathered) weights; ranks
1..N are the rollout engines (for SGLang, every tensor-parallel worker of an
engine is a rank: `rank_offset + tp_rank`). Both sides call
`init_weight_update_group` with the same address, port, world size and group
name; the trainer side from `relax_core.weights.sync`, the CPU engine from its
`/init_weights_update_group` handler (SGLang does the equivalent inside its
scheduler).

Neither side may use `torch.distributed.init_process_group` for this: the
trainer process already has a default group (its data-parallel group) and an
SGLang engine has its tensor-parallel one. So the group is built the way
SGLang's `init_custom_process_group` builds it (sglang 0.5.23,
`sglang/srt/utils/common.py:2859-2927`, called from
`model_runner_components/weight_updater.py:133` with
`init_method="tcp://ADDRESS:PORT"`): a `TCPStore` rendezvous (rank 0 hosts
it), wrapped in `PrefixStore(group_name, store)` (common.py:2905), then torch's
internal `_new_process_group_helper` with an empty rank list (common.py:2913),
which makes a group independent of any default group, registered so that the
ordinary `torch.distributed.broadcast(tensor, src=0, group=group)` works on it
(common.py:2925). Every rank must use that key layout: gloo and NCCL exchange
their addresses through store keys under the prefix (`<group_name>/cpu/...`),
so a rank without it waits for keys the others never write. The test
`tests/integration/test_sglang_weight_group.py` forms the group with SGLang's
own function on the engine's side.

The private torch calls are confined to this module. Rank 0's store serves
on a socket bound before the port is announced (`ports.listening_socket`), so
no other process can take the port in between.
"""

from __future__ import annotations

import inspect
import socket
from datetime import timedelta

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from relax_core.cluster.ports import listening_socket

DEFAULT_TIMEOUT = timedelta(minutes=10)


# A group's store must live as long as the group.
_STORES: dict[dist.ProcessGroup, dist.TCPStore] = {}


def init_weight_update_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str = "weight_update_group",
    backend: str = "gloo",
    timeout: timedelta = DEFAULT_TIMEOUT,
    listen_sock: socket.socket | None = None,
) -> dist.ProcessGroup:
    """Join (rank 0: create) a weight-update group; blocks until all ranks joined.

    Works whether or not this process already has a default process group.

    Args:
        master_address: address of rank 0; rank 0 listens on this address only.
        master_port: TCP port of the rendezvous store on rank 0.
        rank: this process's rank in the group (0 = trainer).
        world_size: 1 + the number of engine ranks.
        group_name: unique per live group in a process.
        backend: "gloo" (CPU tensors) or "nccl" (CUDA tensors).
        listen_sock: rank 0: the socket its store serves on, already listening on
            `master_address:master_port` (default: bound here).
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a group of world size {world_size}")
    store = dist.TCPStore(
        master_address,
        master_port,
        world_size,
        is_master=rank == 0,
        timeout=timeout,
        wait_for_workers=False,
        # The store's own server would listen on every interface: it gets a socket on the address only.
        master_listen_fd=(listen_sock or listening_socket(master_address, master_port)).detach() if rank == 0 else None,
    )
    # SGLang's layout (common.py:2905): every key of this group under its name.
    group = _new_group(dist.PrefixStore(group_name, store), rank, world_size, group_name, backend, timeout)
    _STORES[group] = store
    return group


def destroy_weight_update_group(group: dist.ProcessGroup) -> None:
    """Tear down a group made by `init_weight_update_group` (e.g. to re-create it
    when the set of engines changes)."""
    dist.destroy_process_group(group)
    _STORES.pop(group, None)  # the store closes its listening socket when freed


def abort_weight_update_group(group: dist.ProcessGroup) -> None:
    """Give up a group whose collective may be in flight (an engine failed mid-broadcast); it is
    unregistered here and cannot be used again: form a new one.

    NCCL: `abort()` ends the communicator (`ncclCommAbort`), which returns a pending broadcast with an
    error. Gloo (torch 2.13): `abort()` does not interrupt a pending operation (measured: a broadcast
    stays blocked until its peers close their connections), so the caller must not wait for it; the
    operation ends once the engines destroy their side of the group, or die."""
    try:
        c10d._abort_process_group(group)
    except ValueError:  # already destroyed or aborted
        pass
    _STORES.pop(group, None)


def _new_group(store, rank, world_size, group_name, backend, timeout) -> dist.ProcessGroup:
    helper = c10d._new_process_group_helper
    options_kw = "backend_options" if "backend_options" in inspect.signature(helper).parameters else "pg_options"
    with _no_split_from_default_group():
        group, _ = helper(
            world_size,
            rank,
            [],  # an empty rank list: not a subgroup of any default group
            c10d.Backend(backend),
            store,
            group_name=group_name,
            timeout=timeout,
            **{options_kw: None},
        )
    # Group rank == "global" rank inside this group, so `src=0` means the trainer.
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


class _no_split_from_default_group:
    """With an NCCL default group bound to a device, torch would try to split the
    new communicator from it (`ncclCommSplit`), which is wrong for a group whose
    members are other processes entirely; hide the binding while creating it."""

    def __enter__(self):
        self.default = c10d.GroupMember.WORLD if dist.is_initialized() else None
        self.bound = getattr(self.default, "bound_device_id", None)
        if self.bound is not None:
            self.default.bound_device_id = None

    def __exit__(self, *exc):
        if self.bound is not None:
            self.default.bound_device_id = self.bound
