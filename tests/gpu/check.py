"""The GPU gate: the GPU path at real shapes on one CUDA GPU, every part strict (at most 8 minutes).

The GPU test machine has torch with CUDA and transformers, but no Ray, no SGLang and no network, so
this runs the parts of a real job that need only torch, each in a process of its own (a part's GPU
memory, NCCL groups and megatron-core state end with it):

    model     a Qwen3-1.7B-shaped model (28 layers, hidden 2048, vocabulary 151,936) with random bf16
              weights, written as an HF directory
    fsdp      one train step each of GRPO, DAPO and PPO (with its critic) through `TorchTrainer.train_step`,
              configured from the shipped FSDP recipe (FSDP2 on one rank, float32 master weights computed in
              bf16, recomputation, packed micro-batches, two updates per step), on 8k-token responses;
              then colocate's hand-back: the trainer offloads, its reserved memory is measured, a second
              process allocates what was freed, the trainer reloads and trains again
    megatron  the same three steps through `MegatronTrainer.train_step` (the shipped Megatron recipe, TP 1)
    parity    the Megatron backend against the torch backend on a tiny model in float32 (loss, log-probs,
              updated weights, the HF round trip), and a bfloat16 step that stays finite
    checkpoint a tiny bf16 Megatron PPO run saved and resumed on the device (bit for bit, the critic and the
              RNG tracker's states with it), exported to HF and verified there (`convert-ckpt --verify`)
    ipc       colocate's hand-over: the model's tensors serialized as the trainer serializes them for
              SGLang's `update_weights_from_tensor` (weights/ipc.py), opened in a second process that checks
              every byte
    weights   the weight-update group: rank 0 as the trainer makes it, rank 1 as SGLang's
              `init_custom_process_group` makes it (SGLang's own function where it imports, else the copy
              pinned to its source in tests/sglang_real.py), then the model's tensors broadcast in buckets;
              NCCL between two processes on the one GPU, or gloo where NCCL refuses that

    python3 tests/gpu/check.py [--only fsdp,megatron,...] [--out DIR] [--device cuda|cpu]

Each part prints its figures as it ends; the last line is one JSON object of all of them (tokens/s,
peak memory, seconds per part). A part whose checks fail lists them under "failed", and then the check
exits 1 (a part that raises fails the same way). `--device cpu` runs every code path on a small model
and short responses, for a machine without a GPU (its figures mean nothing).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
PARTS = ("fsdp", "megatron", "parity", "checkpoint", "ipc", "weights")
FSDP_RECIPE = ROOT / "recipes" / "math_dapo_qwen3_4b_fsdp.yaml"
MEGATRON_RECIPE = ROOT / "recipes" / "math_dapo_qwen3_4b.yaml"
ALGORITHMS = ("grpo", "dapo", "ppo")
# Qwen3-1.7B's shape (untied embeddings, as Qwen3-4B's are not: the heavier case).
SHAPE = {"hidden_size": 2048, "num_layers": 28, "num_heads": 16, "num_kv_heads": 8, "intermediate_size": 6144,
         "vocab_size": 151936}
LENGTHS = {"prompt": 256, "response": 8192, "samples": 2}  # one group of 2: GRPO's advantages are not 0
PART_TIMEOUT_S = {"fsdp": 240, "megatron": 240, "parity": 150, "checkpoint": 120, "ipc": 90, "weights": 90}
CPU_SHAPE = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 128,
             "vocab_size": 1024}
CPU_LENGTHS = {"prompt": 8, "response": 48, "samples": 2}


# ---------------------------------------------------------------- shared
class Checks:
    """What a part asserts: each failed check is a line under "failed" (and fails the whole check)."""

    def __init__(self) -> None:
        self.failed: list[str] = []

    def at_most(self, name: str, value: float, limit: float) -> None:
        if not value <= limit:  # NaN fails too
            self.failed.append(f"{name}: {value:.4g} > {limit:g}")

    def true(self, name: str, ok: bool, detail: str = "") -> None:
        if not ok:
            self.failed.append(f"{name}{': ' + detail if detail else ''}")

    def finite(self, name: str, metrics: dict) -> None:
        bad = {k: v for k, v in metrics.items() if isinstance(v, float) and not math.isfinite(v)}
        self.true(f"{name}: finite metrics", not bad, str(bad)[:200])


def sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def peak_gib(device: str) -> float | None:
    import torch

    return round(torch.cuda.max_memory_allocated() / 2**30, 2) if device == "cuda" else None


def write_model(folder: Path, shape: dict, device: str) -> dict:
    """A Qwen3 HF directory of `shape` with random bf16 weights (N(0, 0.02), norms 1), written with safetensors."""
    import torch
    from safetensors.torch import save_file

    from relax_core.models.tiny import qwen3_config_dict, qwen3_shapes

    folder.mkdir(parents=True, exist_ok=True)
    config = qwen3_config_dict(shape["vocab_size"], hidden_size=shape["hidden_size"], num_layers=shape["num_layers"],
                               num_heads=shape["num_heads"], num_kv_heads=shape["num_kv_heads"],
                               intermediate_size=shape["intermediate_size"], max_position_embeddings=40960,
                               eos_token_id=2, pad_token_id=0)
    config["dtype"] = "bfloat16"
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    gen = torch.Generator(device=device).manual_seed(0)
    tensors = {}
    for name, dims in qwen3_shapes(config).items():
        if len(dims) == 1:
            tensors[name] = torch.ones(dims, dtype=torch.bfloat16)
        else:
            t = torch.empty(dims, dtype=torch.bfloat16, device=device).normal_(0.0, 0.02, generator=gen)
            tensors[name] = t.cpu()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return {"params": sum(t.numel() for t in tensors.values()), "bytes": sum(t.numel() * 2 for t in tensors.values())}


def samples(lengths: dict, vocab: int, seed: int = 0):
    """One group of `samples` rows of random tokens with different rewards; engine log-probs a little off."""
    import torch

    from relax_core.data.sample import Sample

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(lengths["samples"]):
        ids = torch.randint(3, vocab, (lengths["prompt"] + lengths["response"],), generator=g).tolist()
        r = lengths["response"]
        out.append(Sample(ids[:lengths["prompt"]], ids[lengths["prompt"]:], [-12.0] * r, loss_mask=[1] * r,
                          reward=float(i % 2), group_id=0, sample_id=i))
    return out


def recipe_config(path: Path, algorithm: str, device: str, overrides: tuple[str, ...] = ()):
    """The trainer settings `relax submit` gives the recipe (its `algorithm` section replaced by `algorithm`'s
    defaults unless it is the recipe's own), with 2 samples a step in 2 mini-batches (as the recipe's 256 are
    in 2 of 128: two updates, so the ratio leaves 1)."""
    import dataclasses

    from relax_core.config.loader import parse_override, read_recipe_file, set_dotted
    from relax_core.config.schema import Recipe
    from relax_core.train.settings import trainer_config

    raw, _ = read_recipe_file(path)
    if raw["algorithm"]["name"] != algorithm:
        raw["algorithm"] = {"name": algorithm}
    elif algorithm == "ppo":  # the policy trains from the first step (its warmup would train the critic alone)
        raw["algorithm"]["critic"]["warmup_steps"] = 0
    one_gpu = ("cluster.train.gpus_per_node=1", "rollout.num_engines=1", "rollout.gpus_per_engine=1")
    for item in ("rollout.prompts_per_step=1", "rollout.n_samples_per_prompt=2", "train.global_batch_size=1",
                 "train.micro_batch_size=1", *one_gpu, *overrides):
        set_dotted(raw, *parse_override(item))
    return dataclasses.replace(trainer_config(Recipe.model_validate(raw)), device=device, num_threads=None)


def timed_step(trainer, batch, device: str) -> tuple[dict, float]:
    sync(device)
    start = time.perf_counter()
    metrics = trainer.train_step(batch)
    sync(device)
    return metrics, round(time.perf_counter() - start, 3)


def step_figures(metrics: dict, seconds: float, batch, device: str) -> dict:
    tokens = sum(len(s.prompt_ids) + s.response_len for s in batch)
    keep = ("loss", "pg_loss", "grad_norm", "ratio_max", "optimizer_steps", "value_loss", "logp_old_version")
    return {"step_s": seconds, "tokens_per_s": round(tokens / seconds), "peak_gib": peak_gib(device),
            **{k: metrics[k] for k in keep if k in metrics}}


def check_step(checks: Checks, name: str, metrics: dict, algorithm: str) -> None:
    checks.finite(name, metrics)
    checks.true(f"{name}: two updates", metrics.get("optimizer_steps") == 2, str(metrics.get("optimizer_steps")))
    if algorithm == "ppo":
        checks.true(f"{name}: the critic trained", "value_loss" in metrics and metrics["value_loss"] > 0)


# ------------------------------------------------------------------ fsdp
def part_fsdp(ctx: dict) -> dict:
    from relax_core.train.torch_backend import TorchTrainer

    checks = Checks()

    def build(algorithm: str):
        config = recipe_config(FSDP_RECIPE, algorithm, ctx["device"], ctx["fsdp_overrides"])
        checks.true("fsdp: the recipe shards and recomputes", config.fsdp and config.recompute_activations)
        return TorchTrainer(ctx["model_dir"], config)

    result, trainer, batch = steps_of("fsdp", build, ctx, checks)
    result["handback"] = handback(trainer, batch, ctx["device"], checks)  # PPO's: policy, critic, optimizers
    result["failed"] = checks.failed
    return result


def steps_of(backend: str, build, ctx: dict, checks: Checks):
    """One train step of each algorithm, each trainer built (`build(algorithm)`) after the last one is gone:
    the figures, the last trainer (PPO's) and the batch."""
    import gc

    import torch

    device, result, trainer = ctx["device"], {}, None
    batch = samples(ctx["lengths"], ctx["shape"]["vocab_size"])
    for algorithm in ALGORITHMS:
        del trainer
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        trainer = build(algorithm)
        load_s = round(time.perf_counter() - start, 2)
        metrics, seconds = timed_step(trainer, batch, device)
        result[algorithm] = {"load_s": load_s, **step_figures(metrics, seconds, batch, device)}
        check_step(checks, f"{backend} {algorithm}", metrics, algorithm)
    return result, trainer, batch


def handback(trainer, batch, device: str, checks: Checks) -> dict:
    """Colocate's hand-back: offload, what stays reserved, a second process allocating what was freed, reload."""
    import torch
    import torch.multiprocessing as mp

    if device != "cuda":
        trainer.offload(["optimizer", "model"])
        trainer.reload()
        metrics, _ = timed_step(trainer, batch, device)
        checks.finite("handback: a step after reload", metrics)
        return {"note": "no GPU: offload and reload ran, nothing to measure"}
    held = torch.cuda.memory_reserved()
    start = time.perf_counter()
    trainer.offload(["optimizer"])
    trainer.offload(["model"])
    offload_s = time.perf_counter() - start
    left = torch.cuda.memory_reserved()
    freed = held - left
    want = int(freed * 0.95)
    out = tempfile.mktemp()
    proc = mp.get_context("spawn").Process(target=_allocate, args=(want, out))
    proc.start()
    proc.join(120)
    took = json.loads(Path(out).read_text()) if Path(out).exists() else {"ok": False, "error": "no answer"}
    start = time.perf_counter()
    trainer.reload()
    reload_s = time.perf_counter() - start
    metrics, seconds = timed_step(trainer, batch, device)
    figures = {"reserved_before_gib": round(held / 2**30, 2), "reserved_after_gib": round(left / 2**30, 3),
               "offload_s": round(offload_s, 2), "reload_s": round(reload_s, 2), "second_process": took,
               "step_after_reload_s": seconds}
    checks.at_most("handback: reserved after offload (GiB)", left / 2**30, 1.0)
    checks.true("handback: a second process allocated what was freed", took.get("ok", False), str(took)[:200])
    checks.finite("handback: a step after reload", metrics)
    return figures


def _allocate(nbytes: int, out: str) -> None:
    import torch

    try:
        block = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        block.fill_(1)
        torch.cuda.synchronize()
        Path(out).write_text(json.dumps({"ok": True, "gib": round(nbytes / 2**30, 2)}))
    except Exception as exc:
        Path(out).write_text(json.dumps({"ok": False, "gib": round(nbytes / 2**30, 2), "error": str(exc)[:300]}))


# -------------------------------------------------------------- megatron
def part_megatron(ctx: dict) -> dict:
    from relax_core.config.loader import load_recipe
    from relax_core.train.megatron.trainer import MegatronTrainer, ensure_world
    from relax_core.train.settings import megatron_options

    checks = Checks()
    options = megatron_options(load_recipe(MEGATRON_RECIPE, ["train.tensor_parallel=1", "cluster.train.gpus_per_node=1",
                                                             "rollout.num_engines=1", "rollout.gpus_per_engine=1"]))
    ensure_world(ctx["device"])

    def build(algorithm: str):
        config = recipe_config(MEGATRON_RECIPE, algorithm, ctx["device"], ("train.tensor_parallel=1",))
        trainer = MegatronTrainer(ctx["model_dir"], config, options.parallel,
                                  distributed_optimizer=options.distributed_optimizer)
        dtypes = sorted({str(t.dtype) for _, t in trainer.named_parameters_for_sync()})
        checks.true(f"megatron {algorithm}: weights sent in bf16", dtypes == ["torch.bfloat16"], str(dtypes))
        return trainer

    result, _, _ = steps_of("megatron", build, ctx, checks)
    result["failed"] = checks.failed
    return result


# ---------------------------------------------------------------- parity
PARITY_MODEL = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2}
PARITY_LR = 1e-3
TOLERANCE = {"loss": 1e-5, "weights": 1e-4, "logprobs": 1e-4, "roundtrip": 0.0}


