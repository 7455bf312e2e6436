"""Log-probs and entropy of the response tokens straight from the last hidden states, in chunks of tokens.

The plain way (`batching.response_logprobs`) takes the model's logits for every position, `[B, L, V]` in
the compute dtype, picks the rows that predict a response token and runs a float32 log-softmax over them:
at 4 x 10k response tokens and Qwen3's 151,936-token vocabulary that is about 24 GB per `[tokens x V]`
fp32 tensor, and autograd keeps several. Here the output layer runs inside the loss, on `CHUNK` tokens at
a time, and only per-token numbers are kept between forward and backward (the log-sum-exp), so the loss
head's memory is O(chunk x V) whatever the response length; the backward recomputes each chunk's logits
(one more output-layer matmul per chunk). Only the response tokens go through the output layer, never
the prompt's or the padding's.

`ChunkedLogprob` is the autograd function; `forward_logprobs` in `batching.py` runs it in place of the
model's output layer (`fused_forward`) for any causal LM whose forward returns the output layer's result
unchanged as its logits, which a one-token forward checks once per model (`FUSED` records the answer on
it): a model that scales or soft-caps its logits (Gemma's final soft-capping, Cohere's logit scale) gives
back something else, and is run the plain way. The equality with the plain computation (values and gradients, fp32) is
tests/unit/test_loss_head.py's subject; the memory is `tests/benchmarks/bench_train.py`'s.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Bytes of float32 logits one chunk may hold: about 440 tokens at Qwen3's vocabulary. The peak of the loss
# head is a small multiple of this (the logits, their softmax and its gradient), against a multiple of
# tokens x V x 4 bytes unchunked.
CHUNK_BYTES = 256 * 1024**2
FUSED = "relax_fused_head"  # set on a model once checked: True when its logits are its output layer's result


def chunk_tokens(vocab: int, chunk_bytes: int | None = None) -> int:
    """How many tokens one chunk takes at this vocabulary size."""
    return max(1, (chunk_bytes or CHUNK_BYTES) // (4 * vocab))


class ChunkedLogprob(torch.autograd.Function):
    """`logp[i] = log_softmax(hidden[i] @ weight.T + bias)[targets[i]]` (float32), `chunk` rows at a time.

    Also returns the entropy of each row's distribution (float32, no gradient: a diagnostic here), or an
    empty tensor without `with_entropy`. The output layer runs under the autocast state of the forward,
    in the forward and again in the backward, so a bf16 model's logits are the same bf16 numbers both
    times, and its gradients take the same dtype path as autograd would give the plain computation.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk: int, with_entropy: bool):
        device_type = hidden.device.type
        ctx.autocast = ((torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))
                        if torch.amp.is_autocast_available(device_type) else (False, None))
        n = hidden.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(logp)
        entropy = torch.empty_like(logp) if with_entropy else logp.new_empty(0)
        for start in range(0, n, chunk):
            rows = slice(start, start + chunk)
            logits = F.linear(hidden[rows], weight, bias).float()
            lse[rows] = torch.logsumexp(logits, dim=-1)
            logp[rows] = logits.gather(-1, targets[rows].unsqueeze(-1)).squeeze(-1) - lse[rows]
            if with_entropy:  # -sum p log p of the log-probs (lse - sum p * logit loses digits to cancellation)
                logits -= lse[rows].unsqueeze(-1)
                entropy[rows] = -(logits.exp() * logits).sum(-1)
            del logits
        ctx.chunk = chunk
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, _grad_entropy):
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        device_type = hidden.device.type
        enabled, dtype = ctx.autocast
        # Leaves of their own: each chunk's small graph accumulates into their .grad, then is freed.
        h = hidden.detach().requires_grad_(ctx.needs_input_grad[0])
        w = weight.detach().requires_grad_(ctx.needs_input_grad[1])
        b = bias.detach().requires_grad_(ctx.needs_input_grad[2]) if bias is not None else None
        autocast = torch.autocast(device_type, dtype=dtype, enabled=True) if enabled else contextlib.nullcontext()
        with torch.enable_grad(), autocast:
            for start in range(0, h.shape[0], ctx.chunk):
                rows = slice(start, start + ctx.chunk)
                g = grad_logp[rows].float()
                if not g.any():
                    continue
                logits = F.linear(h[rows], w, b)
                # d logp_i / d logit_ij = [j == target_i] - softmax_ij
                grad = torch.exp(logits.detach().float() - lse[rows].unsqueeze(-1)).mul_(-g.unsqueeze(-1))
                grad.scatter_add_(-1, targets[rows].unsqueeze(-1), g.unsqueeze(-1))
                logits.backward(grad.to(logits.dtype))
                del logits, grad
        grads = [t.grad if t is not None and t.requires_grad else None for t in (h, w, b)]
        for i, t in enumerate(grads):  # a chunk-free backward (every grad_logp zero) still owes a gradient
            if t is None and ctx.needs_input_grad[i]:
                grads[i] = torch.zeros_like((hidden, weight, bias)[i])
        return grads[0], grads[1], grads[2], None, None, None


