"""Step-wide advantages for the trainers' step (step.py): from per-sample token lists to the spec's estimator.

Sits between a backend's `_prepare` (which packs the step and runs the
no-grad forwards: old, reference and teacher log-probs) and the loss. Every
estimator of the algorithm suite (algorithms/estimators.py) and a token
selection (M2PO's) work on the *whole step* (all data-parallel ranks): whitening,
group baselines and the M2 threshold must not depend on how the batch was
split. Each rank therefore hands its samples' per-token values as plain
lists, the lists of all ranks are concatenated, padded to `[N, T]`, the
estimator runs once, and each rank keeps its own rows, again as lists.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from relax_core.algorithms.estimators import AdvantageBatch

Rows = list[list[float]]


@dataclass
class StepResult:
    """Per-sample rows of the step's advantages, token-selection keep mask (or None) and gae returns (or None)."""

    advantages: Rows
    keep: Rows | None = None
    returns: Rows | None = None

    def rows(self, start: int, stop: int) -> StepResult:
        """The samples start..stop (one rank's share)."""
        cut = (lambda rows: rows[start:stop] if rows is not None else None)  # noqa: E731
        return StepResult(self.advantages[start:stop], cut(self.keep), cut(self.returns))


@dataclass
class StepRows:
    """One rank's (or the whole step's) per-sample inputs of the estimator.

    Attributes:
        rewards / group_ids: one per sample.
        tokens: per-token lists by `AdvantageBatch` field name ("mask", "kl",
            "values", "logp", "logp_teacher") plus "logp_rollout" for a token selection.
    """

    rewards: list[float]
    group_ids: list[Any]
    tokens: dict[str, Rows] = field(default_factory=dict)

    @staticmethod
    def concat(parts: Sequence[StepRows]) -> StepRows:
        out = StepRows([], [], {key: [] for key in parts[0].tokens} if parts else {})
        for part in parts:
            out.rewards += part.rewards
            out.group_ids += part.group_ids
            for key, rows in part.tokens.items():
                out.tokens[key] += rows
        return out


def pad_rows(rows: Rows, width: int | None = None) -> torch.Tensor:
    """`[len(rows), width]` float32, right-padded with 0 (width: the longest row)."""
    width = max([len(r) for r in rows] + [0]) if width is None else width
    if not rows:
        return torch.zeros((0, width), dtype=torch.float32)
    # One tensor from padded Python lists: a copy per row costs more than the step's arithmetic.
    return torch.tensor([list(row[:width]) + [0.0] * (width - len(row)) for row in rows], dtype=torch.float32)


def cut_rows(values: torch.Tensor, lengths: Sequence[int]) -> Rows:
    """Inverse of `pad_rows`: each row cut to its length."""
    return [row[:n] for row, n in zip(values.tolist(), lengths)]


def dense_ids(group_ids: Sequence[Any]) -> list[int]:
    """Group ids may be any hashable; number them 0, 1, ... in order of appearance."""
    numbering: dict = {}
    return [numbering.setdefault(g, len(numbering)) for g in group_ids]


def step_advantages(
    estimator: Callable[..., Any],
    kwargs: dict[str, Any],
    step: StepRows,
    *,
    select: Callable[..., torch.Tensor] | None = None,
) -> StepResult:
    """Per-token advantages of every sample of the step, the token selection's keep mask and gae's returns.

    `step` holds the whole step (all ranks); `select(logp_old, logp_rollout, mask)` is the
    algorithm's token selection with its parameters bound. Returned rows have each
    sample's response length.
    """
    mask_rows = step.tokens["mask"]
    lengths = [len(r) for r in mask_rows]
    if not lengths:
        return StepResult([], [] if select is not None else None, [] if "values" in step.tokens else None)
    mask = pad_rows(mask_rows)
    extra = {key: pad_rows(rows, mask.shape[1]) for key, rows in step.tokens.items()
             if key in ("kl", "values", "logp", "logp_teacher")}
    batch = AdvantageBatch(torch.tensor(step.rewards, dtype=torch.float32), dense_ids(step.group_ids), mask, **extra)
    result = estimator(batch, **kwargs)
    returns = cut_rows(result.returns, lengths) if result.returns is not None else None
    keep = None
    if select is not None:
        logp_old = pad_rows(step.tokens["logp"], mask.shape[1])
        rollout = pad_rows(step.tokens["logp_rollout"], mask.shape[1])
        keep = cut_rows(select(logp_old, rollout, mask).float(), lengths)
    return StepResult(cut_rows(result.advantages, lengths), keep, returns)
