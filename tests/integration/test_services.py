"""The services of `fully_async` on a real Ray cluster with a real TransferQueue.

The reference workers' log-probs must be exactly what the reference model
gives: the test computes them here with a plain forward pass of the same model
directory, one sequence at a time, no padding and no packing. The advantage
service's are the estimator's over the whole step.
"""

from __future__ import annotations

import pytest

from relax_core.data.sample import Sample

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


def test_reference_workers_the_cluster_has_no_room_for_are_refused_at_once(local_ray):
    """A reference group whose node never joined: the run fails naming it, instead of waiting forever for a
    slot (the session's cluster has one reference slot and no GPU)."""
    import ray

    from relax_core.cluster.placement import REFERENCE_RESOURCE
    from relax_core.services.launch import check_capacity

    check_capacity(ray, REFERENCE_RESOURCE, 1, 0, "cluster.reference")  # room for one CPU worker
    with pytest.raises(RuntimeError, match=r"cluster.reference: 2 worker\(s\) need 2 'relax_reference' slot\(s\), "
                                           r"but the Ray cluster has 1 slot\(s\)"):
        check_capacity(ray, REFERENCE_RESOURCE, 2, 0, "cluster.reference")
    with pytest.raises(RuntimeError, match=r"and 1 GPU\(s\), but the Ray cluster has 1 slot\(s\) and 0 GPU\(s\)"):
        check_capacity(ray, REFERENCE_RESOURCE, 1, 1, "cluster.reference")
