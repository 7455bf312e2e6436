"""What of the GPU path runs on a machine with one CUDA GPU, and its figures (at most 8 minutes).

The GPU test machine has torch with CUDA and transformers, but no Ray, no
SGLang and no network, so this runs the parts that need only torch, in
plain processes:

    trainer   one training step of the torch backend on CUDA: FSDP2 over one
              rank, bf16 compute on float32 master weights, activation
              recomputation, token-budget micro-batches; step time, peak
              memory, and the loss against the same step unsharded in float32
    nccl      the weight-sync transport: a bucketed broadcast of the model's
              tensors between two processes on the one GPU over NCCL (NCCL
              refuses two ranks on one device on some versions: then gloo
              between a GPU and a CPU process, and the line says so); GB/s
    ipc       colocate's hand-over: the trainer's CUDA tensors serialized as
              CUDA IPC handles (torch's multiprocessing reductions, the
              format SGLang's `update_weights_from_tensor` takes) and opened
              in a second process that checks every byte; seconds and GB/s
    engine    the CPU engine's batcher (relax_core/rollout/cpu_engine) run on
              the GPU: tokens/s of 64 requests x 64 new tokens

    python3 tests/gpu/check.py [--only trainer,nccl,ipc,engine] [--out DIR]

Each part prints its figures as it ends and the last line is one JSON object
of all of them (a part that failed carries its error, the others still run).
Without a GPU it says so and exits 1.
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
PARTS = ("trainer", "nccl", "ipc", "engine")
# A model large enough that the GPU, not Python, sets the pace, small enough to build in seconds.
MODEL = {"hidden_size": 1024, "num_layers": 8, "num_heads": 16, "num_kv_heads": 8}
LENGTHS = {"prompt": (32, 256), "response": (16, 512)}  # token ranges of the training samples
DEVICE = "cuda"  # --device cpu: a smoke run of the code paths on a machine without a GPU (no figures worth keeping)


def sync() -> None:
    import torch

    if DEVICE == "cuda":
        torch.cuda.synchronize()


def tiny_model(folder: Path) -> Path:
    from relax_core.models.tiny import materialize_tiny_model

    if not (folder / "config.json").exists():
        materialize_tiny_model(folder, seed=0, alphabet="abcdefghijklmnop", **MODEL)
    return folder


def samples(n: int, seed: int = 0):
    import torch

    from relax_core.rollout.types import Sample

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p = int(torch.randint(*LENGTHS["prompt"], (1,), generator=g))
        r = int(torch.randint(*LENGTHS["response"], (1,), generator=g))
        ids = torch.randint(3, 20, (p + r,), generator=g).tolist()
        out.append(Sample(ids[:p], ids[p:], [-1.0] * r, reward=float(torch.rand(1, generator=g)), group_id=i // 8))
    return out


# ------------------------------------------------------------------ trainer
def part_trainer(model_dir: Path) -> dict:
    import torch

    from relax_core.train.config import TorchTrainerConfig
    from relax_core.train.torch_backend import TorchTrainer

    batch = samples(64)
    common = {"lr": 1e-5, "micro_batch_size": 16, "num_epochs": 2}
    result = {}
    for name, extra in (("fsdp_bf16_recompute", {"fsdp": True, "dtype": "bfloat16", "recompute_activations": True,
                                                 "max_tokens_per_micro_batch": 8192}),
                        ("plain_fp32", {})):
        if DEVICE == "cuda":
            torch.cuda.reset_peak_memory_stats()
        trainer = TorchTrainer(model_dir, TorchTrainerConfig(device=DEVICE, **common, **extra))
        trainer.train_step(batch)  # warm-up (kernels, allocator)
        sync()
        start = time.perf_counter()
        metrics = trainer.train_step(batch)
        sync()
        seconds = time.perf_counter() - start
        tokens = sum(len(s.prompt_ids) + s.response_len for s in batch) * common["num_epochs"]
        result[name] = {"step_s": round(seconds, 4), "tokens_per_s": round(tokens / seconds),
                        "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3) if DEVICE == "cuda" else None,
                        "loss": metrics["loss"], "grad_norm": metrics["grad_norm"]}
        del trainer
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    result["loss_diff"] = abs(result["fsdp_bf16_recompute"]["loss"] - result["plain_fp32"]["loss"])
    return result


# ------------------------------------------------------------------ nccl
def _broadcast_rank(rank: int, port: int, backend: str, device: str, sizes: list[int], out: str) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        tensors = [torch.full((n,), float(rank == 0), dtype=torch.bfloat16, device=device) for n in sizes]
        for t in tensors[:2]:  # warm-up
            dist.broadcast(t, 0)
        if device == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        for t in tensors:
            dist.broadcast(t, 0)
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        ok = all(bool((t == 1).all()) for t in tensors)
        if rank == 1:
            Path(out).write_text(json.dumps({"seconds": seconds, "ok": ok}))
    finally:
        dist.destroy_process_group()


def part_nccl(model_dir: Path) -> dict:
    import torch.multiprocessing as mp
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        sizes = [f.get_slice(k).get_shape() for k in f.keys()]
    numels = [math.prod(s) for s in sizes]
    total_bytes = 2 * sum(numels)
    result = {}
    for backend, devices in ((("nccl", ("cuda", "cuda")),) if DEVICE == "cuda" else ()) + (("gloo", ("cpu", "cpu")),):
        out = tempfile.mktemp()
        try:
            ctx = mp.get_context("spawn")
            port = _free_port()
            procs = [ctx.Process(target=_broadcast_rank, args=(r, port, backend, devices[r], numels, out))
                     for r in range(2)]
            for p in procs:
                p.start()
            for p in procs:
                p.join(120)
            measured = json.loads(Path(out).read_text())
            result[backend] = {"seconds": round(measured["seconds"], 5), "ok": measured["ok"],
                               "gbytes_per_s": round(total_bytes / measured["seconds"] / 1e9, 4)}
        except Exception as exc:  # NCCL may refuse two ranks on one GPU
            result[backend] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    result["bytes"] = total_bytes
    return result


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------ ipc
def _ipc_receiver(payload: bytes, expected: list[float], out: str, device: str) -> None:
    import pickle

    import torch

    start = time.perf_counter()
    named = pickle.loads(payload)
    sums = [float(t.float().sum()) for _, t in named]
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    ok = all(abs(a - b) <= 1e-3 * max(1.0, abs(b)) for a, b in zip(sums, expected))
    Path(out).write_text(json.dumps({"seconds": seconds, "ok": ok, "tensors": len(named)}))


def part_ipc(model_dir: Path) -> dict:
    import io
    from multiprocessing.reduction import ForkingPickler

    import torch
    import torch.multiprocessing as mp  # registers torch's reductions (CUDA tensors -> IPC handles) with it
    from safetensors.torch import load_file

    named = [(k, v.to(DEVICE, torch.bfloat16)) for k, v in load_file(model_dir / "model.safetensors").items()]
    expected = [float(t.float().sum()) for _, t in named]
    start = time.perf_counter()
    buf = io.BytesIO()
    ForkingPickler(buf).dump(named)
    serialize_s = time.perf_counter() - start
    out = tempfile.mktemp()
    proc = mp.get_context("spawn").Process(target=_ipc_receiver, args=(buf.getvalue(), expected, out, DEVICE))
    proc.start()
    proc.join(120)
    measured = json.loads(Path(out).read_text())
    total = sum(t.numel() * t.element_size() for _, t in named)
    return {"serialize_s": round(serialize_s, 5), "open_and_check_s": round(measured["seconds"], 4),
            "ok": measured["ok"], "tensors": measured["tensors"], "payload_bytes": len(buf.getvalue()),
            "weights_bytes": total}


# ------------------------------------------------------------------ engine
def part_engine(model_dir: Path) -> dict:
    import threading

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from relax_core.rollout.cpu_engine.batcher import Batcher, Sequence
    from relax_core.rollout.cpu_engine.sampling import RowSampling

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(DEVICE).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    batcher = Batcher(model, tokenizer, max_running=64, seed=0, original_logprob=False)
    batcher.start()
    try:
        def run(n: int, new: int) -> float:
            done = threading.Semaphore(0)
            seqs = [Sequence(f"r{i}", [3 + j % 16 for j in range(64)], new, RowSampling(1.0, -1, 1.0, 0.0, False, None),
                             frozenset(), [], True, on_done=lambda s: done.release()) for i in range(n)]
            start = time.perf_counter()
            batcher.submit(seqs)
            for _ in seqs:
                done.acquire(timeout=300)
            return sum(len(s.output_ids) for s in seqs) / (time.perf_counter() - start)

        run(8, 8)  # warm-up
        return {"tokens_per_s": round(run(64, 64)), "requests": 64, "new_tokens": 64}
    finally:
        batcher.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(PARTS))
    parser.add_argument("--out", default=None, help="folder for the JSON result (check.json)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    global DEVICE
    DEVICE = args.device
    if DEVICE == "cpu":  # a smoke run: a model and batch the CPU gets through in seconds
        MODEL.update(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2)
        LENGTHS.update(prompt=(4, 16), response=(2, 16))
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("no CUDA GPU visible to torch: nothing to check here")
        return 1
    info = {"gpu": torch.cuda.get_device_name(0) if DEVICE == "cuda" else None, "torch": torch.__version__,
            "python": sys.version.split()[0]}
    print(json.dumps(info))
    model_dir = tiny_model(Path(tempfile.mkdtemp()) / "model")
    results: dict = {"info": info}
    for part in args.only.split(","):
        start = time.perf_counter()
        try:
            results[part] = globals()[f"part_{part}"](model_dir)
        except Exception as exc:
            results[part] = {"error": f"{type(exc).__name__}: {exc}"[:500], "trace": traceback.format_exc()[-1500:]}
        results[part]["wall_s"] = round(time.perf_counter() - start, 2)
        print(part, json.dumps(results[part]), flush=True)
    line = json.dumps(results)
    if args.out:
        Path(args.out, "check.json").write_text(line)
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
