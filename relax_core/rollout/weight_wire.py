"""The wire format of an engine's `/update_weights_from_tensor`: named tensors passed by reference.

Both sides speak it: the trainer ranks that hand colocated engines their
weights (`relax_core.weights.ipc`) pickle with `serialize`, and
the CPU engine decodes with `deserialize_named_tensors` as SGLang does with its
own deserializer. It is the engines' API, so it lives with them, below the
trainer's side.

Wire format (SGLang 0.5.23's `MultiprocessingSerializer`,
sglang/srt/utils/common.py:3060-3099): each entry of
`serialized_named_tensors` is the base64 text of a `ForkingPickler` pickle of
`[(hf_name, tensor), ...]` (load_format None or "direct"), one entry per TP
rank, each pickled on its own: an engine rank decodes only its own entry
(sglang/srt/managers/tp_worker.py:194-201 `deserialize_own_rank`; CUDA IPC
counts references per pickle). SGLang also takes load_format
"flattened_bucket" (one flat tensor and its metadata per payload,
model_runner_components/weight_updater.py:354-357) and custom loaders; Relax
sends neither, and the CPU engine refuses them (its request schema).

CUDA tensors name their device by UUID, so the engine finds it whatever its
CUDA_VISIBLE_DEVICES. That is what SGLang's `monkey_patch_torch_reductions`
does (sglang/srt/utils/patch_torch.py:41-59): it swaps torch's
`reduce_tensor` for `_reduce_tensor_modified` (:72-77), which puts
`_device_to_uuid(index)` (:85-86) in argument 6 of `rebuild_cuda_tensor`
(`storage_device`; `_REDUCE_TENSOR_ARG_DEVICE_INDEX`, :64), and
`_rebuild_cuda_tensor_modified` (:80-82) maps it back through
`_device_from_maybe_uuid` (:89-99); the engine applies the patch before it
decodes (tp_worker.py:198). verl and slime call SGLang's function in the
trainer before serializing. Relax does the same rewrite in `_reduce_tensor`,
for its own pickler only: SGLang's patch is process-wide and rewrites
argument 6 of every tensor's reduction, CPU tensors' too, whose reduction has
three arguments (IndexError; sgl-project/sglang pull request 34595), which
would break every CPU tensor pickled in the trainer process. Relax's payload
names torch's `rebuild_cuda_tensor`, which SGLang's `SafeUnpickler` allows
(common.py:3329) and looks up when it decodes, after the engine's patch: so
it gets `_rebuild_cuda_tensor_modified`, which takes the UUID. In a process
where SGLang's patch is active, `_reduce_tensor` still starts from torch's
own reduction (`reductions._reduce_tensor_original`, patch_torch.py:47).
tests/integration/test_sglang_ipc.py decodes Relax's payloads with SGLang's
own deserializer and SGLang's payloads with the CPU engine's.

CPU tensors go by torch's `file_system` sharing strategy (a named file in
/dev/shm): the default file-descriptor strategy passes descriptors through a
socket that only processes sharing multiprocessing's authkey (parent and
forked child) may use, which a trainer and an engine server are not.

`deserialize_named_tensors` is the engine side (the CPU engine's
`/update_weights_from_tensor`): an unpickler that rebuilds tensors and
nothing else, since the payload comes over HTTP.
"""

from __future__ import annotations

import base64
import contextlib
import io
import pickle
import threading

import torch
import torch.multiprocessing as torch_mp
from torch.multiprocessing import reductions

_DEVICE_ARG = 6  # index of the device in `rebuild_cuda_tensor`'s arguments (SGLang's patch uses the same)
_sharing_lock = threading.Lock()


def serialize_named_tensors(named: list[tuple[str, torch.Tensor]], ranks: int = 1) -> list[str]:
    """`serialized_named_tensors` for one engine: `ranks` independent payloads of the same tensors."""
    return [serialize(named) for _ in range(ranks)]


