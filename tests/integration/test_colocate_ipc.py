"""Colocate on shared devices, real CPU engine servers: memory released and resumed, weights handed over by reference.

What a user relies on: an engine that released its memory gives it back (its
RSS drops by about the model's size), serves nothing until resumed, and after
resume + a weight update serves the trainer's weights exactly; weights handed
over by reference (`/update_weights_from_tensor`, relax_core/weights/ipc.py)
from a separate trainer process are the trainer's, bucket by bucket, with the
new weight version, and leave nothing behind in /dev/shm; with several
trainer ranks, each engine rank gets the weights of the trainer rank on its
device (colocated on GPUs, the rank on the same GPU), rank 0 posting them.

The trainer processes run this file as a script (`python test_colocate_ipc.py
trainer|rank ...`); pytest only drives them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from engine_fixtures import HOST, EngineServer, free_port, subprocess_env, tiny_model_dir  # noqa: F401
from transformers import AutoModelForCausalLM

from relax_core.rollout.client import EngineClient, EngineError, parse_generate_output

API_KEY = "colocate-key"
BUCKET_BYTES = 16 << 10  # the tiny model is ~190 KiB: many buckets
GREEDY = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
PROMPT = [5, 6, 7, 8]


def run(server: EngineServer, fn):
    async def main():
        async with EngineClient(server.base_url, api_key=server.api_key, timeout=120) as client:
            return await fn(client)

    return asyncio.run(main())


def logprobs(model, prompt: list[int], output: list[int]) -> list[float]:
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor([prompt + output])).logits[0], dim=-1)
    return [logp[len(prompt) + t - 1, tok].item() for t, tok in enumerate(output)]


def max_error(model, result: dict) -> float:
    out = parse_generate_output(result)
    return max(abs(a - b) for a, b in zip(out.logprobs, logprobs(model, PROMPT, out.output_ids)))


def rss_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmRSS:")).split()[1]) / 1024


def shm_files() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith("torch_")}


@pytest.fixture(scope="module")
def wide_model_dir(tmp_path_factory) -> Path:
    """A tiny Qwen3 of ~36 MiB of float32 weights: big enough to see in the engine's RSS."""
    from relax_core.models.tiny import materialize_tiny_model

    return materialize_tiny_model(tmp_path_factory.mktemp("wide_model"), hidden_size=512, num_layers=4,
                                  alphabet="abcd", seed=1)


