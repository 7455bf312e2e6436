"""GRPO actually learns: the quick-start copy task, in one process, no HTTP.

A random-weight tiny Qwen3 samples answers to synthetic copy prompts (a plain
temperature-1 sampling loop stands in for the rollout engine), the built-in
`copy` reward scores them, and `TorchTrainer.train_step` updates the policy.
A user running the quick start relies on exactly this: reward_mean goes up.
Settings are the quick start's (reported to the lead for recipes/quickstart.yaml):
copy task, alphabet "abcd", strings of 2, 16 prompts x 8 samples, 2 new
tokens, AdamW lr 1e-3, plain GRPO (ppo_clip, token-mean), 100 steps.
"""

from __future__ import annotations

import time

import pytest
import torch

from relax_core.data.sample import Sample
from relax_core.data.synthetic import SyntheticTask
from relax_core.rewards.registry import get_reward
from relax_core.train.config import TorchTrainerConfig
from relax_core.train.torch_backend import TorchTrainer

STEPS, PROMPTS, SAMPLES_PER_PROMPT = 100, 16, 8
ALPHABET, LENGTH = "abcd", 2


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from relax_core.models.tiny import materialize_tiny_model

    return materialize_tiny_model(
        tmp_path_factory.mktemp("learn") / "model", seed=1, alphabet=ALPHABET
    )


@torch.no_grad()
def sample(
    model,
    prompts: list[list[int]],
    n: int,
    max_new: int,
    eos: int,
    gen: torch.Generator,
):
    """n temperature-1 samples per prompt: (response ids up to and including EOS, their log-probs)."""
    assert (
        len({len(p) for p in prompts}) == 1
    ), "equal-length prompts: no padding needed"
    ids = torch.tensor(prompts).repeat_interleave(n, 0)
    tokens, logprobs = [], []
    for _ in range(max_new):
        logp = torch.log_softmax(
            model(input_ids=ids, use_cache=False).logits[:, -1].float(), -1
        )
        tok = torch.multinomial(logp.exp(), 1, generator=gen)
        tokens.append(tok.squeeze(-1))
        logprobs.append(logp.gather(-1, tok).squeeze(-1))
        ids = torch.cat([ids, tok], 1)
    out = []
    for toks, lps in zip(
        torch.stack(tokens, 1).tolist(), torch.stack(logprobs, 1).tolist()
    ):
        end = toks.index(eos) + 1 if eos in toks else len(toks)
        out.append((toks[:end], lps[:end]))
    return out


def rollout(trainer, tokenizer, task, reward, step, gen) -> list[Sample]:
    items = task.next_batch(PROMPTS)
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": it["prompt"]}], add_generation_prompt=True
        )["input_ids"]
        for it in items
    ]
    responses = sample(
        trainer.model, prompts, SAMPLES_PER_PROMPT, LENGTH, tokenizer.eos_token_id, gen
    )
    samples = []
    for i, (ids, logprobs) in enumerate(responses):
        item = items[i // SAMPLES_PER_PROMPT]
        text = tokenizer.decode(ids, skip_special_tokens=True)
        score = reward(text, item["label"], item["metadata"])
        group = step * PROMPTS + i // SAMPLES_PER_PROMPT
        samples.append(
            Sample(
                prompts[i // SAMPLES_PER_PROMPT],
                ids,
                logprobs,
                reward=score,
                group_id=group,
            )
        )
    return samples


# The quick start proves the same end to end (engine, HTTP, Ray) in the default tier.
@pytest.mark.full(covered_by="tests/integration/test_local_run.py::test_quickstart_learns_the_task")
def test_grpo_lifts_copy_reward(model_dir):
    from transformers import AutoTokenizer

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    trainer = TorchTrainer(
        model_dir, TorchTrainerConfig(lr=1e-3, micro_batch_size=128, grad_clip=1.0)
    )
    task = SyntheticTask(
        "copy", seed=0, alphabet=ALPHABET, min_len=LENGTH, max_len=LENGTH
    )
    reward, gen = get_reward("copy"), torch.Generator().manual_seed(0)
    history, start = [], time.monotonic()
    for step in range(STEPS):
        samples = rollout(trainer, tokenizer, task, reward, step, gen)
        if step == 0:  # the sampler's log-probs are the trainer's (what TIS relies on)
            recomputed = trainer.compute_logprobs(samples[:8])
            for s, lp in zip(samples, recomputed):
                assert lp == pytest.approx(s.rollout_logprobs, abs=1e-5)
        metrics = trainer.train_step(samples)
        assert metrics["reward_mean"] == pytest.approx(
            sum(s.reward for s in samples) / len(samples)
        )
        history.append(metrics["reward_mean"])
    first, last = sum(history[:5]) / 5, sum(history[-5:]) / 5
    print(
        f"reward_mean first5={first:.3f} last5={last:.3f} in {time.monotonic() - start:.1f}s"
    )
    assert last - first >= 0.6, history
