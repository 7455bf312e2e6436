"""Weight sync from a trainer process into a running CPU engine over gloo.

What a user relies on: after the trainer broadcasts its new weights (in
several buckets), the engine computes exactly the trainer's log-probs and
reports the new weight version; this works while the trainer (and the
engine side) also hold their own default process groups, and again after the
group is re-created for a changed set of engines.

The trainer-like processes run this file as a script (`python
test_weight_sync.py trainer|peer ...`); pytest only drives them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

from engine_fixtures import HOST, EngineServer, free_port, subprocess_env, tiny_model_dir  # noqa: F401
from gloo_exit import leave_group

API_KEY = "sync-token"
BUCKET_BYTES = 16 << 10  # the tiny model is ~190 KiB: many buckets


def _launch(*args: str, log: Path) -> subprocess.Popen:
    out = open(log, "w")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(
        [sys.executable, __file__, *args], stdout=out, stderr=subprocess.STDOUT, env=subprocess_env()
    )


def _wait_all(procs: list[subprocess.Popen], logs: list[Path], timeout: float = 150) -> None:
    try:
        for proc in procs:
            proc.wait(timeout=timeout)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for proc, log in zip(procs, logs):
        assert proc.returncode == 0, log.read_text()


def test_trainer_broadcast_makes_engine_match_trainer(tiny_model_dir, tmp_path):  # noqa: F811
    engine = EngineServer(tiny_model_dir, tmp_path / "engine.log", API_KEY).start()
    try:
        # The trainers start while the engine loads; they wait for /health.
        common = ["--dist-port", str(free_port()), "--model", str(tiny_model_dir), "--engine", engine.base_url]
        common += ["--master-ports", str(free_port()), str(free_port()), "--out", str(tmp_path / "result.json")]
        logs = [tmp_path / f"trainer{r}.log" for r in range(2)]
        procs = [_launch("trainer", "--rank", str(r), *common, log=logs[r]) for r in range(2)]
        engine.wait_healthy()
        _wait_all(procs, logs)
    finally:
        engine.stop()
    result = json.loads((tmp_path / "result.json").read_text())

    *syncs, live = result["syncs"]
    for sync in syncs:
        assert sync["num_buckets"] >= 5  # several buckets, each announced over HTTP
        assert sync["reported_version"] == str(sync["version"]) == sync["meta_version"]
        assert sync["max_diff_to_trainer"] < 1e-4
        assert sync["max_diff_to_previous"] > 1e-3  # the weights did change
    assert [s["version"] for s in result["syncs"]] == [3, 4, 5]
    # weights that arrive mid-request: it goes on, its tokens the old weights' up to the update, the new after
    assert live["finish_reason"] == "length" and live["tokens"] == 400
    assert 20 <= live["split"] < 400
    assert live["max_diff_before"] < 1e-4 and live["max_diff_after"] < 1e-4
    assert live["reported_version"] == "5" == live["meta_version"]
    # and the engine says so: version 4 made the tokens before the split the log-probs show, 5 the rest
    assert live["token_versions"] == [4] * live["split"] + [5] * (400 - live["split"])
    assert result["default_group_sum"] == 3.0  # the trainer's own DP group still works


def test_weight_group_alongside_default_groups_on_both_sides(tmp_path):
    common = ["--master-ports", str(free_port()), str(free_port()), "--out", str(tmp_path / "peer.json")]
    logs = [tmp_path / f"peer{r}.log" for r in range(2)]
    procs = [_launch("peer", "--rank", str(r), "--dist-port", str(free_port()), *common, log=logs[r]) for r in range(2)]
    _wait_all(procs, logs, timeout=90)
    received = json.loads((tmp_path / "peer.json").read_text())
    # Sender's tensors: arange(6) * round, for rounds 1 and 2 (re-created group).
    assert received == [[0.0, 1.0, 2.0, 3.0, 4.0, 5.0], [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]]


# ---------------------------------------------------------------------------
# Processes started by the tests above (not collected by pytest).
# ---------------------------------------------------------------------------


def _init_default_group(rank: int, world_size: int, port: int) -> None:
    """The process's own default gloo group, its store bound to 127.0.0.1 only."""
    import torch.distributed as dist

    listen_fd = None
    if rank == 0:
        listen = socket.socket()
        listen.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listen.bind((HOST, port))
        listen.listen(16)
        listen_fd = listen.detach()  # TCPStore takes it over
    store = dist.TCPStore(
        HOST, port, world_size, is_master=rank == 0, timeout=timedelta(seconds=60),
        wait_for_workers=False, master_listen_fd=listen_fd,
    )  # fmt: skip
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)


def _train_step(model, optimizer, rank: int, step: int) -> None:
    """One data-parallel step: each rank its own batch, gradients averaged over the default group."""
    import torch
    import torch.distributed as dist

    gen = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(3, model.config.vocab_size, (4, 24), generator=gen)
    loss = model(input_ids=ids, labels=ids).loss
    optimizer.zero_grad()
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
        p.grad /= dist.get_world_size()
    optimizer.step()


def _logprobs(model, prompt: list[int], output: list[int]) -> list[float]:
    import torch

    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor([prompt + output])).logits[0], dim=-1)
    return [logp[len(prompt) + t - 1, tok].item() for t, tok in enumerate(output)]


