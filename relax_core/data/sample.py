"""The unit of data that flows from rollout to training.

A `Sample` is produced by the rollout manager (one per generated response),
scored by the reward hub, and consumed by the trainer. It is plain Python data
(lists, not tensors) so it crosses process boundaries (Ray, TransferQueue)
cheaply and without torch on the sending side; the one exception is
`multimodal`, the processor's tensors of a prompt's images, video and audio,
which travel as tensors (TransferQueue stores them as objects, never as JSON, once for the
samples that share them: data/bus.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Sample:
    """One response to one prompt, with what the trainer needs to learn from it.

    Attributes:
        prompt_ids: token ids of the prompt, chat template applied.
        response_ids: token ids the engine generated (stop/EOS token included
            when it was generated).
        rollout_logprobs: log-prob of each response token as reported by the
            engine, same length as `response_ids`.
        loss_mask: 1 for tokens the model generated and should learn from, 0
            for tokens it did not (tool output in multi-turn), same length as
            `response_ids`.
        reward: scalar outcome reward.
        group_id: samples answering the same prompt share a group id; the
            advantage estimators normalise within a group.
        policy_version: the oldest weight version among the tokens that generated it
            (the one a staleness bound is checked against).
        token_versions: the weight version that generated each response token, same
            length as `response_ids`, where the weights changed while it was generated
            (SGLang's `meta_info["weight_versions"]`); None: every token is
            `policy_version`'s. Tokens the model did not generate (an environment's)
            carry their turn's version.
        label: the reference answer the reward compared against.
        metadata: free-form per-sample data from the data set.
        finish_reason: "stop" (EOS or a stop token), "length" or "abort".
        sample_id: unique within a run (derived from step, round and position), so
            a sample can be followed from generation to the trainer.
        multimodal: the model inputs the processor made from the prompt's media
            (`pixel_values`, `image_grid_thw`, `pixel_values_videos`,
            `video_grid_thw`, `input_features`, `feature_attention_mask`, ...:
            CPU tensors, `models/multimodal.py`), matching the expanded
            placeholders in `prompt_ids`; None for a text prompt.
    """

    prompt_ids: list[int]
    response_ids: list[int]
    rollout_logprobs: list[float]
    reward: float = 0.0
    group_id: int = 0
    policy_version: int = 0
    loss_mask: list[int] = field(default_factory=list)
    label: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)
    finish_reason: str = "length"
    sample_id: int = -1
    multimodal: dict[str, Any] | None = None
    token_versions: list[int] | None = None

    def __post_init__(self) -> None:
        if not self.loss_mask:
            self.loss_mask = [1] * len(self.response_ids)
        if self.token_versions is not None and len(self.token_versions) != len(self.response_ids):
            raise ValueError(f"{len(self.token_versions)} token versions for {len(self.response_ids)} response tokens")

    @property
    def response_len(self) -> int:
        return len(self.response_ids)

    def version_counts(self) -> dict[int, int]:
        """How many response tokens each weight version generated (`{policy_version: 0}` for an empty response,
        so that the sample's version is still checked)."""
        if not self.token_versions:
            return {self.policy_version: self.response_len}
        counts: dict[int, int] = {}
        for version in self.token_versions:
            counts[version] = counts.get(version, 0) + 1
        return counts

    @property
    def num_tokens(self) -> int:
        """Prompt and response tokens: what the sample costs a trainer's forward and backward."""
        return len(self.prompt_ids) + len(self.response_ids)


def mixed_versions(token_versions: list[int]) -> list[int] | None:
    """`Sample.token_versions` of a response whose tokens have these versions: None when one version made
    them all (its `policy_version` says it)."""
    return list(token_versions) if len(set(token_versions)) > 1 else None


def length_stats(samples: list[Sample]) -> dict[str, float]:
    """A step's response lengths: mean, median and longest (a long tail shows as max >> median, and in the
    synchronous mode the step waits for its longest response)."""
    from statistics import fmean, median

    lengths = [s.response_len for s in samples]
    if not lengths:
        return {"response_len_mean": 0.0, "response_len_median": 0.0, "response_len_max": 0.0}
    return {"response_len_mean": fmean(lengths), "response_len_median": float(median(lengths)),
            "response_len_max": float(max(lengths))}


def group_order(samples: list[Sample]) -> list[list[Sample]]:
    """Samples grouped by `group_id`, groups in order of first appearance."""
    groups: dict[int, list[Sample]] = {}
    for sample in samples:
        groups.setdefault(sample.group_id, []).append(sample)
    return list(groups.values())