def chunked_logprobs(hidden: torch.Tensor, head: torch.nn.Linear, targets: torch.Tensor, *,
                     with_entropy: bool = False, chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`[N]` log-probs of `targets` under `head(hidden)` for `[N, H]` hidden states, and their entropy."""
    chunk = chunk or chunk_tokens(head.out_features)
    logp, entropy = ChunkedLogprob.apply(hidden, head.weight, head.bias, targets, chunk, with_entropy)
    return logp, (entropy if with_entropy else None)


@dataclass
class _HeadResult:
    """What the replaced output layer computed during one forward."""

    logp: torch.Tensor | None = None
    entropy: torch.Tensor | None = None


def output_layer(model: torch.nn.Module) -> torch.nn.Linear | None:
    """The model's output layer when the chunked head may stand in for it: a plain `nn.Linear` (not a
    subclass with a forward of its own)."""
    if not hasattr(model, "get_output_embeddings"):
        return None
    head = model.get_output_embeddings()
    return head if type(head) is torch.nn.Linear else None


@contextlib.contextmanager
def _replaced(head: torch.nn.Linear, rows, targets: torch.Tensor, shape: tuple[int, int],
              with_entropy: bool, chunk: int | None) -> Iterator[_HeadResult]:
    """While inside, `head(hidden)` returns the `[B, R]` log-probs of `targets` at `rows` of `hidden`
    (recorded in the result too), in place of its logits."""
    result = _HeadResult()

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        logp, entropy = chunked_logprobs(rows(hidden), head, targets, with_entropy=with_entropy, chunk=chunk)
        result.logp = _scatter(logp, shape, rows.valid)
        result.entropy = _scatter(entropy, shape, rows.valid) if entropy is not None else None
        return result.logp

    head.forward = forward  # an instance attribute: nn.Module.__call__ looks it up before the class's
    try:
        yield result
    finally:
        del head.forward


def _scatter(values: torch.Tensor, shape: tuple[int, int], valid: torch.Tensor) -> torch.Tensor:
    out = values.new_zeros(shape)
    out[valid] = values
    return out


class ResponseRows:
    """Picks the hidden states that predict the response tokens of a micro-batch, padding left out."""

    def __init__(self, logit_index: torch.Tensor, valid: torch.Tensor, packed: bool):
        self.valid = valid
        self.positions = logit_index[valid]  # [N]
        self.batch = torch.arange(valid.shape[0], device=valid.device).unsqueeze(-1).expand_as(valid)[valid]
        self.packed = packed

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return hidden[0, self.positions]
        return hidden[self.batch, self.positions]


def fused_forward(model: torch.nn.Module, head: torch.nn.Linear, inputs: dict, mb, *, with_entropy: bool,
                  chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """Run the model with the chunked head in place of its output layer; the `[B, R]` log-probs and entropy
    of `mb`'s response tokens. None when the model changed its output layer's result on the way out."""
    rows = ResponseRows(mb.logit_index, mb.valid, mb.packed)
    with _replaced(head, rows, mb.response_ids[mb.valid], tuple(mb.valid.shape), with_entropy, chunk) as result:
        logits = model(**inputs, use_cache=False).logits
    if result.logp is None or logits is not result.logp:
        return None
    return result.logp, result.entropy


class VocabParallelHead(torch.autograd.Function):
    """`ChunkedLogprob` for an output layer split by vocabulary over a tensor-parallel group (megatron-core's
    `ColumnParallelLinear`: each rank holds `[V/TP, H]` of the weight): per chunk of tokens this rank's
    slice of the logits is made from the hidden states, and the log-softmax's max, sum and target logit are
    reduced over `group`, so no rank holds `[tokens x V/TP]` logits or gathers the vocabulary; what is kept
    for the backward is the hidden states and each token's log-sum-exp. Rows at and past `vocab_end` of the
    weight (megatron pads the vocabulary to a multiple of its TP size) are left out, as the unpadded model
    has no such tokens, and get no gradient. The backward recomputes each chunk's logits: `d logp_i /
    d logit_ij = [j == target_i] - softmax_ij` on this rank's columns (megatron's
    `vocab_parallel_cross_entropy` differentiates the same way); the hidden states' gradient is this rank's
    part, which the caller sums over the group (`copy_to_tensor_model_parallel_region`, as
    `ColumnParallelLinear` does), and a half-precision weight's gradient is summed over the chunks in
    float32."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, vocab_start: int, vocab_end: int, group, chunk: int,
                with_entropy: bool):
        import torch.distributed as dist

        n = hidden.shape[0]
        real = max(0, min(weight.shape[0], vocab_end - vocab_start))  # this rank's rows that are real tokens
        local = targets - vocab_start
        mine = (local >= 0) & (local < real)
        index = torch.where(mine, local, torch.zeros_like(local)).unsqueeze(-1)
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(logp)
        entropy = torch.empty_like(logp) if with_entropy else logp.new_empty(0)
        for start in range(0, n, chunk):
            rows = slice(start, start + chunk)
            x = F.linear(hidden[rows], weight[:real]).float()
            top = x.max(dim=-1).values if real else x.new_full((x.shape[0],), -torch.inf)
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
            x -= top.unsqueeze(-1)
            # a rank whose rows are all padding (a small vocabulary over many ranks) adds nothing
            target = torch.where(mine[rows], x.gather(-1, index[rows]).squeeze(-1), 0.0) if real else top * 0
            shifted = x.clone() if with_entropy else None
            x.exp_()
            sums = torch.stack([x.sum(-1), target])
            dist.all_reduce(sums, group=group)
            lse[rows] = top + sums[0].log()
            logp[rows] = sums[1] - sums[0].log()
            if with_entropy:  # H = log Z - sum p (logit - max): the shifted logits, summed over ranks
                weighted = (x * shifted).sum(-1) / sums[0]
                dist.all_reduce(weighted, group=group)
                entropy[rows] = sums[0].log() - weighted
            del x, shifted
        ctx.save_for_backward(hidden, weight, lse, index, mine)
        ctx.chunk, ctx.real = chunk, real
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, _grad_entropy):
        hidden, weight, lse, index, mine = ctx.saved_tensors
        real = ctx.real
        grad_hidden = torch.zeros_like(hidden)
        accumulate = weight.dtype if weight.dtype in (torch.float32, torch.float64) else torch.float32
        grad_weight = torch.zeros(weight.shape, dtype=accumulate, device=weight.device)
        for start in range(0, hidden.shape[0], ctx.chunk):
            rows = slice(start, start + ctx.chunk)
            g = grad_logp[rows].float().unsqueeze(-1)
            if not real or not g.any():
                continue
            h = hidden[rows]
            part = torch.exp(F.linear(h, weight[:real]).float() - lse[rows].unsqueeze(-1)).mul_(-g)
            part.scatter_add_(-1, index[rows], g * mine[rows].unsqueeze(-1))
            part = part.to(weight.dtype)
            grad_hidden[rows] = part @ weight[:real]
            grad_weight[:real].add_((part.t() @ h).to(accumulate))
            del part
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None, None, None, None


def vocab_parallel_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                            vocab_start: int, vocab_end: int, group, with_entropy: bool = False,
                            chunk: int | None = None):
    """`[N]` log-probs of `targets` under the output layer whose `[V/TP, H]` slice this rank holds (its rows
    are the tokens from `vocab_start`; the real vocabulary ends at `vocab_end`), for `[N, H]` hidden
    states, and their entropy. The hidden states' gradient is this rank's part (see `VocabParallelHead`)."""
    chunk = chunk or chunk_tokens(weight.shape[0])
    logp, entropy = VocabParallelHead.apply(hidden, weight, targets, vocab_start, vocab_end, group, chunk,
                                            with_entropy)
    return logp, (entropy if with_entropy else None)
