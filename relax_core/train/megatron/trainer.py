"""The Megatron backend's trainer: the step of `PolicyTrainer` (step.py) on a megatron-core model.

`MegatronTrainer` trains a megatron-core `GPTModel` (model.py), sharded over
tensor, pipeline and expert parallel groups (parallel.py) and loaded from the
HF checkpoint (hf_weights.py). What it shares with the torch backend
(torch_backend.py), through their base `PolicyTrainer`, is everything an
algorithm is made of: the step's advantages, the mini-batches and their
normalisers, the policy loss, its aggregation, the KL and the metrics
(`PolicyTrainer.loss_from`). What differs:

- forward and backward run through megatron-core's own schedule
  (`get_forward_backward_func`: 1F1B with pipeline parallelism), with the loss
  function computing `loss_from` on the last stage;
- the model is wrapped in megatron-core's `DistributedDataParallel` (in bf16
  runs around its `Float16Module`, every parameter in bf16, as Megatron-LM
  trains) and the gradients are finished by `finalize_model_grads` (data-parallel sums,
  sequence-parallel norms, pipeline-tied embeddings) and stepped by
  megatron-core's optimizer (`get_megatron_optimizer`: Adam with decoupled
  weight decay, none on biases and norms, fp32 master weights of bf16
  parameters, gradient clipping over the model-parallel ranks, optionally
  the distributed optimizer);
- "data parallel" means Megatron's data-parallel group: the ranks of one
  model-parallel group (TP x PP) first pool the samples the controller
  handed each of them, so all of them train on the same rows;
- with expert parallelism every data-parallel rank runs as many passes as the
  busiest one (the experts' token exchange is a collective), like FSDP's;
- weights go to the engines and to checkpoints as megatron-core keeps them:
  `named_parameters_for_sync` gathers the HF tensors, `save`/`load` write
  Megatron distributed checkpoints (checkpoint.py).

Gradients are summed over data-parallel ranks (`calculate_per_token_loss`
semantics: no 1/DP scaling), the loss being normalised by the step-global
token and sequence counts, as in the torch backend.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from relax_core.train.batching import MicroBatch
from relax_core.train.config import TorchTrainerConfig
from relax_core.train.megatron import compat
from relax_core.train.megatron.forward import attention_inputs, full_logits
from relax_core.train.megatron.model import Parallel, build_model, unsupported
from relax_core.train.offload import StorageOffload
from relax_core.train.optim import lr_lambda
from relax_core.train.step import Micro, Mini, PolicyTrainer
from relax_core.train.step_metrics import SUMS


class LambdaSchedule:
    """The torch backend's lr schedule (`optim.lr_lambda`) set on a Megatron optimizer's param groups; its
    state is saved in the fields of Megatron-LM's `OptimizerParamScheduler`, so Megatron-LM reads it."""

    STYLES = {"constant": "constant", "cosine": "cosine", "linear": "linear"}

    def __init__(self, optimizer, cfg: TorchTrainerConfig):
        self.optimizer, self.cfg = optimizer, cfg
        self.factor = lr_lambda(cfg.lr_schedule, warmup_steps=cfg.warmup_steps, total_steps=cfg.total_steps,
                                min_lr_ratio=cfg.min_lr_ratio)
        self.num_steps = 0
        self._apply()

    def _apply(self) -> None:
        # What Megatron-LM's OptimizerParamScheduler sets: megatron-core's param groups only say how much of
        # the weight decay each takes (`wd_mult`: 0 for biases and 1-D parameters, the norms).
        for group in self.optimizer.param_groups:
            group["lr"] = self.cfg.lr * self.factor(self.num_steps)
            group["weight_decay"] = self.cfg.weight_decay * group.get("wd_mult", 1.0)

    def get_last_lr(self) -> list[float]:
        return [self.cfg.lr * self.factor(self.num_steps)]

    def step(self) -> None:
        self.num_steps += 1
        self._apply()

    def state_dict(self) -> dict:
        """Megatron-LM counts the schedule in samples (a step's samples per step, here)."""
        cfg, per = self.cfg, max(self.cfg.samples_per_step, 1)
        return {"max_lr": cfg.lr, "min_lr": cfg.lr * cfg.min_lr_ratio, "lr_warmup_steps": cfg.warmup_steps * per,
                "lr_decay_steps": cfg.total_steps * per, "lr_decay_style": self.STYLES[cfg.lr_schedule],
                "num_steps": self.num_steps * per, "start_wd": cfg.weight_decay, "end_wd": cfg.weight_decay,
                "wd_incr_steps": cfg.total_steps * per, "wd_incr_style": "constant"}

    def load_state_dict(self, state: dict) -> None:
        self.num_steps = int(state["num_steps"]) // max(self.cfg.samples_per_step, 1)
        self._apply()


