"""The services of `fully_async` on a real Ray cluster with a real TransferQueue.

The reference workers' log-probs must be exactly what the reference model
gives: the test computes them here with a plain forward pass of the same model
directory, one sequence at a time, no padding and no packing. The actor-forward
worker's are those of the actor's weights it was handed, of a version no older
than the rows' own; the critic's values are those of its value model as updated
through the rows' version.
"""

from __future__ import annotations

import dataclasses

import pytest

from relax_core.rollout.types import Sample

LENGTHS = [(3, 5), (1, 1), (6, 2), (2, 7), (4, 0), (5, 3), (2, 4)]  # (prompt, response) tokens; one empty response


@pytest.fixture(scope="module")
def bus(local_ray):
    from relax_core.data.bus import SampleBus

    bus = SampleBus.start(samples_per_step=8, max_partitions=2)
    yield bus
    bus.close()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from relax_core.models.tiny import materialize_tiny_model

    return materialize_tiny_model(tmp_path_factory.mktemp("ref") / "model", seed=3, alphabet="abcdef")


def samples(vocab: int, seed: int = 0) -> list[Sample]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    out = []
    for n, (p, r) in enumerate(LENGTHS):
        ids = torch.randint(3, vocab, (p + r,), generator=gen).tolist()
        out.append(Sample(ids[:p], ids[p:], [-1.0] * r, reward=float(n % 2), group_id=n // 2, sample_id=n))
    return out


def plain_logprobs(model, sample: Sample) -> list[float]:
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([sample.prompt_ids + sample.response_ids])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    p = len(sample.prompt_ids)
    return [float(logp[p - 1 + j, token]) for j, token in enumerate(sample.response_ids)]


def test_reference_log_probs_equal_a_plain_forward_pass_of_the_reference_model(bus, model_dir):
    import ray
    from transformers import AutoModelForCausalLM

    from relax_core.services.fields import ReferenceWorker

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    batch = samples(model.config.vocab_size)
    bus.put(1, batch)
    worker = ray.remote(ReferenceWorker).options(num_cpus=0).remote(str(model_dir), "float32", 3)
    try:
        assert ray.get(worker.process.remote(1, len(batch))) == len(batch)
    finally:
        ray.kill(worker)
    with pytest.raises(TimeoutError, match=r"\(0 ready\)"):  # each row is the reference's once
        bus.claim(1, 1, consumer="reference", timeout_s=0.3)
    taken, extra = bus.take(1, len(batch), ("ref_logprobs",))
    assert [s.sample_id for s in taken] == [s.sample_id for s in batch]
    for sample, ref in zip(taken, extra["ref_logprobs"]):
        expected = plain_logprobs(model, sample)
        assert len(ref) == len(expected) == sample.response_len
        assert max((abs(a - b) for a, b in zip(ref, expected)), default=0.0) < 1e-6, sample.sample_id
    bus.clear(1)


def test_two_reference_workers_share_a_step_and_the_trainer_waits_for_both(bus, model_dir):
    import ray
    from transformers import AutoConfig

    from relax_core.services.fields import ReferenceWorker

    batch = samples(AutoConfig.from_pretrained(model_dir).vocab_size, seed=1)
    bus.put(2, batch)
    workers = [ray.remote(ReferenceWorker).options(num_cpus=0).remote(str(model_dir), "float32", 8) for _ in range(2)]
    try:
        assert ray.get(workers[0].process.remote(2, 4)) == 4
        with pytest.raises(TimeoutError, match=r"\(4 ready\)"):  # 3 rows still lack their reference column
            bus.claim(2, len(batch), ("ref_logprobs",), timeout_s=0.5)
        assert ray.get(workers[1].process.remote(2, len(batch) - 4)) == len(batch) - 4
    finally:
        for worker in workers:
            ray.kill(worker)
    taken, extra = bus.take(2, len(batch), ("ref_logprobs",))
    assert sorted(s.sample_id for s in taken) == list(range(len(batch)))
    assert [len(r) for r in extra["ref_logprobs"]] == [s.response_len for s in taken]
    bus.clear(2)


def test_the_advantage_service_writes_the_estimators_advantages_for_the_whole_step(bus):
    import ray

    from relax_core.services.fields import AdvantageWorker

    rewards, groups = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0], [7, 7, 7, 7, 9, 9]
    bus.put(3, [Sample([1], [2], [-1.0], reward=r, group_id=g, sample_id=i)
                for i, (r, g) in enumerate(zip(rewards, groups))])
    worker = ray.remote(AdvantageWorker).options(num_cpus=0).remote("grpo", {})
    try:
        assert ray.get(worker.process.remote(3, 6)) == 6
    finally:
        ray.kill(worker)
    _, extra = bus.take(3, 6, ("advantages",))
    a = 0.5 / ((1 / 3) ** 0.5 + 1e-6)  # group 7 = {1, 0, 0, 1}: mean 0.5, unbiased std sqrt(1/3); group 9 equal
    assert extra["advantages"] == pytest.approx([a, -a, -a, a, 0.0, 0.0], abs=1e-5)
    bus.clear(3)


def test_the_actor_forward_worker_uses_the_actors_weights_of_the_rows_version_or_newer(bus, model_dir):
    import ray
    import torch
    from transformers import AutoModelForCausalLM

    from relax_core.services.fields import ActorForwardWorker

    actor = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():  # the actor after one optimizer step: weights unlike the model directory's
        for param in actor.parameters():
            param.add_(0.05 * torch.randn_like(param))
    batch = [dataclasses.replace(s, policy_version=1) for s in samples(actor.config.vocab_size, seed=4)]
    bus.put(5, batch)
    worker = ray.remote(max_concurrency=2)(ActorForwardWorker).options(num_cpus=0).remote(
        str(model_dir), "float32", 3)
    try:
        call = worker.process.remote(5, len(batch))
        assert not ray.wait([call], timeout=1.0)[0], "computed with version 0 weights for rows of version 1"
        assert ray.get(worker.set_weights.remote((0, []))) == 0  # an older version is ignored, not loaded
        named = [(n, t.detach().clone()) for n, t in actor.named_parameters()]
        assert ray.get(worker.set_weights.remote((1, named))) == 1
        assert ray.get(call, timeout=60) == len(batch)
        assert ray.get(worker.used.remote()) == {5: 1}
    finally:
        ray.kill(worker)
    taken, extra = bus.take(5, len(batch), ("old_logprobs",))
    for sample, old in zip(taken, extra["old_logprobs"]):
        expected = plain_logprobs(actor, sample)
        assert len(old) == sample.response_len
        assert max((abs(a - b) for a, b in zip(old, expected)), default=0.0) < 1e-6, sample.sample_id
    bus.clear(5)


def plain_values(model, sample: Sample) -> list[float]:
    """The value model's V of each response token, one sequence alone (no padding, no packing)."""
    import torch

    with torch.no_grad():
        hidden = model.body(input_ids=torch.tensor([sample.prompt_ids + sample.response_ids])).last_hidden_state[0]
        p = len(sample.prompt_ids)
        return model.head(hidden[p - 1:p - 1 + sample.response_len]).squeeze(-1).float().tolist()


def test_the_critic_writes_the_values_of_its_weights_updated_through_the_rows_version(bus, model_dir):
    """Rows of version 1 wait for the critic's update on step 1; their values are then those of the updated
    value model (a plain forward of its weights), not of the initial one (whose zero head gives V = 0)."""
    import ray

    from relax_core.services.critic import CriticWorker
    from relax_core.train.config import TorchTrainerConfig
    from relax_core.train.critic import ValueModel

    vocab = ValueModel(model_dir, "float32").body.config.vocab_size
    first, later = samples(vocab, seed=6), [dataclasses.replace(s, policy_version=1) for s in samples(vocab, seed=7)]
    bus.put(1, first)
    bus.put(6, later)
    config = TorchTrainerConfig(critic_lr=0.05, micro_batch_size=3)
    worker = ray.remote(max_concurrency=4)(CriticWorker).options(num_cpus=0).remote(str(model_dir), config, 1)
    try:
        call = worker.process.remote(6, len(later))
        assert not ray.wait([call], timeout=1.0)[0], "values of the initial critic for rows of version 1"
        assert ray.get(worker.process.remote(1, len(first)), timeout=60) == len(first)
        meta = bus.claim(1, len(first), ("values",))  # the trainer's rows: it writes their returns
        bus.write(meta, "returns", [[1.0] * s.response_len for s in first])
        metrics = ray.get(worker.update.remote(1, len(first)), timeout=60)
        assert metrics["value_loss"] > 0 and 0 <= metrics["vf_clipfrac"] <= 1
        assert ray.get(call, timeout=60) == len(later)
        assert ray.get(worker.used.remote()) == {1: 0, 6: 1}
        state = ray.get(worker.state_dict.remote())
    finally:
        ray.kill(worker)
    updated = ValueModel(model_dir, "float32").eval()
    updated.load_state_dict(state["model"])
    taken, extra = bus.take(6, len(later), ("values",))
    assert [s.sample_id for s in taken] == [s.sample_id for s in later]
    for sample, values in zip(taken, extra["values"]):
        expected = plain_values(updated, sample)
        assert len(values) == len(expected) == sample.response_len
        assert max((abs(a - b) for a, b in zip(values, expected)), default=0.0) < 1e-6, sample.sample_id
    assert max(abs(v) for row in extra["values"] for v in row) > 1e-3  # the update moved the values off 0
    bus.clear(1)
    bus.clear(6)
