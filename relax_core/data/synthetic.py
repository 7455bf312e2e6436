"""Synthetic verifiable tasks for the quick start and the tests.

No data set is downloaded anywhere in Relax's tests or its CPU quick start;
this module generates prompt/label pairs from a seed instead. It sits where a
data set loader would: the controller draws prompts from it, the rollout
engine answers them, and the reward hub compares answers with the labels.

Item `i` of a task depends only on (kind, seed, i), so a run resumes at the
exact data position by restoring the cursor (`state_dict`/`load_state_dict`).
Tasks:
  copy     prompt "cab"      label "cab"
  reverse  prompt "cab"      label "bac"
  add      prompt "12+7="    label "19"
The prompt is the user message; the chat template is applied by the caller.
Importing this module imports no torch.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

TASKS = ("copy", "reverse", "add")
DEFAULT_ALPHABET = "abcdefgh"


@dataclass
class SyntheticTask:
    """A deterministic, resumable stream of `{"prompt", "label", "metadata"}` items.

    Attributes:
        kind: "copy", "reverse" or "add".
        seed: the stream's seed; the same seed gives the same items.
        alphabet: symbols of the random strings (copy/reverse).
        min_len / max_len: string length (copy/reverse) or digit count of
            each operand (add), inclusive range.
        cursor: index of the next item `next()` returns.
    """

    kind: str = "copy"
    seed: int = 0
    alphabet: str = DEFAULT_ALPHABET
    min_len: int = 3
    max_len: int = 3
    cursor: int = 0

    def __post_init__(self) -> None:
        if self.kind not in TASKS:
            raise ValueError(
                f"unknown synthetic task '{self.kind}'; valid: {', '.join(TASKS)}"
            )
        if not 1 <= self.min_len <= self.max_len:
            raise ValueError(
                f"need 1 <= min_len <= max_len, got {self.min_len}, {self.max_len}"
            )
        if self.kind != "add" and not self.alphabet:
            raise ValueError("alphabet must not be empty")

    def item(self, index: int) -> dict:
        """Item `index` of the stream (independent of the cursor)."""
        rng = random.Random(f"{self.kind}:{self.seed}:{index}")
        if self.kind == "add":
            a, b = (self._number(rng) for _ in range(2))
            return self._make(f"{a}+{b}=", str(a + b))
        text = "".join(
            rng.choice(self.alphabet)
            for _ in range(rng.randint(self.min_len, self.max_len))
        )
        return self._make(text, text if self.kind == "copy" else text[::-1])

    def _number(self, rng: random.Random) -> int:
        digits = rng.randint(self.min_len, self.max_len)
        return rng.randint(0, 10**digits - 1)

    def _make(self, prompt: str, label: str) -> dict:
        return {"prompt": prompt, "label": label, "metadata": {"task": self.kind}}

    def __iter__(self) -> Iterator[dict]:
        return self

    def __next__(self) -> dict:
        item = self.item(self.cursor)
        self.cursor += 1
        return item

    def next_batch(self, n: int) -> list[dict]:
        """The next `n` items, advancing the cursor."""
        return [next(self) for _ in range(n)]

    def state_dict(self) -> dict:
        return {"cursor": self.cursor}

    def load_state_dict(self, state: dict) -> None:
        self.cursor = int(state["cursor"])

    def symbols(self) -> str:
        """Every character a prompt or label can contain (for building a tokenizer)."""
        return "0123456789+=" if self.kind == "add" else self.alphabet