def ensure_world(device: str) -> None:
    """megatron-core needs torch.distributed even for one rank: a one-process group then."""
    if dist.is_initialized():
        return
    store = dist.HashStore()
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo", store=store, rank=0, world_size=1)


class MegatronTrainer(PolicyTrainer):
    """Trains one Qwen3 / Qwen3-MoE with megatron-core over the trainer world (see the module docstring).

    Args:
        model_path: HF model directory (config.json, safetensors).
        config: the torch backend's settings (optimizer, batching, loss).
        parallel: tensor / pipeline / context / expert parallel sizes and sequence parallelism.
        distributed_optimizer: shard the optimizer state over the data-parallel ranks.
        ref_model_path: frozen reference for the KL; defaults to `model_path`.
    """

    def __init__(self, model_path: str | Path, config: TorchTrainerConfig, parallel: Parallel, *,
                 distributed_optimizer: bool = False, ref_model_path: str | Path | None = None) -> None:
        from megatron.core import parallel_state as ps

        from relax_core.train.megatron import hf_weights
        from relax_core.train.megatron.parallel import initialize

        super().__init__(config)
        cfg = config
        compat.install(cfg.device)
        ensure_world(cfg.device)
        initialize(parallel, cfg.seed, cfg.device)
        self.par = parallel
        self.distributed_optimizer = distributed_optimizer
        self.model_path = Path(model_path)
        self.hf_config = json.loads((self.model_path / "config.json").read_text())
        problems = unsupported(self.hf_config, parallel)  # a hub model is known only now
        if problems:
            raise ValueError(f"{self.model_path}: " + "; ".join(problems))
        self.group = ps.get_data_parallel_group()
        self.module = self._load(self.model_path, cfg.dtype, cfg.recompute_activations)
        self.ddp = self._wrap(self._in_compute_dtype(self.module), distributed_optimizer)
        self.model = self.ddp
        if self._loads_reference:
            self.ref_model = self._in_compute_dtype(self._load(Path(ref_model_path or model_path), cfg.dtype, False))
            self.ref_model.requires_grad_(False)
        self.pad_id = self.hf_config.get("pad_token_id") or 0
        self.optimizer = self._build_optimizer(self.ddp, cfg.lr)
        # PPO's critic: the policy's model with a value head, sharded and trained as the policy (critic.py).
        if cfg.critic_lr is not None:
            from relax_core.train.megatron.critic import MegatronCritic

            self.critic = MegatronCritic.build(self, Path(cfg.critic_path or model_path))
        self.scheduler = LambdaSchedule(self.optimizer, cfg)
        self._hf = hf_weights

    # ------------------------------------------------------------ building
    def _load(self, path: Path, dtype: str, recompute: bool) -> torch.nn.Module:
        from safetensors import safe_open

        from relax_core.train.megatron import hf_weights

        config = json.loads((path / "config.json").read_text())
        module = build_model(config, self.par, dtype=dtype, recompute=recompute, device=self.config.device)
        handles = _safetensors(path, safe_open)
        hf_weights.load_hf(module, config, lambda name: handles[name].get_tensor(name))
        return module.eval()

    @staticmethod
    def _in_compute_dtype(module: torch.nn.Module) -> torch.nn.Module:
        """bf16: the model as Megatron-LM trains it, in megatron-core's `Float16Module` (every parameter in
        bf16, the norms too; megatron-core's optimizer then keeps an fp32 master copy of each); fp32: as is.
        The wrapped module keeps its parameter names (`self.module` is the inner one)."""
        if not module.config.bf16:
            return module
        from megatron.core.transformer.module import Float16Module

        with compat.on_device():
            return Float16Module(module.config, module).eval()

    def _wrap(self, module: torch.nn.Module, distributed_optimizer: bool):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                   use_distributed_optimizer=distributed_optimizer,
                                                   check_for_nan_in_grad=False)
        with compat.on_device():
            return DistributedDataParallel(module.config, ddp_config, module)

    def _build_optimizer(self, ddp, lr: float):
        """megatron-core's optimizer over `ddp`'s parameters (the policy's, or the critic's at its own lr)."""
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        cfg = self.config
        opt_config = OptimizerConfig(
            optimizer="adam", lr=lr, min_lr=lr * cfg.min_lr_ratio, weight_decay=cfg.weight_decay,
            adam_beta1=cfg.betas[0], adam_beta2=cfg.betas[1], adam_eps=cfg.adam_eps,
            clip_grad=cfg.grad_clip if cfg.grad_clip > 0 else 0.0, bf16=cfg.dtype == "bfloat16",
            params_dtype=getattr(torch, cfg.dtype), use_distributed_optimizer=self.distributed_optimizer,
        )
        with compat.on_device():
            return get_megatron_optimizer(opt_config, [ddp])

    # ---------------------------------------------------------- groups
    @property
    def distributed(self) -> bool:
        return True

    @property
    def sharded(self) -> bool:
        """Expert parallel: every data-parallel rank must run the same passes (the experts' token
        exchange is a collective over them)."""
        return self.par.ep > 1

    @property
    def collective_weights(self) -> bool:
        """The whole weights are gathered from every rank's shards (TP/PP/EP), every rank taking part."""
        return dist.get_world_size() > 1

    def _mp_gather(self, rows: Sequence | None) -> list | None:
        """This rank's rows pooled with the other ranks' of its model-parallel group, in rank order."""
        from megatron.core import parallel_state as ps

        group = ps.get_model_parallel_group()
        if dist.get_world_size(group) == 1:
            return None if rows is None else list(rows)
        parts: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(parts, None if rows is None else list(rows), group=group)
        if any(p is None for p in parts):
            return None
        return [row for part in parts for row in part]

    def _pool(self, samples, *columns):
        """The rows of this rank's model-parallel group (every rank of it trains on all of them), and what
        keeps this rank's own of per-row results."""
        counts = self._mp_gather([len(samples)]) or [len(samples)]
        pooled = self._mp_gather(samples)
        start = sum(counts[: self._mp_rank()])

        def own(rows: list) -> list:
            return rows[start: start + len(samples)]

        return (pooled if pooled is not None else list(samples),
                *(self._mp_gather(c) if c is not None else None for c in columns)), own

    def _mp_rank(self) -> int:
        from megatron.core import parallel_state as ps

        return dist.get_rank(ps.get_model_parallel_group())

    # ------------------------------------------------------------ schedule
    def _schedule(self, model, batches: list[MicroBatch | None], loss_fn, *, forward_only: bool,
                  head: str = "lm", with_entropy: bool = False) -> None:
        """Run `batches` through megatron-core's forward/backward schedule; `loss_fn(i, output, mb)` (last
        stage) returns the loss of batch i (None: an idle pass, loss 0). `head` "lm": the output is the
        `forward.HeadResult` of the response tokens' log-probs (and entropy, `with_entropy`), made inside the
        output layer vocabulary-parallel in chunks of tokens (`forward.response_head`); "logits": the
        logits, gathered over the vocabulary's TP slices; "value": the critic's `[B, L, 1]` values."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from relax_core.train.megatron.forward import response_head

        idle = self._idle_batch()
        items = [(i, b if b is not None else idle) for i, b in enumerate(batches)]
        vocab = self.hf_config["vocab_size"]
        # bf16 out of the model (the head's float32 is one chunk of tokens at a time), not an fp32 copy made
        # by Float16Module; the critic's one value per token in fp32.
        half = {"fp32_output": False} if self.module.config.bf16 and head in ("lm", "logits") else {}

        def forward_step(data_iterator, chunk):
            index, mb = next(data_iterator)
            mask, packed = attention_inputs(mb)
            fused = response_head(chunk, mb, vocab_size=vocab, with_entropy=with_entropy) if head == "lm" \
                else contextlib.nullcontext()
            with fused as result:
                output = chunk(mb.input_ids, mb.position_ids, mask, packed_seq_params=packed, **half)

            def loss_func(output):
                if batches[index] is None:
                    loss = output.sum() * 0.0 if result is None else result.logp.sum() * 0.0
                elif head == "lm":
                    loss = loss_fn(index, result, mb)
                else:
                    loss = loss_fn(index, full_logits(output, vocab) if head == "logits" else output, mb)
                return loss, torch.ones((), dtype=torch.int), {}
            return output, loss_func

        if not items:
            return
        longest = max(b.input_ids.shape[1] for _, b in items)
        with compat.on_device():
            get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iter(items), model=[model],
                num_microbatches=len(items), seq_length=longest, micro_batch_size=items[0][1].input_ids.shape[0],
                forward_only=forward_only)

    def _from_last_stage(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` as the last pipeline stage holds it, on every stage."""
        from megatron.core import parallel_state as ps

        if ps.get_pipeline_model_parallel_world_size() > 1:
            group = ps.get_pipeline_model_parallel_group()
            last = dist.get_global_rank(group, dist.get_world_size(group) - 1)
            dist.broadcast(tensor, src=last, group=group)
        return tensor

    def _logprobs_of(self, model, batches: list[MicroBatch]) -> list[torch.Tensor]:
        """`[B, R]` log-probs of each batch (no grad), on every rank."""
        out: dict[int, torch.Tensor] = {}

        def loss_fn(index, head, mb):
            out[index] = head.logp.detach()
            return head.logp.sum() * 0.0

        with torch.no_grad():
            self._schedule(model, list(batches), loss_fn, forward_only=True)
        return [self._from_last_stage(out.get(i, torch.zeros(b.loss_mask.shape, device=b.loss_mask.device)))
                for i, b in enumerate(batches)]

    @torch.no_grad()
    def logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """`[B, L, vocab]` logits of the current policy on one right-padded batch, on every rank (the last
        pipeline stage's, sent to the others): what `convert-ckpt --verify` and the parity tests compare."""
        from relax_core.train.batching import MicroBatch

        device = self.config.device
        batch, length = input_ids.shape
        empty = torch.zeros(batch, 0, device=device)
        positions = torch.arange(length, device=device).expand(batch, -1).contiguous()
        mb = MicroBatch(input_ids.to(device), attention_mask.to(device), positions, empty.long(), empty.long(),
                        empty.bool(), empty, empty)
        out: dict[int, torch.Tensor] = {}

        def keep(index, logits, _mb):
            out[index] = logits.detach().float()
            return logits.sum() * 0.0

        self._schedule(self.ddp, [mb], keep, forward_only=True, head="logits")
        result = out.get(0, torch.zeros(batch, length, self.hf_config["vocab_size"], device=device))
        return self._from_last_stage(result.contiguous())

    # --------------------------------------------------------- log-probs
    def _policy_logprobs(self, batches: list[MicroBatch], passes: int) -> list[torch.Tensor]:
        return self._logprobs_of(self.ddp, batches + [None] * (passes - len(batches)))[: len(batches)]

    @torch.no_grad()
    def _prepare(self, samples, ref_rows=None, passes: int = 0) -> list[Micro]:
        bounds = self._micro_bounds(samples)
        batches = [self._pack(samples[a:b]) for a, b in zip(bounds, bounds[1:])]

        idle = [None] * (max(passes, len(batches)) - len(batches)) if self.sharded else []
        old = [None] * len(batches)
        if self._recomputes_logp_old:
            old = self._logprobs_of(self.ddp, batches + idle)[: len(batches)]
        ref = [None] * len(batches)
        if ref_rows is not None:
            ref = [self._given_rows(ref_rows, a, b, mb) for (a, b), mb in zip(zip(bounds, bounds[1:]), batches)]
        elif self.ref_model is not None:
            ref = self._logprobs_of(self.ref_model, batches + idle)[: len(batches)]
        values = [None] * len(batches)
        if self.critic is not None:
            values = self.critic.values_of(self, batches + idle)
        return [Micro(mb, lo, lr, values=v) for mb, lo, lr, v in zip(batches, old, ref, values)]

    def _critic_update(self, mini: Mini) -> torch.Tensor:
        return self.critic.update(self, list(mini.micros), mini)

    def _update(self, mini: Mini) -> tuple[torch.Tensor, torch.Tensor, float]:
        """One optimizer step: the schedule's forward/backward over the mini-batch, the gradients finished
        over the parallel groups, megatron-core's optimizer step (clipping included)."""
        from megatron.core.distributed import finalize_model_grads

        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        # On the trainer's device: the last stage adds each micro-batch's sums there, and the pipeline
        # broadcast and the data-parallel reductions below send these very tensors (NCCL: CUDA ones).
        device = self.config.device
        sums = torch.zeros(len(SUMS), dtype=torch.float64, device=device)
        extremes = torch.full((2,), -math.inf, dtype=torch.float64, device=device)
        micros = list(mini.micros)

        def loss_fn(index, head, mb):
            logp, entropy = head.logp, head.entropy
            loss, parts, micro_extremes = self.loss_from(logp, entropy, micros[index], mini)
            sums.add_(parts.to(device))
            torch.maximum(extremes, micro_extremes.to(device), out=extremes)
            return loss

        idle = [None] * (mini.passes - len(micros)) if self.sharded else []
        self.ddp.train()
        try:
            self._schedule(self.ddp, [m.mb for m in micros] + idle, loss_fn, forward_only=False, with_entropy=True)
        finally:
            self.ddp.eval()
        with compat.on_device():
            finalize_model_grads([self.ddp])
        self._from_last_stage(sums)
        self._from_last_stage(extremes)
        self._all_reduce(sums)
        with compat.on_device():
            _, grad_norm, _ = self.optimizer.step()
        return sums, extremes, float(grad_norm if grad_norm is not None else 0.0)

    # ------------------------------------------------- GPU memory (colocate)
    def _offload(self, store: StorageOffload, parts) -> None:
        """megatron-core's state: "optimizer" takes the gradient buffers (emptied, not copied: the next step
        zeroes them), the optimizers' master weights and Adam state, the reference and the critic; "model"
        the policy's parameters (in megatron-core's flat buffers, emptied whole)."""
        from relax_core.train.offload import megatron_grad_buffers, megatron_optimizer_tensors
        from relax_core.train.offload import module_tensors as tensors_of

        if "optimizer" in parts:
            policy = {t.untyped_storage().data_ptr() for t in tensors_of(self.module)}
            grads, state = megatron_grad_buffers(self.ddp), megatron_optimizer_tensors(self.optimizer)
            state += tensors_of(self.ref_model)
            if self.critic is not None:
                grads += megatron_grad_buffers(self.critic.ddp)
                state += megatron_optimizer_tensors(self.critic.optimizer) + tensors_of(self.critic.module)
            store.offload(grads, keep=False)
            store.offload([t for t in state if t.untyped_storage().data_ptr() not in policy])
        if "model" in parts:
            store.offload(tensors_of(self.module))

    # --------------------------------------------------- sync and checkpoint
    def named_parameters_for_sync(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, whole tensor in the compute dtype) of every weight, gathered from the TP/EP/PP
        shards; every rank must iterate it, in step (each gets every tensor)."""
        return self._hf.gather_hf(self.module, self.hf_config, getattr(torch, self.config.dtype))

    # What Megatron-LM's `_build_sharded_state_dict_metadata` passes with --dist-ckpt-optim-fully-reshardable:
    # the distributed optimizer's state in model space, so it loads into any TP/PP/DP layout. Saved as the
    # checkpoint's `content_metadata`, from which Megatron-LM's loading asks for the same keys.
    CONTENT_METADATA = {"distrib_optim_sharding_type": "fully_reshardable",
                        "distrib_optim_fully_reshardable_mem_efficient": False, "singleton_local_shards": False,
                        "chained_optim_avoid_prefix": True}

    def sharded_state_dict(self, *, loading: bool = False) -> dict:
        """What a Megatron-LM checkpoint holds for the model and optimizer (sharded tensors); `loading`: the
        template to load into (megatron-core's optimizer gives itself the state to load into, as in
        Megatron-LM's loading)."""
        from megatron.core import parallel_state as ps

        metadata = dict(self.CONTENT_METADATA, dp_cp_group=ps.get_data_parallel_group(with_context_parallel=True))
        model = self.module.sharded_state_dict(metadata=metadata)
        with compat.on_device():
            optimizer = self.optimizer.sharded_state_dict(model, is_loading=loading, metadata=metadata)
        state = {"model": model, "optimizer": optimizer, "opt_param_scheduler": self.scheduler.state_dict()}
        if self.critic is not None:
            state["critic"] = self.critic.sharded_state_dict(metadata, loading=loading)
        return state

    def load_sharded(self, state: dict) -> None:
        self.module.load_state_dict(state["model"])
        with compat.on_device():
            self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["opt_param_scheduler"])
        if self.critic is not None:
            self.critic.load_sharded(state["critic"])

    def state_dict(self) -> dict:
        raise NotImplementedError("the megatron backend saves Megatron distributed checkpoints: "
                                  "relax_core.checkpoint.megatron")

    def load_state_dict(self, state: dict) -> None:
        raise NotImplementedError("the megatron backend loads Megatron distributed checkpoints: "
                                  "relax_core.checkpoint.megatron")


def _safetensors(path: Path, safe_open) -> dict:
    """HF tensor name -> an open safetensors file holding it (one file or an indexed set)."""
    index = path / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() \
        else ["model.safetensors"]
    handles = {}
    for name in files:
        handle = safe_open(str(path / name), framework="pt")
        for key in handle.keys():
            handles[key] = handle
    return handles
