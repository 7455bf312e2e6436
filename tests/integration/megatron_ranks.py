"""The trainer ranks of the Megatron backend's tests: `python megatron_ranks.py ROLE ARGS_JSON`.

The test starts `world` such processes (`run_ranks`: one per rank, each killed by its
PID when another fails or the time is up; a gloo group whose
store rank 0 hosts on 127.0.0.1), each runs ROLE as one rank, and rank 0 writes what
the test asserts on to `out` (JSON, or a torch file for tensors). It is not collected.

Roles:
- logits: load the HF model into Megatron with the given layout; logits on a fixed padded batch against
  the HF model's, and the gathered HF tensors against the safetensors file;
- step: one training step on `SAMPLES` (rank r gets its world-rank shard, as the controller hands them);
  metrics, the gathered HF tensors, how often layer 0 ran forward;
- placed: a step, log-probs, logits and the gathered weights with the trainer on a device (the simulated
  accelerator of `tests/sim_device.py`, or the CPU to compare with);
- contract: save a step, then what Megatron-LM and TE need of loading it (optimizer state keys, RNG tracker);
- save / resume: train, save a Megatron checkpoint / load it (maybe with another layout) and train on;
- sync: one step, then the weights broadcast to a CPU engine; the engine's log-probs against the trainer's.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

from gloo_exit import leave_group

HOST = "127.0.0.1"


def samples(n: int = 8, vocab: int = 19, seed: int = 0):
    """Rows with prompts and responses of different lengths, two GRPO groups of 4 with mixed rewards."""
    from relax_core.data.sample import Sample

    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randrange(2, 5))]
        response = [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 6))]
        out.append(Sample(prompt_ids=prompt, response_ids=response, rollout_logprobs=[-1.0] * len(response),
                          loss_mask=[1] * len(response), reward=float(i % 3 == 0), group_id=i // 4))
    return out


def trainer_config(args: dict):
    from relax_core.train.config import TorchTrainerConfig

    extra = {"critic_lr": 1e-3, "critic_value_clip": 0.2} if args.get("critic") else {}
    if args.get("kl"):  # a KL loss against the reference model
        extra |= {"use_kl_loss": True, "kl_coef": args["kl"]}
    return TorchTrainerConfig(lr=args.get("lr", 1e-3), micro_batch_size=3, num_threads=1,
                              algorithm=args.get("algorithm", "grpo"), num_mini_batches=args.get("minis", 1),
                              recompute_activations=bool(args.get("recompute")), dtype=args.get("dtype", "float32"),
                              device=args.get("device", "cpu"), weight_decay=args.get("weight_decay", 0.0),
                              max_tokens_per_micro_batch=args.get("max_tokens"), **extra)


def build(args: dict, layout: dict | None = None):
    from relax_core.train.megatron.model import Parallel
    from relax_core.train.megatron.trainer import MegatronTrainer

    layout = dict(layout if layout is not None else args.get("parallel", {}))
    distopt = layout.pop("distopt", False)
    return MegatronTrainer(args["model"], trainer_config(args), Parallel(**layout), distributed_optimizer=distopt)


def my_shard(rows, rank: int, world: int):
    return rows[rank * len(rows) // world: (rank + 1) * len(rows) // world]


def role_logits(rank: int, world: int, args: dict) -> None:
    import torch
    from safetensors.torch import load_file

    trainer = build(args)
    ids = torch.tensor([[3, 4, 5, 6, 7, 8, 9], [5, 6, 7, 3, 10, 0, 0]])
    mask = torch.tensor([[1] * 7, [1] * 5 + [0] * 2])
    logits = trainer.logits(ids, mask)
    weights = dict(trainer.named_parameters_for_sync())
    if rank == 0:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(args["model"], dtype=torch.float32).eval()
        with torch.no_grad():
            ref = hf(input_ids=ids, attention_mask=mask).logits
        saved = load_file(Path(args["model"]) / "model.safetensors")
        result = {"max_diff": (logits - ref)[mask.bool()].abs().max().item(),
                  "names_equal": sorted(saved) == sorted(weights),
                  "weights_exact": all(torch.equal(saved[k], weights[k]) for k in saved if k in weights)}
        Path(args["out"]).write_text(json.dumps(result))


def role_step(rank: int, world: int, args: dict) -> None:
    import torch

    trainer = build(args)
    calls = [0]
    layer = trainer.module.decoder.layers[0] if hasattr(trainer.module, "decoder") else None
    thd = [0]  # attention calls on a packed row (megatron-core's THD layout)
    if layer is not None:
        layer.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
        layer.self_attention.core_attention.register_forward_pre_hook(
            lambda _m, _a, kw: thd.__setitem__(0, thd[0] + (kw.get("packed_seq_params") is not None)),
            with_kwargs=True)
    metrics = [trainer.train_step(my_shard(samples(), rank, world)) for _ in range(args.get("steps", 1))]
    weights = dict(trainer.named_parameters_for_sync())
    if rank == 0:
        torch.save({"metrics": metrics, "weights": weights, "layer_calls": calls[0], "thd_calls": thd[0]},
                   args["out"])


def role_placed(rank: int, world: int, args: dict) -> None:
    """The trainer on `args["device"]`; with "meta", in `tests/sim_device.py`'s simulated accelerator (every
    op and collective refuses CPU tensors beside the accelerator's): the weights gathered before a step,
    a step's metrics, log-probs, logits and the weights after it, all on the host."""
    import contextlib

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from sim_device import SimDevice

    rows = my_shard(samples(), rank, world)
    ids = torch.tensor([[3, 4, 5, 6, 7, 8, 9], [5, 6, 7, 3, 10, 0, 0]])
    mask = torch.tensor([[1] * 7, [1] * 5 + [0] * 2])
    from torch.nn.attention import SDPBackend, sdpa_kernel

    placed = SimDevice(accelerator_collectives=True) if args["device"] == "meta" else contextlib.nullcontext()
    # SDPA on the simulated device (`meta`) has only its math kernel; the CPU run takes the same, so the two
    # runs compare bit for bit (which kernel runs is not what this role checks: where each tensor is).
    with placed, sdpa_kernel(SDPBackend.MATH):
        trainer = build(args)
        before = {name: t.to("cpu", copy=True) for name, t in trainer.named_parameters_for_sync()}
        metrics = trainer.train_step(rows)
        logprobs = trainer.compute_logprobs(rows)
        logits = trainer.logits(ids, mask).cpu()
        after = {name: t.cpu() for name, t in trainer.named_parameters_for_sync()}
        dtypes = sorted({str(p.dtype) for p in trainer.module.parameters()})
        groups = [(group["weight_decay"], sorted({p.dim() for p in group["params"]}))
                  for group in trainer.optimizer.param_groups if group["params"]]
        masters = sorted({str(p.dtype) for group in trainer.optimizer.param_groups for p in group["params"]})
    if rank == 0:
        torch.save({"before": before, "metrics": metrics, "logprobs": logprobs, "logits": logits, "after": after,
                    "dtypes": dtypes, "groups": groups, "masters": masters}, args["out"])


