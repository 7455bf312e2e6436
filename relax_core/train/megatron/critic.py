"""PPO's critic on the Megatron backend: the policy's megatron-core model with a value head.

Built, sharded and trained the way the policy is (trainer.py): the same `GPTModel` over the same
tensor / pipeline / expert parallel groups, loaded from the HF checkpoint, recomputed, in megatron-core's
`Float16Module` for bf16 runs with float32 master weights in its own megatron-core optimizer (lr
`algorithm.critic.lr`), its gradients finished over the data-parallel group by its own
`DistributedDataParallel`. Only its last stage differs: the output layer is a value head, one
`Linear(hidden, 1)` that starts at zero (V = 0 before training, as the torch backend's) and is the
same on every tensor-parallel rank (a single output cannot be split; every TP rank sees the whole
hidden state after the last norm, so each computes the same values and the same head gradient).

The trainer asks it for the values of a step's micro-batches before the first update (`values_of`,
through megatron-core's schedule, so pipeline stages pass activations as for the policy) and takes one
optimizer step per mini-batch after the policy's (`update`: the clipped value loss, token-mean over
the mini-batch's learned tokens on every data-parallel rank). Its sharded state goes into the Megatron
checkpoint beside the policy's, its keys under `critic.`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from relax_core.algorithms.aggregation import token_mean
from relax_core.algorithms.policy_losses import value_loss
from relax_core.train.batching import MicroBatch

PREFIX = "critic."  # its keys in a checkpoint, beside the policy's


class ValueHead(torch.nn.Linear):
    """The critic's output layer in `GPTModel`'s place: `[S, B, H] -> ([S, B, 1], None)`."""

    def __init__(self, hidden_size: int, dtype: torch.dtype, device: torch.device):
        super().__init__(hidden_size, 1, dtype=dtype, device=device)
        torch.nn.init.zeros_(self.weight)
        torch.nn.init.zeros_(self.bias)

    def forward(self, hidden: torch.Tensor, weight=None, runtime_gather_output=None):
        return super().forward(hidden), None


@dataclass
class MegatronCritic:
    """The critic's model (`module`, its parameter names megatron-core's), its DDP wrapper and optimizer."""

    module: torch.nn.Module
    ddp: Any
    optimizer: Any
    value_clip: float

    @classmethod
    def build(cls, trainer, path) -> MegatronCritic:
        """The critic of `trainer` (a `MegatronTrainer`), its body from the HF directory `path`."""
        from megatron.core import parallel_state as ps

        cfg = trainer.config
        module = trainer._load(path, cfg.dtype, cfg.recompute_activations)
        if ps.is_pipeline_last_stage():
            layer = module.output_layer
            weight = next(layer.parameters(), None)
            dtype = weight.dtype if weight is not None else module.config.params_dtype
            device = weight.device if weight is not None else torch.device(cfg.device)
            module.output_layer = ValueHead(module.config.hidden_size, dtype, device)
        module.share_embeddings_and_output_weights = False  # its output layer shares nothing with the embedding
        ddp = trainer._wrap(trainer._in_compute_dtype(module), trainer.distributed_optimizer)
        optimizer = trainer._build_optimizer(ddp, cfg.critic_lr)
        for group in optimizer.param_groups:  # constant lr; the decay spares biases and norms (wd_mult 0)
            group["weight_decay"] = cfg.weight_decay * group.get("wd_mult", 1.0)
        return cls(module, ddp, optimizer, cfg.critic_value_clip)

    def values_of(self, trainer, batches: list[MicroBatch | None]) -> list[torch.Tensor]:
        """`[B, R]` values of each batch (None: an idle pass), float32, on every rank."""
        out: dict[int, torch.Tensor] = {}

        def record(index, output, mb):
            out[index] = _at_responses(output, mb).detach()
            return output.sum() * 0.0

        with torch.no_grad():
            trainer._schedule(self.ddp, list(batches), record, forward_only=True, head="value")
        device = trainer.config.device
        return [trainer._from_last_stage(out.get(i, torch.zeros(b.loss_mask.shape, device=device)))
                for i, b in enumerate(batches) if b is not None]

    def update(self, trainer, micros, mini) -> torch.Tensor:
        """One optimizer step on a mini-batch's `_Micro`s (their `values` before the step and GAE `returns`);
        the sums [loss, clipped, tokens] over the data-parallel ranks, float64 on the trainer's device."""
        from megatron.core.distributed import finalize_model_grads

        from relax_core.train.megatron import compat

        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        sums = torch.zeros(3, dtype=torch.float64, device=trainer.config.device)

        def loss_fn(index, output, mb):
            micro = micros[index]
            out = value_loss(_at_responses(output, mb), micro.values, micro.returns, mask=mb.loss_mask,
                             value_clip=self.value_clip)
            loss = token_mean(out.loss, mb.loss_mask, global_tokens=mini.tokens)
            sums.add_(torch.stack([loss.detach().double(), (out.clipped * mb.loss_mask).sum().double(),
                                   mb.loss_mask.sum().double()]).to(sums.device))
            return loss

        idle = [None] * (mini.passes - len(micros)) if trainer.sharded else []
        self.ddp.train()
        try:
            trainer._schedule(self.ddp, [m.mb for m in micros] + idle, loss_fn, forward_only=False, head="value")
        finally:
            self.ddp.eval()
        with compat.on_device():
            finalize_model_grads([self.ddp])
        trainer._from_last_stage(sums)
        trainer._all_reduce(sums)
        with compat.on_device():
            self.optimizer.step()
        return sums

    def sharded_state_dict(self, metadata: dict, *, loading: bool) -> dict:
        from relax_core.train.megatron import compat

        model = self.module.sharded_state_dict(prefix=PREFIX, metadata=metadata)
        with compat.on_device():
            optimizer = self.optimizer.sharded_state_dict(model, is_loading=loading, metadata=metadata)
        return {"model": model, "optimizer": optimizer}

    def load_sharded(self, state: dict) -> None:
        from relax_core.train.megatron import compat

        self.module.load_state_dict({k.removeprefix(PREFIX): v for k, v in state["model"].items()})
        with compat.on_device():
            self.optimizer.load_state_dict(state["optimizer"])


def _at_responses(output: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
    """`[B, R]` float32 values at the positions that predict each response token, from `[B, L, 1]`."""
    return mb.at_logits(output.float()).squeeze(-1)