def serialize(obj) -> str:
    """One entry of `serialized_named_tensors`: `obj` pickled with tensors by reference, in base64."""
    from multiprocessing.reduction import ForkingPickler

    buf = io.BytesIO()
    pickler = ForkingPickler(buf)
    pickler.dispatch_table[torch.Tensor] = _reduce_tensor
    with file_system_sharing():
        pickler.dump(obj)
    return base64.b64encode(buf.getvalue()).decode()


def _reduce_tensor(tensor: torch.Tensor):
    """torch's reduction, the device of a CUDA tensor named by UUID (SGLang's `_reduce_tensor_modified`,
    for CUDA tensors only: see the module docstring)."""
    reduce = getattr(reductions, "_reduce_tensor_original", reductions.reduce_tensor)  # SGLang's patch: torch's own
    rebuild, args = reduce(tensor)
    if tensor.is_cuda and isinstance(args[_DEVICE_ARG], int):
        uuid = str(torch.cuda.get_device_properties(args[_DEVICE_ARG]).uuid)
        args = (*args[:_DEVICE_ARG], uuid, *args[_DEVICE_ARG + 1 :])
    return rebuild, args


@contextlib.contextmanager
def file_system_sharing():
    """CPU storages shared (or pickled) in here go by a /dev/shm file name (see the module docstring)."""
    with _sharing_lock:
        previous = torch_mp.get_sharing_strategy()
        torch_mp.set_sharing_strategy("file_system")
        try:
            yield
        finally:
            torch_mp.set_sharing_strategy(previous)


def deserialize_named_tensors(payload: str) -> list[tuple[str, torch.Tensor]]:
    """One entry of `serialized_named_tensors` -> `[(name, tensor), ...]` (tensors mapped, not copied)."""
    data = base64.b64decode(payload, validate=True)
    named = _TensorUnpickler(io.BytesIO(data)).load()
    if not isinstance(named, list) or not all(_is_named_tensor(item) for item in named):
        raise ValueError("a payload must be a list of (name, tensor) pairs (load_format None or 'direct')")
    return [tuple(item) for item in named]


def _is_named_tensor(item) -> bool:
    return isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], str) \
        and isinstance(item[1], torch.Tensor)


def _rebuild_cuda_tensor(*args):
    """torch's `rebuild_cuda_tensor`, the device given by index or (SGLang's way) by UUID."""
    device = args[_DEVICE_ARG]
    if isinstance(device, str):
        uuids = [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]
        if device not in uuids:
            raise ValueError(f"no visible CUDA device has UUID {device}")
        device = uuids.index(device)
    return reductions.rebuild_cuda_tensor(*args[:_DEVICE_ARG], device, *args[_DEVICE_ARG + 1 :])


class _TensorUnpickler(pickle.Unpickler):
    """Rebuilds tensors and their storages; any other global is refused (the payload came over HTTP)."""

    REBUILDERS = {
        "rebuild_tensor": reductions.rebuild_tensor,
        "rebuild_typed_storage": reductions.rebuild_typed_storage,
        "rebuild_storage_filename": reductions.rebuild_storage_filename,
        "rebuild_storage_empty": reductions.rebuild_storage_empty,
        "rebuild_cuda_tensor": _rebuild_cuda_tensor,
    }
    CLASSES = {("torch", "Tensor"), ("torch", "Size"), ("torch", "UntypedStorage"), ("torch.storage", "UntypedStorage"),
               ("torch.nn.parameter", "Parameter")}

    def find_class(self, module: str, name: str):
        if module == "torch.multiprocessing.reductions" and name in self.REBUILDERS:
            return self.REBUILDERS[name]
        if (module, name) == ("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified"):
            return _rebuild_cuda_tensor  # pickled by a trainer that applied SGLang's patch
        is_dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if (module, name) in self.CLASSES or is_dtype:
            return super().find_class(module, name)
        hint = " (CPU tensors must be shared by file name: pickle them with relax_core.rollout.weight_wire)" \
            if name == "rebuild_storage_fd" else ""
        raise pickle.UnpicklingError(f"refused global {module}.{name} in a tensor payload{hint}")