def role_contract(rank: int, world: int, args: dict) -> None:
    """What Megatron-LM and Transformer Engine need of a checkpoint: a step saved; then a fresh trainer's
    loading template (its optimizer's state keys), and after loading, the RNG tracker's named states and a
    `fork()` of its model-parallel state (Megatron-LM's first use of it after a load)."""
    from megatron.core import tensor_parallel

    from relax_core.checkpoint import megatron as megatron_ckpt

    trainer = build(args)
    trainer.train_step(my_shard(samples(), rank, world))
    megatron_ckpt.save(args["ckpt"], 1, trainer, {"step": 1}, hf_dir=args["model"])
    fresh = build(args)
    fresh.sharded_state_dict(loading=True)
    chained = getattr(fresh.optimizer, "chained_optimizers", [fresh.optimizer])
    keys = sorted({key for opt in chained for state in opt.optimizer.state.values()
                   for key in state})
    megatron_ckpt.load(args["ckpt"], fresh)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    with tracker.fork():
        pass
    if rank == 0:
        Path(args["out"]).write_text(json.dumps({"template_state_keys": keys,
                                                 "tracker_states": sorted(tracker.get_states())}))


def role_save(rank: int, world: int, args: dict) -> None:
    import torch

    from relax_core.checkpoint import megatron as megatron_ckpt

    trainer = build(args)
    for _ in range(2):
        trainer.train_step(my_shard(samples(), rank, world))
    megatron_ckpt.save(args["ckpt"], 2, trainer, {"step": 2, "data": {"cursor": 16}}, hf_dir=args["model"])
    then = trainer.train_step(my_shard(samples(seed=1), rank, world))
    weights = dict(trainer.named_parameters_for_sync())
    if rank == 0:
        torch.save({"then": then, "weights": weights}, args["out"])


