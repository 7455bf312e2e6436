"""A simulated accelerator for placement checks on a machine without a GPU.

The trainers' step code runs on CUDA in a real job and on CPU in the tests, so a CPU tensor that
meets a CUDA tensor (a metric accumulator made with `torch.zeros(...)`, a buffer a collective
sends) is a bug that no CPU test can see: on CPU everything is on one device. This module gives
the tests a second device. Inside `SimDevice()`:

- `device="meta"` (the device the code under test is told to use) makes `Sim` tensors: real CPU
  data behind a wrapper that reports `meta` as its device, so models load, train and give real
  numbers, while every tensor knows which device it would be on;
- every op checks its tensor arguments as CUDA would: a `Sim` tensor and a CPU tensor with one or
  more dimensions in one op raise `DeviceMismatch` (a 0-dimensional CPU tensor is a scalar, which
  CUDA accepts; copies and `.to()` move between devices as they do on CUDA; a CUDA tensor may be
  indexed by CPU indices);
- host transfers work as on CUDA: `.item()`, `float()`, `.tolist()`, `.cpu()`;
- with `accelerator_collectives=True`, a plain CPU tensor handed to a torch.distributed
  collective raises `DeviceMismatch` too (NCCL, the trainers' backend on GPUs, takes only CUDA
  tensors), and torch's object collectives (`all_gather_object`, ...) put their buffers on the
  simulated device, as they put them on the current CUDA device with NCCL.

Why `meta` and not `cuda`: torch's Python bindings open a device guard for a CUDA tensor, which a
CPU-only build of torch cannot do; `meta` has a guard in every build. The code under test then
takes its non-CUDA branches (gloo instead of NCCL, no `torch.cuda` calls); what it checks is the
one thing CUDA adds that the CPU cannot show: which device each tensor is on.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed.distributed_c10d as c10d
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

DEVICE = torch.device("meta")

# Ops that take tensors of two devices on CUDA too: copies and moves, and in-place swaps of storage.
_CROSS_DEVICE = {"_to_copy", "copy_", "_copy_from", "_copy_from_and_resize", "set_",
                 "_has_compatible_shallow_copy_type", "lift_fresh", "_local_scalar_dense"}
_INDEXING = {"index", "index_put_", "index_put", "_index_put_impl_"}  # a CUDA tensor indexed by CPU indices


class DeviceMismatch(RuntimeError):
    """What CUDA raises for tensors on two devices in one op ("Expected all tensors to be on the same device")."""


class Sim(torch.Tensor):
    """A tensor on the simulated device: `inner` holds its data on the CPU."""

    inner: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor):
        wrapper = torch.Tensor._make_wrapper_subclass(
            cls, inner.shape, strides=inner.stride(), storage_offset=inner.storage_offset(), dtype=inner.dtype,
            device=DEVICE, requires_grad=inner.requires_grad)
        wrapper.inner = inner
        return wrapper

    def __repr__(self) -> str:
        return f"Sim({self.inner!r})"

    @property
    def data(self):
        return torch.Tensor.data.__get__(self)

    @data.setter
    def data(self, new: torch.Tensor) -> None:
        """`t.data = other` swaps the wrapper's shape and strides (no op is dispatched): the data behind it
        must follow (megatron-core's `make_viewless_tensor` makes every layer's output this way)."""
        torch.Tensor.data.__set__(self, new)
        self.inner = new.inner if isinstance(new, Sim) else new

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.tolist:  # refused for subclasses by torch: the host copy a CUDA tensor makes
            return args[0].inner.tolist()
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"{func} on a simulated-device tensor outside `SimDevice()`")


def _is_plain_cpu(x) -> bool:
    return isinstance(x, torch.Tensor) and not isinstance(x, Sim) and x.device.type == "cpu"


def _wants_sim(kwargs: dict) -> bool:
    device = kwargs.get("device")
    return device is not None and torch.device(device).type == DEVICE.type


def _wrap(out):
    return tree_map(lambda x: Sim(x) if isinstance(x, torch.Tensor) and not isinstance(x, Sim) else x, out)


def _unwrap(tree):
    return tree_map(lambda x: x.inner if isinstance(x, Sim) else x, tree)


class SimDevice(TorchDispatchMode):
    """The simulated device, for the code run inside `with SimDevice():` (see the module docstring)."""

    def __init__(self, accelerator_collectives: bool = False):
        super().__init__()
        self.accelerator_collectives = accelerator_collectives
        self._stack = contextlib.ExitStack()

    def __enter__(self):
        if self.accelerator_collectives:  # object collectives put their buffers where NCCL's go
            original = c10d._get_object_coll_device
            self._stack.callback(setattr, c10d, "_get_object_coll_device", original)
            c10d._get_object_coll_device = lambda group=None: DEVICE.type
            # A gloo group serves the simulated device's tensors (its backend is the CPU's), as NCCL's
            # serves CUDA's (`batch_isend_irecv`, the pipeline's sends, asks the group for it).
            backend = c10d.ProcessGroup._get_backend
            self._stack.callback(setattr, c10d.ProcessGroup, "_get_backend", backend)
            c10d.ProcessGroup._get_backend = lambda group, device: backend(
                group, torch.device("cpu") if torch.device(device).type == DEVICE.type else device)
        self._stack.enter_context(_TensorFactory())
        return super().__enter__()

    def __exit__(self, *exc):
        self._stack.close()
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        self._check(func, name, args, kwargs)
        unwrapped_args, unwrapped_kwargs = _unwrap((args, kwargs))
        to_sim = _wants_sim(kwargs)
        if to_sim:
            unwrapped_kwargs = dict(unwrapped_kwargs, device=torch.device("cpu"))
        out = func(*unwrapped_args, **unwrapped_kwargs)
        if name == "_local_scalar_dense":
            return out
        if func.namespace == "c10d":  # in-place on the caller's tensors; the work handle passes through
            return out
        has_sim = any(isinstance(x, Sim) for x in _leaves((args, kwargs)))
        if name == "_to_copy":
            moved_to_cpu = kwargs.get("device") is not None and torch.device(kwargs["device"]).type == "cpu"
            return out if moved_to_cpu or not (to_sim or has_sim) else _wrap(out)
        if name in ("copy_", "set_"):
            return args[0]
        return _wrap(out) if to_sim or has_sim else out

    def _check(self, func, name: str, args, kwargs) -> None:
        leaves = _leaves((args, kwargs))
        sims = [x for x in leaves if isinstance(x, Sim)]
        if func.namespace == "c10d":
            plain = [x for x in leaves if _is_plain_cpu(x)]
            if self.accelerator_collectives and plain:
                raise DeviceMismatch(f"{func}: CPU tensors {[tuple(t.shape) for t in plain]} in a collective of "
                                     "the accelerator's group (NCCL takes only CUDA tensors)")
            return
        if not sims or name in _CROSS_DEVICE:
            return
        if name in _INDEXING:
            leaves = _leaves((args[0], args[2:] if len(args) > 2 else (), kwargs))
        plain = [x for x in leaves if _is_plain_cpu(x) and x.dim() > 0]
        if plain:
            raise DeviceMismatch(f"{func}: tensors on the accelerator and CPU tensors "
                                 f"{[tuple(t.shape) for t in plain]} in one op (CUDA refuses this)")


class _TensorFactory(TorchFunctionMode):
    """`torch.tensor(data)` as CUDA makes it, which torch does without dispatching an op: accelerator
    tensors in `data` are read to the host (megatron-core's grad norm without Apex or Transformer Engine
    makes a tensor of per-parameter norms), and `device="meta"` gives a `Sim` (torch would make a meta
    tensor without data)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not torch.tensor:
            return func(*args, **kwargs)
        data, *rest = args
        sims = [x for x in _leaves(data) if isinstance(x, Sim)]
        if sims:
            data = tree_map(lambda x: x.inner.tolist() if isinstance(x, Sim) else x, data)
            kwargs.setdefault("dtype", sims[0].dtype)
        if not _wants_sim(kwargs):
            return func(data, *rest, **kwargs)
        return Sim(func(data, *rest, **dict(kwargs, device="cpu")))


def _leaves(tree) -> list:
    out: list = []
    tree_map(out.append, tree)
    return out
