"""When failing rewards end the run: a window over the last scored samples.

A reward that raises or times out scores 0 and the run goes on (hub.py), so
one bad sample costs one sample. A reward that fails on most samples would
instead train the model on zeros for hours; `FailureWindow` stops that run:
more than `reward.max_error_frac` x `reward.error_window` failures among the
last `reward.error_window` samples raise `RewardFailureError`, naming the
reward that failed most and its first error.
"""

from __future__ import annotations

import traceback
from collections import Counter, deque
from pathlib import Path


class RewardFailureError(RuntimeError):
    """Too many reward calls failed; the run stops (exit 1: it started, and wrote checkpoints and metrics)."""


def describe_error(exc: BaseException) -> str:
    """`Type: message (at file.py:line in function)`: what a reward failed with, and where."""
    text = f"{type(exc).__name__}: {exc}"
    frames = traceback.extract_tb(exc.__traceback__)
    if frames:
        last = frames[-1]
        text += f" (at {Path(last.filename).name}:{last.lineno} in {last.name})"
    return text


class FailureWindow:
    """The outcome of the last `size` samples; too many failures raise `RewardFailureError`.

    The limit counts against the whole window (`max_frac * size` failures), also
    before `size` samples were scored: a run that fails on every sample stops
    after `max_frac * size` of them, and a few failures early in a run never stop
    it alone. `max_frac=1.0` never stops a run.
    """

    def __init__(self, max_frac: float, size: int):
        self.max_frac, self.size = max_frac, size
        self._recent: deque[str | None] = deque(maxlen=size)  # the reward of a failed sample, None if scored
        self._first_error: dict[str, str] = {}

    def add(self, results) -> None:
        """Record a batch of `RewardResult`s, then stop the run if the window holds too many failures."""
        for result in results:
            failed = result.status != "ok"
            self._recent.append(result.reward if failed else None)
            if failed:
                self._first_error.setdefault(result.reward, result.error or result.status)
        self._check()

    def _check(self) -> None:
        failed = [name for name in self._recent if name is not None]
        if len(failed) <= self.max_frac * self.size:
            return
        name, _ = Counter(failed).most_common(1)[0]
        raise RewardFailureError(
            f"reward '{name}': {len(failed)} of the last {len(self._recent)} samples failed (errors or time-outs), "
            f"more than reward.max_error_frac={self.max_frac:g} of reward.error_window={self.size} allows; "
            f"its first error: {self._first_error[name]}. Fix the reward (try it on your outputs with "
            f"`relax reward score {name} --jsonl FILE`), or raise reward.max_error_frac to go on regardless")