def role_resume(rank: int, world: int, args: dict) -> None:
    import torch

    from relax_core.checkpoint import megatron as megatron_ckpt

    trainer = build(args)
    progress = megatron_ckpt.load(args["ckpt"], trainer)
    then = trainer.train_step(my_shard(samples(seed=1), rank, world))
    weights = dict(trainer.named_parameters_for_sync())
    if rank == 0:
        torch.save({"then": then, "weights": weights, "progress": progress, "step": trainer.step}, args["out"])


def role_sync(rank: int, world: int, args: dict) -> None:
    import asyncio

    from relax_core.rollout.client import EngineClient, parse_generate_output
    from relax_core.weights.sync import WeightBroadcaster

    trainer = build(args)
    trainer.train_step(my_shard(samples(), rank, world))
    named = list(trainer.named_parameters_for_sync())  # every rank gathers, in step
    prompt = [5, 6, 7, 8]

    async def sync_and_generate():
        async with EngineClient(args["engine"], api_key=args["key"]) as client:
            broadcaster = WeightBroadcaster([client], HOST, args["weights_port"], group_name="relax_weights",
                                            backend="gloo", bucket_bytes=16 << 10)
            await broadcaster.init()
            stats = await broadcaster.broadcast(named, version=1)
            await broadcaster.close()
            raw = await client.generate(prompt, sampling_params={"max_new_tokens": 12, "temperature": 0,
                                                                 "ignore_eos": True})
            return stats, parse_generate_output(raw), await client.get_weight_version()

    result = asyncio.run(sync_and_generate()) if rank == 0 else None
    import torch.distributed as dist

    holder = [None if result is None else result[1].output_ids]
    dist.broadcast_object_list(holder, src=0)
    from relax_core.data.sample import Sample

    output = holder[0]
    row = Sample(prompt_ids=prompt, response_ids=output, rollout_logprobs=[0.0] * len(output),
                 loss_mask=[1] * len(output))
    mine = trainer.compute_logprobs([row] if rank == 0 else [])  # TP ranks pool their rows
    if rank == 0:
        stats, out, version = result
        diff = max(abs(a - b) for a, b in zip(out.logprobs, mine[0]))
        Path(args["out"]).write_text(json.dumps({"max_diff": diff, "buckets": stats.num_buckets,
                                                 "version": version, "tokens": len(output)}))


def ranks(role: str, tmp: Path, world: int, **args) -> Path:
    """Run `role` on `world` ranks (the tests' entry point); the file rank 0 wrote its result to."""
    from engine_fixtures import free_port, subprocess_env

    out = tmp / f"{role}-{len(list(tmp.iterdir()))}.out"
    code, log = run_ranks(role, {"world": world, "out": str(out), **args}, free_port(), subprocess_env())
    assert code == 0, log[-8000:]
    return out


