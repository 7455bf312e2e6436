"""The weight-update group against SGLang's own code: the engine's side is made by SGLang's `init_custom_process_group`.

What a user relies on: the trainer's weight sync reaches a real SGLang engine. SGLang's function
(sglang 0.5.23, `sglang/srt/utils/common.py:2859-2927`) keys the group's rendezvous under
`PrefixStore(group_name, store)`; a trainer that keys it otherwise waits for keys SGLang never
writes, and the run hangs at its first sync. Here the engine's side is SGLang's own code, in the
stand-in engine of tests/sglang_real.py (a child process); the trainer's side is
`WeightBroadcaster` (rank 0) in this process:

- SGLang's rank joins the trainer's group, and every tensor of every bucket arrives exactly, in
  either of SGLang's receive formats;
- a CPU engine joins the same group beside SGLang's rank, and serves the trainer's weights: its
  group code keeps SGLang's layout (the CPU engine cannot import SGLang at run time);
- an engine that answers a bucket's announce with an error fails the sync within seconds, naming
  the engine, instead of holding rank 0 in the broadcast until the group's timeout; afterwards the
  group forms again and the sync goes through. An engine that refuses to join fails the group's
  creation as fast.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
import torch
from engine_fixtures import HOST, REPO_ROOT, EngineServer, free_port, subprocess_env, tiny_model_dir  # noqa: F401
from transformers import AutoModelForCausalLM

from relax_core.rollout.client import EngineClient, parse_generate_output
from relax_core.rollout.weight_group import destroy_weight_update_group
from relax_core.weights.sync import WeightBroadcaster, WeightSyncError

API_KEY = "sglang-group-key"
GROUP_TIMEOUT = timedelta(seconds=30)  # the trainer's side: a group that cannot form fails the test in 30 s
FAST_S = 10.0  # "at once": the group's timeout is 30 s here, 10 minutes in a run
JOIN_TIMEOUT = timedelta(seconds=180)  # for a group whose other ranks are processes still starting
GREEDY = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
PROMPT = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def sglang_engine(tmp_path_factory):
    """The stand-in engine whose weight-update group is SGLang's own (tests/sglang_real.py)."""
    port = free_port()
    log = tmp_path_factory.mktemp("sglang") / "engine.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, str(REPO_ROOT / "tests" / "sglang_real.py"), "engine",
                                 "--host", HOST, "--port", str(port)],
                                stdout=out, stderr=subprocess.STDOUT, env=subprocess_env())
    url = f"http://{HOST}:{port}"
    try:
        _wait_healthy(proc, url, log)
        yield url
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def cpu_engine(tiny_model_dir, tmp_path_factory):  # noqa: F811
    """A CPU engine of this module's own: the tests change its weights."""
    log = tmp_path_factory.mktemp("cpu_engine") / "engine.log"
    with EngineServer(tiny_model_dir, log, API_KEY, "--enable-memory-saver") as server:
        yield server