def parity_samples():
    """A fixed GRPO batch: 8 rows in 2 groups of 4, a reward in each group (so the advantages are not 0)."""
    import random

    from relax_core.data.sample import Sample

    rng = random.Random(0)
    out = []
    for i in range(8):
        p = [rng.randrange(3, 19) for _ in range(rng.randrange(2, 5))]
        r = [rng.randrange(3, 19) for _ in range(rng.randrange(1, 6))]
        out.append(Sample(prompt_ids=p, response_ids=r, rollout_logprobs=[-1.0] * len(r), loss_mask=[1] * len(r),
                          reward=float(i % 3 == 0), group_id=i // 4))
    return out


def _max_diff(a: dict, b: dict) -> float:
    return max((float((a[k].float() - b[k].float()).abs().max()) for k in a.keys() & b.keys()), default=math.inf)


def _hf_cpu(named) -> dict:
    """Float32 CPU copies (on CPU `.float().cpu()` alone would keep views of the live parameters)."""
    return {name: t.detach().float().cpu().clone() for name, t in named}


def part_parity(ctx: dict) -> dict:
    import torch
    from safetensors.torch import load_file

    from relax_core.models.tiny import materialize_tiny_model
    from relax_core.train.config import TorchTrainerConfig
    from relax_core.train.megatron import hf_weights
    from relax_core.train.megatron.model import Parallel
    from relax_core.train.megatron.trainer import MegatronTrainer, ensure_world
    from relax_core.train.torch_backend import TorchTrainer

    device, checks = ctx["device"], Checks()
    torch.set_float32_matmul_precision("highest")  # no TF32 on either side (torch's default; set, not assumed)
    model_dir = materialize_tiny_model(Path(tempfile.mkdtemp()) / "qwen3", seed=0, **PARITY_MODEL)
    batch, initial = parity_samples(), load_file(model_dir / "model.safetensors")

    def config(dtype: str):  # two epochs: the second update's ratio leaves 1
        return TorchTrainerConfig(device=device, dtype=dtype, lr=PARITY_LR, micro_batch_size=3, num_epochs=2,
                                  algorithm="grpo", seed=0)

    ref = TorchTrainer(model_dir, config("float32"))
    ref_logps = ref.compute_logprobs(batch)
    ref_metrics, _ = timed_step(ref, batch, device)
    ref_weights = _hf_cpu(ref.named_parameters_for_sync())
    del ref
    ensure_world(device)
    mg = MegatronTrainer(model_dir, config("float32"), Parallel(tp=1), distributed_optimizer=False)
    loaded = _hf_cpu(hf_weights.gather_hf(mg.module, mg.hf_config))
    mg_logps = mg.compute_logprobs(batch)
    mg_metrics, _ = timed_step(mg, batch, device)
    mg_weights = _hf_cpu(mg.named_parameters_for_sync())
    logp_diff = max(abs(a - b) for ra, rb in zip(ref_logps, mg_logps) for a, b in zip(ra, rb))
    result = {"loss_diff": abs(ref_metrics["loss"] - mg_metrics["loss"]), "logprob_max_diff": logp_diff,
              "weights_max_diff": _max_diff(mg_weights, ref_weights), "update_max": _max_diff(ref_weights, initial),
              "roundtrip_max_diff": _max_diff(loaded, initial)}
    checks.at_most("parity: fp32 loss", result["loss_diff"], TOLERANCE["loss"])
    checks.at_most("parity: fp32 log-probs", logp_diff, TOLERANCE["logprobs"])
    checks.at_most("parity: fp32 updated weights", result["weights_max_diff"], TOLERANCE["weights"])
    checks.at_most("parity: HF round trip", result["roundtrip_max_diff"], TOLERANCE["roundtrip"])
    checks.true("parity: the step moved the weights", result["update_max"] > 0)
    checks.true("parity: the same HF names", set(mg_weights) == set(ref_weights) == set(initial))
    del mg
    mg16 = MegatronTrainer(model_dir, config("bfloat16"), Parallel(tp=1), distributed_optimizer=False)
    bf16_metrics, _ = timed_step(mg16, batch, device)
    checks.finite("parity: bf16 step", bf16_metrics)
    result["bf16_loss"] = bf16_metrics["loss"]
    result["failed"] = checks.failed
    return result


# ------------------------------------------------------------ checkpoint
def part_checkpoint(ctx: dict) -> dict:
    """A bf16 Megatron PPO run on the device saved and resumed (the critic with it), exported and verified."""
    import torch
    from megatron.core import tensor_parallel

    from relax_core.checkpoint import megatron as megatron_ckpt
    from relax_core.checkpoint.convert import convert
    from relax_core.checkpoint.hf_verify import verify_export
    from relax_core.models.tiny import materialize_tiny_model
    from relax_core.train.config import TorchTrainerConfig
    from relax_core.train.megatron.model import Parallel
    from relax_core.train.megatron.trainer import MegatronTrainer, ensure_world

    device, checks, root = ctx["device"], Checks(), Path(tempfile.mkdtemp())
    model_dir = materialize_tiny_model(root / "qwen3", seed=0, **PARITY_MODEL)
    config = TorchTrainerConfig(device=device, dtype="bfloat16", lr=PARITY_LR, micro_batch_size=3, num_epochs=2,
                                algorithm="ppo", critic_lr=PARITY_LR, seed=0)
    ensure_world(device)
    batch = parity_samples()
    first = MegatronTrainer(model_dir, config, Parallel(tp=1))
    first.train_step(batch)
    megatron_ckpt.save(root / "ckpt", 1, first, {"step": 1}, hf_dir=model_dir)
    states = tensor_parallel.get_cuda_rng_tracker().get_states()
    then = first.train_step(batch)
    expected = {n: t.clone() for n, t in first.named_parameters_for_sync()}
    del first
    resumed = MegatronTrainer(model_dir, config, Parallel(tp=1))
    megatron_ckpt.load(root / "ckpt", resumed)
    again = resumed.train_step(batch)
    got = dict(resumed.named_parameters_for_sync())
    exact = all(torch.equal(got[n], expected[n]) for n in expected)
    checks.true("checkpoint: the resumed step is the uninterrupted one, bit for bit",
                exact and again["loss"] == then["loss"] and again["value_loss"] == then["value_loss"])
    checks.true("checkpoint: the RNG tracker's named states", len(states) == 3, str(sorted(states)))
    del resumed
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    convert(root / "ckpt", root / "hf")
    verified = verify_export(root / "ckpt", root / "hf")
    checks.true("checkpoint: verified on the device in bf16",
                verified["device"].startswith(device) and verified["dtype"] in ("bfloat16", "torch.bfloat16"),
                f"{verified['device']} {verified['dtype']}")
    checks.at_most("checkpoint: export logits", verified["max_abs_diff"], verified["atol"])
    return {"resumed_bit_exact": exact, "rng_states": sorted(states), "verify": verified,
            "verify_peak_gib": peak_gib(device), "failed": checks.failed}


# ------------------------------------------------------------------- ipc
def _ipc_open(payload: str, expected: list[float], out: str) -> None:
    import torch

    from relax_core.rollout.weight_wire import deserialize_named_tensors

    start = time.perf_counter()
    named = deserialize_named_tensors(payload)
    sums = [float(t.double().sum()) for _, t in named]
    devices = sorted({str(t.device) for _, t in named})
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    ok = len(sums) == len(expected) and all(a == b for a, b in zip(sums, expected))
    Path(out).write_text(json.dumps({"seconds": time.perf_counter() - start, "ok": ok, "devices": devices,
                                     "tensors": len(named)}))


def part_ipc(ctx: dict) -> dict:
    import torch
    import torch.multiprocessing as mp
    from safetensors.torch import load_file

    from relax_core.rollout.weight_wire import serialize_named_tensors

    device, checks = ctx["device"], Checks()
    named = [(k, v.to(device)) for k, v in load_file(ctx["model_dir"] / "model.safetensors").items()]
    expected = [float(t.double().sum()) for _, t in named]
    start = time.perf_counter()
    payload = serialize_named_tensors(named)[0]
    serialize_s = time.perf_counter() - start
    out = tempfile.mktemp()
    proc = mp.get_context("spawn").Process(target=_ipc_open, args=(payload, expected, out))
    proc.start()
    proc.join(120)
    got = json.loads(Path(out).read_text()) if Path(out).exists() else {"ok": False, "error": "no answer"}
    total = sum(t.numel() * t.element_size() for _, t in named)
    checks.true("ipc: every byte arrived", got.get("ok", False), str(got)[:200])
    checks.true("ipc: opened on the trainer's device", got.get("devices") == [f"{device}:0" if device == "cuda"
                                                                               else "cpu"], str(got.get("devices")))
    del torch
    return {"serialize_s": round(serialize_s, 4), "open_and_check_s": round(got.get("seconds", math.nan), 3),
            "payload_bytes": len(payload), "weights_bytes": total, "opened": got, "failed": checks.failed}


# --------------------------------------------------------------- weights
def _engine_rank(port: int, backend: str, device: str, shapes: list, out: str) -> None:
    """Rank 1 of the weight-update group, made the way SGLang's engine makes it."""
    import sglang_real
    import torch
    import torch.distributed as dist

    try:
        init_custom_process_group, how = sglang_real.load().init_custom_process_group, "sglang's own function"
    except Exception as exc:  # no SGLang on the GPU test machine
        init_custom_process_group = sglang_real.init_custom_process_group_pinned
        how = f"the copy pinned to SGLang's source (tests/sglang_real.py; SGLang: {type(exc).__name__})"
    group = init_custom_process_group(backend=backend, init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=1,
                                      group_name="weight_update_group")
    received = []
    for shape in shapes:
        t = torch.empty(shape, dtype=torch.bfloat16, device=device)
        dist.broadcast(t, src=0, group=group)
        received.append(float(t.double().sum()))
    sync(device)
    Path(out).write_text(json.dumps({"sums": received, "how": how}))


def part_weights(ctx: dict) -> dict:
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp
    from safetensors.torch import load_file

    from relax_core.cluster.ports import listening_socket
    from relax_core.rollout.weight_group import destroy_weight_update_group, init_weight_update_group

    device, checks, result = ctx["device"], Checks(), {}
    named = [(k, v.to(device)) for k, v in load_file(ctx["model_dir"] / "model.safetensors").items()]
    total = sum(t.numel() * t.element_size() for _, t in named)
    for backend in (("nccl", "gloo") if device == "cuda" else ("gloo",)):
        tensors = [t if backend == "nccl" else t.cpu() for _, t in named]
        sock = listening_socket("127.0.0.1", 0)
        port = sock.getsockname()[1]
        out = tempfile.mktemp()
        proc = mp.get_context("spawn").Process(target=_engine_rank, args=(
            port, backend, "cuda" if backend == "nccl" else "cpu", [list(t.shape) for t in tensors], out))
        proc.start()
        try:
            group = init_weight_update_group("127.0.0.1", port, 0, 2, "weight_update_group", backend,
                                             timedelta(seconds=60), sock)
            start = time.perf_counter()
            for t in tensors:
                dist.broadcast(t, src=0, group=group)
            sync(device)
            seconds = time.perf_counter() - start
            proc.join(120)
            got = json.loads(Path(out).read_text())
            ok = got["sums"] == [float(t.double().sum()) for t in tensors]
            result[backend] = {"seconds": round(seconds, 3), "gbytes_per_s": round(total / seconds / 1e9, 2),
                               "engine_side": got["how"], "ok": ok}
            destroy_weight_update_group(group)
        except Exception as exc:  # NCCL may refuse two ranks on one GPU: then gloo must do
            result[backend] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            if proc.is_alive():
                proc.terminate()
    good = [b for b, r in result.items() if r.get("ok")]
    checks.true("weights: a broadcast through the group SGLang's way arrived whole", bool(good), str(result)[:300])
    result["failed"] = checks.failed
    del torch
    return result


# ------------------------------------------------------------------ main
def _child(part: str, ctx: dict, out: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one machine, maybe no network: gloo over the loopback
    try:
        result = globals()[f"part_{part}"](ctx)
    except BaseException as exc:
        result = {"error": f"{type(exc).__name__}: {exc}"[:600], "trace": traceback.format_exc()[-3000:],
                  "failed": [f"raised {type(exc).__name__}"]}
    Path(out).write_text(json.dumps(result, default=str))


def run_part(part: str, ctx: dict) -> dict:
    """The part in a process of its own (its GPU memory, process groups and megatron-core state end with it)."""
    import torch.multiprocessing as mp

    out = tempfile.mktemp()
    proc = mp.get_context("spawn").Process(target=_child, args=(part, ctx, out))
    proc.start()
    proc.join(PART_TIMEOUT_S[part])
    if proc.is_alive():
        proc.terminate()
        proc.join(10)
        return {"error": f"timed out after {PART_TIMEOUT_S[part]} s", "failed": ["timed out"]}
    if not Path(out).exists():
        return {"error": f"the process ended with exit code {proc.exitcode} and no result",
                "failed": [f"exit code {proc.exitcode}"]}
    return json.loads(Path(out).read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(PARTS))
    parser.add_argument("--out", default=None, help="folder for the JSON result (check.json)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA GPU visible to torch: nothing to check here")
        return 1
    cpu = device == "cpu"
    shape, lengths = (CPU_SHAPE, CPU_LENGTHS) if cpu else (SHAPE, LENGTHS)
    # On CPU the recipe's token budget would pack the whole short batch into one micro-batch: keep two.
    overrides = ("train.max_tokens_per_gpu=64",) if cpu else ()
    info = {"gpu": torch.cuda.get_device_name(0) if not cpu else None, "torch": torch.__version__,
            "python": sys.version.split()[0], "shape": shape, "lengths": lengths}
    print(json.dumps(info), flush=True)
    start = time.perf_counter()
    model_dir = Path(tempfile.mkdtemp()) / "qwen3"
    results: dict = {"info": info, "model": write_model(model_dir, shape, device)}
    results["model"]["wall_s"] = round(time.perf_counter() - start, 2)
    print("model", json.dumps(results["model"]), flush=True)
    ctx = {"device": device, "model_dir": model_dir, "shape": shape, "lengths": lengths, "fsdp_overrides": overrides}
    for part in args.only.split(","):
        start = time.perf_counter()
        results[part] = run_part(part, ctx)
        results[part]["wall_s"] = round(time.perf_counter() - start, 2)
        print(part, json.dumps(results[part], default=str), flush=True)
    line = json.dumps(results, default=str)
    if args.out:
        Path(args.out, "check.json").write_text(line)
    print(line)
    failed = {part: r["failed"] for part, r in results.items() if isinstance(r, dict) and r.get("failed")}
    for part, reasons in failed.items():
        print(f"FAILED {part}: " + "; ".join(reasons), file=sys.stderr, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
