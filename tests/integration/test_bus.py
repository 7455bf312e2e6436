"""The sample bus on a real private Ray cluster with a real TransferQueue.

One Ray cluster and one bus for the module (TransferQueue allows one per
cluster); every test writes its own step numbers, so tests do not see each
other's rows. Expected values are built here, field by field; log-probs come
back rounded to float32 (`f32`, by `struct`).
"""

import struct

import pytest

from relax_core.data.bus import SampleBus
from relax_core.data.sample import Sample

SHORT = 0.5  # seconds a take waits when the test expects it to time out


@pytest.fixture(scope="module")
def bus(local_ray):
    bus = SampleBus.start(samples_per_step=8, max_partitions=4)
    yield bus
    bus.close()
    bus.close()  # idempotent


def f32(values: list[float]) -> list[float]:
    """`values` rounded to the nearest float32, as the bus stores log-probs."""
    return [struct.unpack("f", struct.pack("f", v))[0] for v in values]


def sample(n: int, group: int, reward: float = 0.0) -> Sample:
    """A sample whose every field is derived from n, so two calls build equal samples (its log-probs are
    float32 numbers: they come back exactly)."""
    return Sample(prompt_ids=[100 + n, 7], response_ids=list(range(n % 4)),
                  rollout_logprobs=[-0.125 * (k + 1) - n / 8 for k in range(n % 4)],
                  reward=reward, group_id=group, policy_version=n // 2, label=f"answer-{n}",
                  metadata={"n": n}, finish_reason="stop", sample_id=1000 + n)


def test_round_trip_is_exact_for_odd_lengths_and_free_form_data(bus):
    def build():
        return [
            Sample(prompt_ids=[1, 2, 3, 4, 5], response_ids=[9, 8, 7],
                   rollout_logprobs=[-0.1234567890123, -1e-9, -17.5],
                   reward=0.75, group_id=3, policy_version=12, loss_mask=[1, 0, 1],
                   label={"answer": [1, 2.5, None], "nested": {"k": "v"}}, metadata={"source": "gsm8k", "idx": 4},
                   finish_reason="stop", sample_id=70003),
            Sample(prompt_ids=[6], response_ids=[], rollout_logprobs=[], reward=-1.0, group_id=3, policy_version=11,
                   label=None, metadata={}, finish_reason="abort"),
            Sample(prompt_ids=list(range(40)), response_ids=list(range(1000, 1017)),
                   rollout_logprobs=[-(k + 1) / 7 for k in range(17)], reward=1e-300, group_id=-2, policy_version=0,
                   label=[1, "two", 3.0, True], metadata={"tags": ["a", "b"], "score": None}, finish_reason="length"),
            Sample(prompt_ids=[0], response_ids=[5], rollout_logprobs=[0.0], label=3.25, finish_reason="stop"),
        ]

    import torch

    bus.put(0, build())
    taken, extra = bus.take(0, 4)
    expected = build()
    for s in expected:
        s.rollout_logprobs = f32(s.rollout_logprobs)
    assert taken == expected
    assert taken[0].rollout_logprobs == [-0.12345679104328156, -9.999999717180685e-10, -17.5]
    for got, sent in zip(taken, build()):  # what the trainer computes with: the same float32 tensor
        assert torch.equal(torch.tensor(got.rollout_logprobs, dtype=torch.float32),
                           torch.tensor(sent.rollout_logprobs, dtype=torch.float32))
    assert taken[0].sample_id == 70003 and taken[0].loss_mask == [1, 0, 1]
    assert taken[1].response_ids == [] and taken[2].label == [1, "two", 3.0, True]
    assert extra == {}