def run_ranks(role: str, args: dict, port: int, env: dict, timeout_s: float = 600) -> tuple[int, str]:
    """Start the ranks, wait for all; (the first non-zero exit code or 0, the ranks' output, a file: no pipe
    a hung rank could hold open). A failed rank or the timeout ends every rank, by PID."""
    log = Path(args["out"]).with_suffix(".log")
    with open(log, "w") as out:
        procs = [subprocess.Popen([sys.executable, __file__, role, json.dumps(args), str(r), str(port)], stdout=out,
                                  stderr=subprocess.STDOUT, env=env, start_new_session=True)
                 for r in range(args["world"])]
        deadline, code = time.monotonic() + timeout_s, 0
        try:
            while any(p.poll() is None for p in procs):
                failed = [p.returncode for p in procs if p.returncode not in (None, 0)]
                if failed or time.monotonic() > deadline:
                    code = failed[0] if failed else -1
                    break
                time.sleep(0.2)
            else:
                code = next((p.returncode for p in procs if p.returncode), 0)
        finally:
            for p in procs:  # a rank starts no process of its own: its PID is all there is to stop
                if p.poll() is None:
                    p.send_signal(signal.SIGKILL)
                p.wait()
    return code, log.read_text()


def role_offload(rank: int, world: int, args: dict) -> None:
    """Colocate's hand-back on the Megatron backend (bf16: megatron-core's flat buffers and fp32 master weights;
    PPO's critic; a reference for the KL): what each part holds after each offload, and the steps of a trainer
    that handed everything back between them against those of one that never did."""
    import torch

    from relax_core.train.offload import megatron_grad_buffers, megatron_optimizer_tensors, module_tensors

    def held(trainer) -> dict:
        def nbytes(tensors):
            return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())

        return {"policy": nbytes(module_tensors(trainer.module)), "grads": nbytes(megatron_grad_buffers(trainer.ddp)),
                "optimizer": nbytes(megatron_optimizer_tensors(trainer.optimizer)),
                "reference": nbytes(module_tensors(trainer.ref_model)),
                "critic": nbytes(module_tensors(trainer.critic.module) + megatron_grad_buffers(trainer.critic.ddp)
                                 + megatron_optimizer_tensors(trainer.critic.optimizer))}

    kept, moved = build(args), build(args)
    expected = [kept.train_step(my_shard(samples(seed=s), rank, world)) for s in (0, 1)]
    got = [moved.train_step(my_shard(samples(seed=0), rank, world))]
    before = held(moved)
    moved.offload(["optimizer"])
    after_optimizer = held(moved)
    moved.offload(["model"])
    after_model = held(moved)
    moved.reload()
    got.append(moved.train_step(my_shard(samples(seed=1), rank, world)))
    weights = {n: t.clone() for n, t in moved.named_parameters_for_sync()}
    reference = dict(kept.named_parameters_for_sync())
    if rank == 0:
        torch.save({"before": before, "after_optimizer": after_optimizer, "after_model": after_model,
                    "got": got, "expected": expected,
                    "weights_equal": all(torch.equal(weights[n], reference[n]) for n in reference)}, args["out"])


ROLES = {"logits": role_logits, "step": role_step, "placed": role_placed, "contract": role_contract,
         "save": role_save, "resume": role_resume, "sync": role_sync, "offload": role_offload}


def _rank(rank: int, world: int, port: int, role: str, args: dict) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore(HOST, port, world, is_master=rank == 0, timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    ROLES[role](rank, world, args)
    leave_group()  # Megatron's dozens of gloo groups: their teardown can block or abort once a peer is gone


def main() -> None:
    """`megatron_ranks.py ROLE ARGS_JSON RANK PORT`: one rank (the test starts `world` of them)."""
    role, args, rank, port = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    _rank(rank, args["world"], port, role, args)


if __name__ == "__main__":
    main()
