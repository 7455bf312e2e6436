"""Weights handed over by reference, against SGLang's own serializer (`/update_weights_from_tensor`).

What a user relies on: in colocate on shared GPUs the trainer hands its tensors to SGLang by
reference (relax_core/weights/ipc.py, in the wire format of relax_core/rollout/weight_wire.py), and
SGLang decodes them with its own code; the CPU engine, which stands in for SGLang here and cannot
import it, decodes what SGLang's serializer writes.
A child process (this file as a script) imports SGLang's functions (tests/sglang_real.py) and:

- decodes Relax's payloads the way an SGLang engine does (sglang 0.5.23: the tokenizer manager's
  `normalize_serialized_named_tensor_payloads`, tokenizer_control_mixin.py:576, then each TP rank's
  `monkey_patch_torch_reductions()` and `MultiprocessingSerializer.deserialize` of its own entry,
  tp_worker.py:194-201), one payload per TP rank;
- serializes tensors with `MultiprocessingSerializer.serialize(..., output_str=True)`, which the
  CPU engine's decoder reads (and refuses, saying what to change, under torch's default
  file-descriptor sharing, which no unrelated process can open);
- serializes with Relax's serializer where SGLang's patch is active (an SGLang process, or a
  trainer that applied it as verl and slime do), which SGLang's own patched reduction cannot do for
  CPU tensors;
- reports how SGLang names its CUDA rebuild function in a pickle, and which function its
  `SafeUnpickler` gives for torch's name once patched: CUDA payloads of either kind must reach a
  rebuild that takes the device's UUID.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from engine_fixtures import REPO_ROOT, subprocess_env

from relax_core.rollout import weight_wire
from relax_core.weights import ipc

TP = 2  # payloads per engine: one per TP rank


def some_tensors(seed: int) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        ("model.embed_tokens.weight", torch.randn(16, 8, generator=gen)),
        ("model.norm.weight", torch.randn(8, generator=gen).to(torch.bfloat16)),
        ("model.layers.0.mlp.up_proj.weight", torch.randn(24, 8, generator=gen).to(torch.float16)),
        ("model.position_ids", torch.arange(10)),
    ]


def as_json(named) -> list:
    return [[name, str(t.dtype).removeprefix("torch."), list(t.shape), t.float().flatten().tolist()]
            for name, t in named]


def from_json(items) -> list[tuple[str, torch.Tensor]]:
    return [(name, torch.tensor(values).view(shape).to(getattr(torch, dtype))) for name, dtype, shape, values in items]


def same(named_a, named_b) -> bool:
    return len(named_a) == len(named_b) and all(
        a == b and ta.dtype == tb.dtype and torch.equal(ta, tb) for (a, ta), (b, tb) in zip(named_a, named_b))


@pytest.fixture(scope="module")
def exchange():
    """One conversation with the SGLang child: Relax's payloads decoded there, SGLang's decoded here."""
    staging = ipc.SharedStaging()
    staged = staging.stage(some_tensors(1))  # as TensorHandover stages a bucket; referenced until the child is done
    payloads = weight_wire.serialize_named_tensors(staged, ranks=TP)
    child = subprocess.Popen([sys.executable, __file__, "sglang"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=_child_env())
    try:
        child.stdin.write(json.dumps({"payloads": payloads}) + "\n")
        child.stdin.flush()
        line = child.stdout.readline()
        assert line, f"the SGLang child ended without answering:\n{child.stderr.read()}"
        answer = json.loads(line)
        ours = {}
        for strategy, payload in answer["sglang_payloads"].items():  # decoded while the child holds the tensors
            try:
                ours[strategy] = weight_wire.deserialize_named_tensors(payload)
            except Exception as exc:  # noqa: BLE001 - the test reads it
                ours[strategy] = exc
        child.stdin.write("done\n")
        child.stdin.flush()
        assert child.wait(timeout=60) == 0, child.stderr.read()
    finally:
        if child.poll() is None:
            child.kill()
    return answer, ours


def _child_env() -> dict[str, str]:
    env = subprocess_env()
    env["PYTHONPATH"] = f"{REPO_ROOT / 'tests'}:{env['PYTHONPATH']}"  # for sglang_real
    return env


def test_sglang_decodes_relaxs_payloads_one_per_tp_rank(exchange):
    answer, _ = exchange
    assert len(answer["decoded"]) == TP
    for rank in range(TP):
        assert same(from_json(answer["decoded"][rank]), some_tensors(1)), rank


def test_the_cpu_engine_decodes_sglangs_serializer(exchange):
    _, ours = exchange
    assert same(ours["file_system"], some_tensors(2))
    # torch's default sharing passes file descriptors that only a forked child can open: refused, naming why.
    assert isinstance(ours["file_descriptor"], Exception)
    assert "rebuild_storage_fd" in str(ours["file_descriptor"]) and "by file name" in str(ours["file_descriptor"])


def test_relaxs_serializer_works_where_sglangs_patch_is_active(exchange):
    answer, _ = exchange
    assert "IndexError" in answer["sglang_patched_cpu"]  # SGLang's own reduction, patched, fails on CPU tensors
    roundtrip = answer["patched_roundtrip"]
    assert isinstance(roundtrip, list), roundtrip
    assert same(from_json(roundtrip), some_tensors(3))  # Relax's, decoded by SGLang's


def test_cuda_payloads_reach_a_rebuild_that_takes_the_devices_uuid(exchange):
    answer, _ = exchange
    # Relax pickles torch's name: SGLang's unpickler, once patched, gives its UUID-aware rebuild for it.
    assert answer["torch_name_resolves_to"] == ["sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified"]
    # verl and slime pickle SGLang's name (the patch applied in the trainer): the CPU engine maps it to its own.
    module, name = answer["patched_rebuild_pickled_as"]
    assert weight_wire._TensorUnpickler(io.BytesIO(b"")).find_class(module, name) is weight_wire._rebuild_cuda_tensor
    # Both rewrite the same argument of torch's rebuild_cuda_tensor: the device.
    assert answer["device_arg"] == weight_wire._DEVICE_ARG
    assert answer["rebuild_cuda_tensor_params"][weight_wire._DEVICE_ARG] == "storage_device"


# ---------------------------------------------------------------------------
# The SGLang side (not collected by pytest): `python test_sglang_ipc.py sglang`.
# ---------------------------------------------------------------------------


def sglang_main() -> None:
    import inspect
    import pickle

    import sglang_real
    import torch.multiprocessing as torch_mp
    from torch.multiprocessing import reductions

    sglang = sglang_real.load()
    request = json.loads(sys.stdin.readline())
    answer = {"sglang_payloads": {}}
    keep = []  # SGLang's tensors stay alive until the parent has decoded them
    for strategy in ("file_system", "file_descriptor"):
        torch_mp.set_sharing_strategy(strategy)
        named = some_tensors(2)
        keep.append(named)
        answer["sglang_payloads"][strategy] = sglang.MultiprocessingSerializer.serialize(named, output_str=True)
    torch_mp.set_sharing_strategy("file_system")

    # An engine's path for /update_weights_from_tensor (tokenizer_control_mixin.py:576, tp_worker.py:194-201).
    payloads = sglang.normalize_serialized_named_tensor_payloads(request["payloads"])
    decoded = []
    for tp_rank in range(len(payloads)):
        sglang.monkey_patch_torch_reductions()
        decoded.append(as_json(sglang.MultiprocessingSerializer.deserialize(payloads[tp_rank])))
    answer["decoded"] = decoded

    # Now SGLang's patch is active in this process.
    try:
        sglang.MultiprocessingSerializer.serialize(some_tensors(3))
        answer["sglang_patched_cpu"] = "no error"
    except Exception as exc:  # noqa: BLE001
        answer["sglang_patched_cpu"] = repr(exc)
    staged = ipc.SharedStaging().stage(some_tensors(3))
    try:
        answer["patched_roundtrip"] = as_json(sglang.MultiprocessingSerializer.deserialize(
            weight_wire.serialize_named_tensors(staged)[0]))
    except Exception as exc:  # noqa: BLE001 - the test reads it
        answer["patched_roundtrip"] = repr(exc)

    resolved = sglang.SafeUnpickler(io.BytesIO(b"")).find_class("torch.multiprocessing.reductions",
                                                               "rebuild_cuda_tensor")
    answer["torch_name_resolves_to"] = [resolved.__module__, resolved.__qualname__]
    pickled = pickle.dumps(reductions.rebuild_cuda_tensor)  # the patched one: what a patched pickler writes
    answer["patched_rebuild_pickled_as"] = _global_of(pickled)
    answer["device_arg"] = sglang.patch_torch._REDUCE_TENSOR_ARG_DEVICE_INDEX
    original = reductions._rebuild_cuda_tensor_original
    answer["rebuild_cuda_tensor_params"] = list(inspect.signature(original).parameters)
    print(json.dumps(answer), flush=True)
    sys.stdin.readline()  # "done"


def _global_of(pickled: bytes) -> list[str]:
    """(module, name) of the one global a pickle of a function refers to."""
    import pickletools

    ops = [(op.name, arg) for op, arg, _ in pickletools.genops(pickled)]
    strings = [arg for name, arg in ops if name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE")]
    if any(name == "STACK_GLOBAL" for name, _ in ops):
        return strings[-2:]
    return next(arg.split(" ") for name, arg in ops if name == "GLOBAL")


if __name__ == "__main__":
    assert sys.argv[1:] == ["sglang"], sys.argv
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sglang_main()