def test_two_puts_then_each_row_once_per_consumer(bus):
    bus.put(1, [sample(n, group=n // 2) for n in range(4)])
    bus.put(1, [sample(n, group=n // 2) for n in range(4, 8)])
    taken, _ = bus.take(1, 8)
    assert taken == [sample(n, group=n // 2) for n in range(8)]  # every row, in put order
    with pytest.raises(TimeoutError, match="step 1"):
        bus.take(1, 1, timeout_s=SHORT)
    other, _ = bus.take(1, 8, consumer="evaluator")  # another consumer still sees all rows
    assert [s.prompt_ids[0] for s in other] == [100 + n for n in range(8)]


def test_partial_takes_follow_put_order_after_indexes_are_reused(bus):
    bus.put(20, [sample(n, group=0) for n in range(6)])
    bus.put(21, [sample(50, group=1), sample(51, group=1)])
    bus.clear(20)  # TransferQueue hands these row indexes to the next rows it stores
    bus.put(21, [sample(52, group=2), sample(53, group=2)])
    first, _ = bus.take(21, 2)
    second, _ = bus.take(21, 2)
    assert [s.group_id for s in first] == [1, 1] and [s.prompt_ids[0] for s in first] == [150, 151]
    assert [s.group_id for s in second] == [2, 2] and [s.prompt_ids[0] for s in second] == [152, 153]


def test_add_field_values_reach_the_trainer_on_the_right_rows(bus):
    rewards = {n: [0.5, -1.0, 2.0, 0.0, 1.5, -0.25][n] for n in range(6)}
    calls = []

    def times_ten(samples):
        calls.append(len(samples))
        return [s.reward * 10 for s in samples]

    bus.put(2, [sample(n, group=0, reward=rewards[n]) for n in range(3)])
    assert bus.add_field(2, "adv", "advantage", times_ten) == 3
    bus.put(2, [sample(n, group=1, reward=rewards[n]) for n in range(3, 6)])
    with pytest.raises(TimeoutError, match="step 2"):  # the second group has no "adv" yet
        bus.take(2, 6, fields=("adv",), timeout_s=SHORT)
    assert bus.add_field(2, "adv", "advantage", times_ten) == 3  # only the new rows
    assert bus.add_field(2, "adv", "advantage", times_ten) == 0
    assert calls == [3, 3]
    taken, extra = bus.take(2, 6, fields=("adv",))
    expected = {100 + n: 10 * r for n, r in rewards.items()}  # keyed by the prompt's first token
    assert [expected[s.prompt_ids[0]] for s in taken] == extra["adv"]
    assert extra["adv"] == [5.0, -10.0, 20.0, 0.0, 15.0, -2.5]


def test_a_cleared_partition_is_gone(bus):
    bus.put(4, [sample(n, group=0) for n in range(3)])
    bus.clear(4)
    with pytest.raises(TimeoutError, match="step 4"):
        bus.take(4, 1, timeout_s=SHORT)
    bus.put(4, [sample(9, group=5)])  # the step can be written afresh: only the new row is there
    taken, _ = bus.take(4, 1)
    assert taken == [sample(9, group=5)]
    with pytest.raises(TimeoutError):
        bus.take(4, 1, timeout_s=SHORT)


def test_partitions_do_not_mix(bus):
    bus.put(5, [sample(n, group=0) for n in range(2)])
    bus.put(6, [sample(n, group=1) for n in range(10, 13)])
    bus.put(5, [sample(n, group=0) for n in range(2, 4)])
    six, _ = bus.take(6, 3)
    five, _ = bus.take(5, 4)
    assert six == [sample(n, group=1) for n in range(10, 13)]
    assert five == [sample(n, group=0) for n in range(4)]
    with pytest.raises(TimeoutError, match="step 5"):
        bus.take(5, 1, timeout_s=SHORT)


def test_multimodal_tensors_travel_as_tensors_beside_text_rows(bus):
    import torch

    def build():
        pixels = torch.arange(4 * 1536, dtype=torch.float32).reshape(4, 1536) / 7
        images = {"pixel_values": pixels, "image_grid_thw": torch.tensor([[1, 2, 2]])}
        audio = {"input_features": torch.linspace(-1, 1, 128 * 30).reshape(128, 30).to(torch.bfloat16),
                 "feature_attention_mask": torch.ones(30, dtype=torch.long)}
        return [Sample(prompt_ids=[1, 2], response_ids=[3], rollout_logprobs=[-0.5], multimodal=images),
                Sample(prompt_ids=[4], response_ids=[5], rollout_logprobs=[-0.25]),
                Sample(prompt_ids=[6, 7], response_ids=[8], rollout_logprobs=[-1.0], multimodal=audio)]

    bus.put(9, build())
    taken, _ = bus.take(9, 3)
    assert taken[1].multimodal is None
    for got, want in zip(taken, build()):
        assert (got.prompt_ids, got.response_ids) == (want.prompt_ids, want.response_ids)
        if want.multimodal is not None:
            assert got.multimodal.keys() == want.multimodal.keys()
            for name, tensor in want.multimodal.items():
                assert got.multimodal[name].dtype == tensor.dtype and torch.equal(got.multimodal[name], tensor)


def test_a_second_bus_in_the_same_cluster_is_refused(bus):
    with pytest.raises(RuntimeError, match="already runs"):
        SampleBus.start(samples_per_step=8, max_partitions=4)


def test_every_sample_field_travels_on_the_bus():
    """A field added to Sample later must be added to the bus too, or it would be dropped silently."""
    import dataclasses

    from relax_core.data.bus import ROLLOUT_FIELDS

    assert sorted(ROLLOUT_FIELDS) == sorted(f.name for f in dataclasses.fields(Sample))


def test_claimed_rows_are_split_over_ranks_by_their_tokens(bus):
    # the long responses first, as a contiguous split would give them all to rank 0
    lengths = [900, 880, 860, 840, 20, 10, 5, 1]
    rows = [Sample(prompt_ids=[1, 2], response_ids=[3] * n, rollout_logprobs=[-0.5] * n, group_id=i // 2,
                   sample_id=500 + i) for i, n in enumerate(lengths)]
    bus.put(30, rows)
    meta = bus.claim(30, 8)
    shards = bus.rank_shards(meta, 2)
    fetched = [bus.fetch(shard)[0] for shard in shards]
    tokens = [sum(s.num_tokens for s in rank) for rank in fetched]
    assert [len(rank) for rank in fetched] == [4, 4]
    assert sorted(s.sample_id for rank in fetched for s in rank) == [500 + i for i in range(8)]
    assert max(tokens) - min(tokens) <= 40  # contiguous halves: 3488 and 44 tokens
    bus.clear(30)


def test_an_8k_token_row_and_its_reference_column_come_back_exactly(bus):
    """Every per-token column of a long row (ids of a 151k vocabulary, a mask with holes, log-probs, the
    reference service's log-probs) through TransferQueue and back, value for value."""
    import random

    rng = random.Random(7)
    prompt = [rng.randrange(151_936) for _ in range(512)]
    response = [rng.randrange(151_936) for _ in range(8192)] + [151_935]
    mask = [0 if 3000 <= k < 3500 else 1 for k in range(len(response))]
    logprobs = [-rng.random() * 12 for _ in response]
    ref = [-rng.random() * 12 for _ in response]
    bus.put(40, [Sample(prompt_ids=prompt, response_ids=response, rollout_logprobs=logprobs, loss_mask=mask,
                        reward=1.0, group_id=9, policy_version=3, sample_id=4001)])

    def reference(columns):
        assert columns["prompt_ids"] == [prompt] and columns["response_ids"] == [response]
        return [ref]

    assert bus.process(40, "reference", ("prompt_ids", "response_ids"), "ref_logprobs", reference, 1) == 1
    (got,), extra = bus.take(40, 1, fields=("ref_logprobs",))
    assert got.prompt_ids == prompt and got.response_ids == response and got.loss_mask == mask
    assert got.rollout_logprobs == f32(logprobs) and extra["ref_logprobs"] == [f32(ref)]
    assert (got.reward, got.group_id, got.policy_version, got.sample_id) == (1.0, 9, 3, 4001)
    bus.clear(40)


def test_each_tokens_policy_version_reaches_the_trainer_ranks(bus):
    """A response whose tokens come from versions 6 and 7 (the weights changed while it generated) keeps them
    token for token through TransferQueue to the ranks' shards; one of a single version keeps None."""
    mixed = [6] * 700 + [7] * 301
    rows = [Sample(prompt_ids=[1, 2], response_ids=list(range(1001)), rollout_logprobs=[-0.5] * 1001,
                   policy_version=6, token_versions=mixed, sample_id=4100),
            Sample(prompt_ids=[3], response_ids=[4, 5], rollout_logprobs=[-0.25, -0.75], policy_version=7,
                   sample_id=4101),
            Sample(prompt_ids=[3], response_ids=[6, 7, 8], rollout_logprobs=[-1.0] * 3, policy_version=2**30,
                   token_versions=[2**30, 2**30 + 1, 2**30 + 2], sample_id=4102)]
    bus.put(42, rows)
    meta = bus.claim(42, 3)
    got = {s.sample_id: s for shard in bus.rank_shards(meta, 2) for s in bus.fetch(shard)[0]}
    assert got[4100].token_versions == mixed and got[4100].policy_version == 6
    assert got[4101].token_versions is None and got[4101].policy_version == 7
    assert got[4102].token_versions == [2**30, 2**30 + 1, 2**30 + 2]
    bus.clear(42)


def test_a_token_id_beyond_int32_is_refused_not_wrapped(bus):
    with pytest.raises(OverflowError):
        bus.put(41, [Sample(prompt_ids=[2**31], response_ids=[1], rollout_logprobs=[-1.0])])


def test_a_groups_media_is_stored_once_and_every_row_read_gets_it(bus, monkeypatch):
    """8 rows of one image prompt put the image's tensor once; a reader of any part of the group, the rows
    without the group's first row too, gets it on every row, as do the services that read `multimodal`."""
    import torch
    from transfer_queue.utils.zmq_utils import ZMQMessage

    from relax_core.data.bus import import_tq

    sent = []  # bytes of every message this process sends (puts go from the putting process)
    serialize = ZMQMessage.serialize

    def counted(message):
        frames = serialize(message)
        sent.append(sum(memoryview(f).nbytes for f in frames))
        return frames

    pixels = torch.randn(1024, 1176)  # 4.8 MB: 1024 patches of a 448x448 image (Qwen2-VL)
    image = {"pixel_values": pixels, "image_grid_thw": torch.tensor([[1, 32, 32]])}
    other = {"pixel_values": torch.randn(64, 1176), "image_grid_thw": torch.tensor([[1, 8, 8]])}
    rows = [Sample(prompt_ids=[1, 2, 3], response_ids=[4, k], rollout_logprobs=[-0.5, -0.25], group_id=77,
                   sample_id=600 + k, multimodal=image) for k in range(8)]
    rows += [Sample(prompt_ids=[9], response_ids=[8], rollout_logprobs=[-1.0], group_id=78, sample_id=608),
             Sample(prompt_ids=[5], response_ids=[6], rollout_logprobs=[-1.0], group_id=79, sample_id=609,
                    multimodal=other)]
    monkeypatch.setattr(ZMQMessage, "serialize", counted)
    bus.put(42, rows)
    monkeypatch.setattr(ZMQMessage, "serialize", serialize)
    tensors = pixels.nbytes + other["pixel_values"].nbytes
    assert tensors < sum(sent) < 1.1 * tensors  # each image once, not once per row

    def reference(columns):
        assert [m is not None and torch.equal(m["pixel_values"], pixels) for m in columns["multimodal"]] == \
            [True] * 3
        return [[0.0, 0.0]] * 3

    assert bus.process(42, "reference", ("prompt_ids", "multimodal"), "ref_logprobs", reference, 3) == 3
    meta = bus.claim(42, 10)
    late, _ = bus.fetch(meta.select_samples([5, 6, 7, 8, 9]))  # a rank given the group's last rows only
    early, _ = bus.fetch(meta.select_samples([0, 1, 2, 3, 4]))
    assert [s.sample_id for s in early + late] == [600 + k for k in range(10)]
    assert late[3].multimodal is None
    for got, want in [(s, image) for s in early + late[:3]] + [(late[4], other)]:
        assert got.multimodal.keys() == want.keys()
        for name, tensor in want.items():
            assert torch.equal(got.multimodal[name], tensor)
    assert late[0].multimodal is late[2].multimodal  # one tensor in the reader's memory too
    bus.clear(42)
    assert "step-42" not in import_tq().get_client().get_partition_list()  # the media rows went with it