@pytest.fixture(scope="module")
def saver_engine(wide_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("saver") / "engine.log"
    with EngineServer(wide_model_dir, log, API_KEY, "--enable-memory-saver") as server:
        yield server


def test_released_engine_gives_memory_back_refuses_work_and_serves_the_update_after_resume(saver_engine,
                                                                                         wide_model_dir):
    from relax_core.weights.ipc import TensorHandover

    model = AutoModelForCausalLM.from_pretrained(wide_model_dir, dtype=torch.float32).eval()
    weights_mib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    with torch.no_grad():  # the trainer's new weights
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    pid = saver_engine.proc.pid

    async def scenario(client: EngineClient):
        seen = {"before": await client.generate(PROMPT, sampling_params=GREEDY)}
        seen["rss_serving"] = rss_mib(pid)
        await client.release_memory_occupation()  # all tags
        seen["rss_released"] = rss_mib(pid)
        seen["generate_released"] = await _status(client.generate(PROMPT, sampling_params=GREEDY))
        seen["health_generate_released"] = await client.health_generate()
        seen["health_released"] = await client.health()
        await client.begin_weight_update()
        seen["update_released"] = await _status(_handover(client, model, version=7))
        await client.end_weight_update()
        await client.resume_memory_occupation(["weights"])
        seen["generate_kv_released"] = await _status(client.generate(PROMPT, sampling_params=GREEDY))
        await client.resume_memory_occupation(["kv_cache", "cuda_graph"])
        seen["resumed_no_update"] = await client.generate(PROMPT, sampling_params=GREEDY)
        seen["rss_resumed"] = rss_mib(pid)
        await client.release_memory_occupation(["weights"])
        seen["rss_released_again"] = rss_mib(pid)
        await client.resume_memory_occupation(["weights"])
        seen["stats"] = await TensorHandover([client], HOST, bucket_bytes=4 << 20).broadcast(
            model.named_parameters(), version=7)
        seen["after"] = await client.generate(PROMPT, sampling_params=GREEDY)
        seen["version"] = await client.get_weight_version()
        return seen

    seen = run(saver_engine, scenario)

    rss = [seen[k] for k in ("rss_serving", "rss_released", "rss_resumed", "rss_released_again")]
    assert rss[0] - rss[1] > 0.8 * weights_mib and rss[2] - rss[3] > 0.8 * weights_mib, (rss, weights_mib)
    assert seen["generate_released"] == 503 and seen["generate_kv_released"] == 503
    assert not seen["health_generate_released"] and not seen["health_released"]  # SGLang's /health generates too
    assert seen["update_released"] == 400  # weights must be resumed before they are updated
    # Resumed without an update, the weights are zeros: every token equally likely.
    uniform = -torch.log(torch.tensor(float(model.config.vocab_size))).item()
    assert max(abs(lp - uniform) for lp in parse_generate_output(seen["resumed_no_update"]).logprobs) < 1e-5
    assert seen["stats"].num_buckets >= 5 and seen["version"] == "7"
    assert parse_generate_output(seen["after"]).weight_version == "7"
    assert max_error(model, seen["after"]) < 1e-4  # the trainer's weights, not the ones loaded from disk
    assert max_error(model, seen["before"]) > 1e-2


async def _status(call) -> int:
    try:
        await call
    except EngineError as exc:
        return exc.status_code
    return 200


async def _handover(client: EngineClient, model, version: int) -> None:
    from relax_core.rollout.weight_wire import serialize_named_tensors

    named = [(n, p.detach()) for n, p in model.named_parameters()][:2]
    await client.update_weights_from_tensor(serialize_named_tensors(named), weight_version=str(version))


def test_release_is_refused_while_requests_run_and_without_the_memory_saver(saver_engine, engine):
    async def busy(client: EngineClient):
        start = (await client.get_model_info())["engine_stats"]["decode_steps"]
        task = asyncio.ensure_future(client.generate(PROMPT, sampling_params={"max_new_tokens": 40,
                                                                              "ignore_eos": True}))
        while (await client.get_model_info())["engine_stats"]["decode_steps"] < start + 3:
            await asyncio.sleep(0.02)
        with pytest.raises(EngineError) as err:
            await client.release_memory_occupation()
        return err.value, await task

    error, result = run(saver_engine, busy)
    assert error.status_code == 400 and "idle" in error.message
    assert len(result["output_ids"]) == 40  # the running request was not disturbed

    with pytest.raises(EngineError) as err:  # the shared engine runs without --enable-memory-saver
        run(engine, lambda c: c.release_memory_occupation(["kv_cache"]))
    assert "--enable-memory-saver" in err.value.message


def test_tensor_updates_need_a_weight_update_session(saver_engine, wide_model_dir):
    model = AutoModelForCausalLM.from_pretrained(wide_model_dir, dtype=torch.float32)

    async def scenario(client: EngineClient):
        outside = await _status(_handover(client, model, version=1))
        await client.begin_weight_update()
        twice = await _status(client.begin_weight_update())
        await client.end_weight_update()
        return outside, twice

    assert run(saver_engine, scenario) == (400, 400)


def test_trainer_process_hands_its_weights_to_the_engine_by_reference(tiny_model_dir, tmp_path):  # noqa: F811
    engine = EngineServer(tiny_model_dir, tmp_path / "engine.log", API_KEY).start()
    out, log = tmp_path / "result.json", tmp_path / "trainer.log"
    shm_before = shm_files()
    try:
        with log.open("w") as stream:
            trainer = subprocess.Popen([sys.executable, __file__, "trainer", "--model", str(tiny_model_dir),
                                        "--engine", engine.base_url, "--out", str(out)],
                                       stdout=stream, stderr=subprocess.STDOUT, env=subprocess_env())
        engine.wait_healthy()
        assert trainer.wait(timeout=150) == 0, log.read_text()
        leftover = shm_files() - shm_before  # the trainer's shared memory, once it and the engine let go
    finally:
        engine.stop()
    result = json.loads(out.read_text())

    for sync in result["syncs"]:
        assert sync["num_buckets"] >= 5
        assert sync["reported_version"] == str(sync["version"]) == sync["meta_version"]
        assert sync["max_diff_to_trainer"] < 1e-4
        assert sync["max_diff_to_previous"] > 1e-3  # the weights did change
    assert [s["version"] for s in result["syncs"]] == [1, 2]
    assert not leftover


def test_each_engine_rank_gets_the_weights_of_the_trainer_rank_on_its_device(tiny_model_dir, tmp_path):  # noqa: F811
    # Two trainer ranks whose weights differ; the engine's one rank is "on the device" of trainer rank 1.
    engine = EngineServer(tiny_model_dir, tmp_path / "engine.log", API_KEY).start()
    out, port = tmp_path / "ranks.json", free_port()
    logs = [tmp_path / f"rank{r}.log" for r in range(2)]
    procs = []
    try:
        for rank, log in enumerate(logs):
            with log.open("w") as stream:
                procs.append(subprocess.Popen(
                    [sys.executable, __file__, "rank", "--rank", str(rank), "--dist-port", str(port), "--model",
                     str(tiny_model_dir), "--engine", engine.base_url, "--out", str(out)],
                    stdout=stream, stderr=subprocess.STDOUT, env=subprocess_env()))
        engine.wait_healthy()
        for proc, log in zip(procs, logs):
            assert proc.wait(timeout=150) == 0, log.read_text()
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        engine.stop()
    result = json.loads(out.read_text())
    assert result["max_diff_to_rank1"] < 1e-4 and result["max_diff_to_rank0"] > 1e-3
    assert result["version"] == "5" and result["num_buckets"] >= 5


# ---------------------------------------------------------------------------
# The trainer processes started by the tests above (not collected by pytest).
# ---------------------------------------------------------------------------


async def _trainer_syncs(args, model, optimizer) -> list[dict]:
    import copy

    from relax_core.weights.ipc import TensorHandover

    syncs = []
    async with EngineClient(args.engine, api_key=API_KEY) as client:
        while not await client.health():
            await asyncio.sleep(0.2)
        handover = TensorHandover([client], HOST, bucket_bytes=BUCKET_BYTES)
        await handover.init()
        for version in (1, 2):
            previous = copy.deepcopy(model)
            _train_step(model, optimizer, version)
            stats = await handover.broadcast(model.named_parameters(), version)
            raw = await client.generate(PROMPT, sampling_params=GREEDY)
            out = parse_generate_output(raw)
            trainer, before = logprobs(model, PROMPT, out.output_ids), logprobs(previous, PROMPT, out.output_ids)
            syncs.append({
                "version": version, "num_buckets": stats.num_buckets, "meta_version": out.weight_version,
                "reported_version": await client.get_weight_version(),
                "max_diff_to_trainer": max(abs(a - b) for a, b in zip(out.logprobs, trainer)),
                "max_diff_to_previous": max(abs(a - b) for a, b in zip(out.logprobs, before)),
            })
        await handover.close()
    return syncs


def _train_step(model, optimizer, step: int) -> None:
    gen = torch.Generator().manual_seed(step)
    ids = torch.randint(3, model.config.vocab_size, (4, 24), generator=gen)
    model.train()
    loss = model(input_ids=ids, labels=ids).loss
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    model.eval()


def trainer_main(args) -> None:
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    Path(args.out).write_text(json.dumps({"syncs": asyncio.run(_trainer_syncs(args, model, optimizer))}))


def _perturbed(model, seed: int):
    """The model with every weight moved by seeded noise (each rank its own seed, any rank can recompute)."""
    import copy

    model = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return model.eval()


def rank_main(args) -> None:
    import torch.distributed as dist

    from relax_core.weights.ipc import TensorHandover

    listen = None
    if args.rank == 0:
        listen = socket.socket()
        listen.bind((HOST, args.dist_port))
        listen.listen(8)
    store = dist.TCPStore(HOST, args.dist_port, 2, is_master=args.rank == 0, timeout=timedelta(seconds=60),
                          wait_for_workers=False, master_listen_fd=listen.detach() if listen else None)
    dist.init_process_group("gloo", store=store, rank=args.rank, world_size=2)
    base = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    mine = _perturbed(base, seed=args.rank)

    async def hand_over() -> dict | None:
        if args.rank == 1:
            await TensorHandover([], HOST, rank=1, world_size=2).broadcast(mine.named_parameters(), 5)
            return None
        async with EngineClient(args.engine, api_key=API_KEY) as client:
            while not await client.health():
                await asyncio.sleep(0.2)
            handover = TensorHandover([client], HOST, BUCKET_BYTES, sources={args.engine: [1]}, rank=0, world_size=2)
            await handover.init()
            stats = await handover.broadcast(mine.named_parameters(), 5)
            out = await client.generate(PROMPT, sampling_params=GREEDY)
        return {"max_diff_to_rank1": max_error(_perturbed(base, seed=1), out),
                "max_diff_to_rank0": max_error(mine, out), "version": out["meta_info"]["weight_version"],
                "num_buckets": stats.num_buckets}

    result = asyncio.run(hand_over())
    if result is not None:
        Path(args.out).write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["trainer", "rank"])
    parser.add_argument("--model", required=True)
    parser.add_argument("--engine", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--dist-port", type=int, default=0)
    cli = parser.parse_args()
    (trainer_main if cli.role == "trainer" else rank_main)(cli)