async def _sync_and_check(model, previous, broadcaster, client, version: int) -> dict:
    from relax_core.rollout.client import parse_generate_output

    stats = await broadcaster.broadcast(model.state_dict().items(), version=version)
    print(f"synced: {stats}", flush=True)
    prompt = [5, 6, 7, 8]
    raw = await client.generate(prompt, sampling_params={"max_new_tokens": 24, "temperature": 0, "ignore_eos": True})
    out = parse_generate_output(raw)
    trainer = _logprobs(model, prompt, out.output_ids)
    before = _logprobs(previous, prompt, out.output_ids)
    return {
        "version": version,
        "num_buckets": stats.num_buckets,
        "reported_version": await client.get_weight_version(),
        "meta_version": out.weight_version,
        "max_diff_to_trainer": max(abs(a - b) for a, b in zip(out.logprobs, trainer)),
        "max_diff_to_previous": max(abs(a - b) for a, b in zip(out.logprobs, before)),
    }


async def _sync_while_generating(model, previous, broadcaster, client, version: int) -> dict:
    """The asynchronous modes' sync: the weights arrive while a long request generates (the engine is paused
    with SGLang's retract, loads them, and continues the request from its tokens)."""
    from relax_core.rollout.client import parse_generate_output

    prompt = [5, 6, 7, 8]
    params = {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True}
    request = asyncio.ensure_future(client.generate(prompt, sampling_params=params, return_logprob=True))
    start = (await client.get_model_info())["engine_stats"]["decode_steps"]
    while (await client.get_model_info())["engine_stats"]["decode_steps"] < start + 20:
        await asyncio.sleep(0.01)
    stats = await broadcaster.broadcast(model.state_dict().items(), version=version, while_generating=True)
    out = parse_generate_output(await asyncio.wait_for(request, 120))
    new, old = _logprobs(model, prompt, out.output_ids), _logprobs(previous, prompt, out.output_ids)
    # the tokens before the update are the old weights', every token after it the new weights' (its cache
    # computed again from the prompt and the tokens so far: no key or value of the old weights is left)
    split = next(t for t in range(len(new)) if abs(out.logprobs[t] - old[t]) > 1e-4)
    return {
        "version": version, "num_buckets": stats.num_buckets, "reported_version": await client.get_weight_version(),
        "meta_version": out.weight_version, "tokens": len(out.output_ids), "split": split,
        "token_versions": out.token_versions,
        "max_diff_before": max(abs(a - b) for a, b in zip(out.logprobs[:split], old[:split])),
        "max_diff_after": max(abs(a - b) for a, b in zip(out.logprobs[split:], new[split:])),
        "finish_reason": out.finish_reason,
    }


async def _rank0_syncs(args, model, previous, train) -> list[dict]:
    from relax_core.rollout.client import EngineClient
    from relax_core.weights.sync import WeightBroadcaster

    async with EngineClient(args.engine, api_key=API_KEY) as client:
        while not await client.health():
            await asyncio.sleep(0.2)
        broadcaster = WeightBroadcaster(
            [client], HOST, args.master_ports[0], group_name="relax_weights", backend="gloo", bucket_bytes=BUCKET_BYTES
        )
        await broadcaster.init()
        syncs = [await _sync_and_check(model, previous, broadcaster, client, version=3)]
        previous.load_state_dict(model.state_dict())
        train(step=2)
        # Elastic path: the group is torn down and re-created (same engine here).
        await broadcaster.set_engines([client], master_port=args.master_ports[1])
        syncs.append(await _sync_and_check(model, previous, broadcaster, client, version=4))
        previous.load_state_dict(model.state_dict())
        train(step=3)
        syncs.append(await _sync_while_generating(model, previous, broadcaster, client, version=5))
        await broadcaster.close()
        assert client._session is None  # the broadcaster closed its client: no connection left open
    return syncs


def trainer_main(args) -> None:
    import copy

    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    print(f"trainer {args.rank} imported torch+transformers", flush=True)
    _init_default_group(args.rank, 2, args.dist_port)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    previous = copy.deepcopy(model).eval()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def train(step: int) -> None:
        model.train()
        _train_step(model, optimizer, args.rank, step)
        model.eval()
        dist.barrier()

    train(step=1)
    syncs = asyncio.run(_rank0_syncs(args, model, previous, train)) if args.rank == 0 else None
    if args.rank == 1:
        train(step=2)  # rank 1 takes part in the DP steps rank 0 runs between syncs
        train(step=3)
    total = torch.tensor([float(args.rank + 1)])
    dist.all_reduce(total)
    if args.rank == 0:
        Path(args.out).write_text(json.dumps({"syncs": syncs, "default_group_sum": total.item()}))
    leave_group()


def peer_main(args) -> None:
    """Rank 0 sends, rank 1 receives, each with its own default group; twice."""
    import torch
    import torch.distributed as dist

    from relax_core.rollout.weight_group import destroy_weight_update_group, init_weight_update_group

    _init_default_group(0, 1, args.dist_port)
    received = []
    for round_, port in enumerate(args.master_ports, start=1):
        group = init_weight_update_group(HOST, port, args.rank, 2, "relax_weights", "gloo")
        tensor = torch.arange(6.0) * round_ if args.rank == 0 else torch.zeros(6)
        dist.broadcast(tensor, src=0, group=group)
        received.append(tensor.tolist())
        dist.all_reduce(torch.ones(1))  # the default group is unaffected
        destroy_weight_update_group(group)
    if args.rank == 1:
        Path(args.out).write_text(json.dumps(received))
    leave_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["trainer", "peer"])
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--dist-port", type=int, required=True)
    parser.add_argument("--master-ports", type=int, nargs=2, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--model")
    parser.add_argument("--engine")
    cli = parser.parse_args()
    (trainer_main if cli.role == "trainer" else peer_main)(cli)