def _wait_healthy(proc: subprocess.Popen, url: str, log: Path, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the SGLang stand-in exited with {proc.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"the SGLang stand-in did not start in {timeout}s:\n{log.read_text()}")


def received(url: str, path: Path) -> dict:
    """What the SGLang stand-in received so far: {"tensors": {name: tensor}, "weight_version": str,
    "load_formats": [each update's load_format]}."""
    answer = httpx.post(f"{url}/received", json={"path": str(path)}, timeout=30).json()
    assert answer["success"], answer
    return torch.load(path)


def some_tensors(seed: int) -> list[tuple[str, torch.Tensor]]:
    """Tensors of several dtypes and sizes; with 8 KiB buckets, three buckets: one tensor, two (the int64
    first, so the bfloat16 after it starts aligned and the bucket can go flattened), one."""
    gen = torch.Generator().manual_seed(seed)
    return [
        ("model.a.weight", torch.randn(64, 32, generator=gen)),
        ("model.c.index", torch.randint(0, 1000, (5, 3), generator=gen)),
        ("model.b.bias", torch.randn(7, generator=gen).to(torch.bfloat16)),
        ("model.d.weight", torch.randn(4096, generator=gen)),
    ]


def perturbed(model_dir: Path, seed: int) -> torch.nn.Module:
    """The engine's model with different weights (what a training step makes)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=gen))
    return model


async def max_logprob_error(client: EngineClient, model: torch.nn.Module) -> float:
    out = parse_generate_output(await client.generate(PROMPT, sampling_params=GREEDY))
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor([PROMPT + out.output_ids])).logits[0], dim=-1)
    mine = [logp[len(PROMPT) + t - 1, tok].item() for t, tok in enumerate(out.output_ids)]
    return max(abs(a - b) for a, b in zip(out.logprobs, mine))


def client_of(url: str, api_key: str | None = None) -> EngineClient:
    """A client whose calls give up after a minute: an engine left waiting in a rendezvous fails the test."""
    return EngineClient(url, api_key=api_key, timeout=60)


def broadcaster(clients: list[EngineClient], group_name: str, **kwargs) -> WeightBroadcaster:
    """Over gloo, each bucket flattened as the trainer sends it to SGLang over NCCL (unless `flatten=False`)."""
    return WeightBroadcaster(clients, HOST, group_name=group_name, backend="gloo", bucket_bytes=8 << 10,
                             timeout=kwargs.pop("timeout", GROUP_TIMEOUT), flatten=kwargs.pop("flatten", True),
                             **kwargs)


@pytest.mark.parametrize("flatten", [True, False], ids=["flattened-bucket", "per-tensor"])
def test_sglangs_own_group_function_joins_the_trainers_group(sglang_engine, tmp_path, flatten):
    async def main():
        async with client_of(sglang_engine) as sglang:
            sync = broadcaster([sglang], f"relax_sglang_1_{int(flatten)}", flatten=flatten)
            await sync.init()
            try:
                stats = await sync.broadcast(some_tensors(1), version=7)
            finally:
                await sync.close()
            return stats

    stats = asyncio.run(main())
    assert stats.num_buckets == 3
    got = received(sglang_engine, tmp_path / "received.pt")
    assert got["weight_version"] == "7"
    assert got["load_formats"][-3:] == [None, "flattened_bucket" if flatten else None, None]  # one tensor: as it is
    for name, tensor in some_tensors(1):
        assert got["tensors"][name].dtype == tensor.dtype and torch.equal(got["tensors"][name], tensor), name


def test_a_cpu_engine_and_sglang_take_the_weights_from_one_group(sglang_engine, cpu_engine, tiny_model_dir, tmp_path):  # noqa: F811
    model = perturbed(tiny_model_dir, seed=2)

    async def main():
        async with client_of(sglang_engine) as sglang, client_of(cpu_engine.base_url, API_KEY) as cpu:
            sync = broadcaster([sglang, cpu], "relax_sglang_2")  # ranks: trainer 0, SGLang 1, CPU engine 2
            await sync.init()
            try:
                await sync.broadcast(model.state_dict().items(), version=8)
            finally:
                await sync.close()
            return await cpu.get_weight_version(), await max_logprob_error(cpu, model)

    version, error = asyncio.run(main())
    assert version == "8" and error < 1e-4
    got = received(sglang_engine, tmp_path / "received.pt")
    assert got["weight_version"] == "8"
    for name, tensor in model.state_dict().items():
        assert torch.equal(got["tensors"][name], tensor), name


def test_an_engine_refusing_a_bucket_fails_the_sync_at_once_and_the_group_forms_again(
        sglang_engine, cpu_engine, tiny_model_dir, tmp_path):  # noqa: F811
    model = perturbed(tiny_model_dir, seed=3)

    async def main():
        async with client_of(sglang_engine) as sglang, client_of(cpu_engine.base_url, API_KEY) as cpu:
            sync = broadcaster([cpu, sglang], "relax_sglang_3")
            await sync.init()
            # An engine whose weights are released answers the announce with an error and receives nothing.
            await cpu.release_memory_occupation(["weights"])
            start = time.monotonic()
            with pytest.raises(WeightSyncError) as failed:
                await asyncio.wait_for(sync.broadcast(some_tensors(3), version=9), timeout=3 * FAST_S)
            took = time.monotonic() - start
            await cpu.resume_memory_occupation(["weights"])
            await sync.set_engines([cpu, sglang])  # what the controller's recovery does
            try:
                await sync.broadcast(model.state_dict().items(), version=10)
            finally:
                await sync.close()
            return failed.value, took, await cpu.get_weight_version(), await max_logprob_error(cpu, model)

    error, took, version, logprob_error = asyncio.run(main())
    assert took < FAST_S, f"the failed sync took {took:.1f}s"
    assert cpu_engine.base_url in str(error) and "weights are released" in str(error)
    assert version == "10" and logprob_error < 1e-4
    got = received(sglang_engine, tmp_path / "received.pt")
    assert got["weight_version"] == "10"
    assert all(torch.equal(got["tensors"][name], t) for name, t in model.state_dict().items())


def test_an_engine_refusing_to_join_fails_the_groups_creation_at_once(cpu_engine):
    async def main():
        async with client_of(cpu_engine.base_url, API_KEY) as cpu:
            stale = broadcaster([cpu], "relax_sglang_4")
            await stale.init()
            # The trainer's side ends (a trainer that restarted), the engine's stays: it refuses a new group so named.
            destroy_weight_update_group(stale.group)
            fresh = broadcaster([cpu], "relax_sglang_4", timeout=timedelta(seconds=60))
            start = time.monotonic()
            with pytest.raises(WeightSyncError) as failed:
                await asyncio.wait_for(fresh.init(), timeout=3 * FAST_S)
            return failed.value, time.monotonic() - start

    error, took = asyncio.run(main())
    assert took < FAST_S, f"the failed creation took {took:.1f}s"
    assert cpu_engine.base_url in str(error) and "already exists" in str(error)


def test_the_pinned_copy_of_sglangs_group_function_joins_the_same_group_as_sglangs_own(tmp_path):
    """Where SGLang cannot be imported (the GPU test machine) tests/gpu/check.py makes the engine's side with
    tests/sglang_real.py's pinned copy of `init_custom_process_group`. Here the trainer's rank 0, SGLang's own
    function (rank 1) and the copy (rank 2) form one group: it forms only if all three key the rendezvous
    alike, and both engine ranks receive every tensor."""
    import json

    from relax_core.cluster.ports import listening_socket
    from relax_core.rollout.weight_group import init_weight_update_group

    sock = listening_socket(HOST, 0)
    port = sock.getsockname()[1]
    tensors = [torch.arange(12.0).reshape(3, 4), torch.full((5,), 2.5)]
    shapes = json.dumps([list(t.shape) for t in tensors])
    procs = {which: subprocess.Popen(
        [sys.executable, str(REPO_ROOT / "tests" / "sglang_real.py"), "join", "--which", which, "--init-method",
         f"tcp://{HOST}:{port}", "--world-size", "3", "--rank", str(rank), "--shapes", shapes,
         "--out", str(tmp_path / which)], env=subprocess_env()) for rank, which in ((1, "sglang"), (2, "pinned"))}
    try:
        # Both children import torch and SGLang's modules before they join: on a loaded 2-core machine that
        # took more than GROUP_TIMEOUT (DistStoreError: wait timeout after 30000ms), so they get JOIN_TIMEOUT.
        group = init_weight_update_group(HOST, port, 0, 3, "weight_update_group", "gloo", JOIN_TIMEOUT, sock)
        for t in tensors:
            torch.distributed.broadcast(t, src=0, group=group)
        torch.distributed.barrier(group=group)  # the children leave once all three are done
        for which, proc in procs.items():
            assert proc.wait(timeout=120) == 0, which
            assert json.loads((tmp_path / which).read_text()) == [float(t.sum()) for t in tensors], which
        destroy_weight_update_group(group)
    finally:
        for proc in procs.values():
            proc.kill()
