"""`openr1mm`: the multimodal Open-R1 reward, accuracy plus format.

Accuracy: the content of the last `<answer>...</answer>` against the label,
checked with math-verify when the label is mathematical, else as an option
letter (multiple choice) or as normalised text. Format: 1 when the whole
response is `<think>...</think>` followed by `<answer>...</answer>` and
nothing else. The score is their sum (0, 1 or 2), as in Open-R1-multimodal
where the two are separate rewards that are added.
"""

from __future__ import annotations

import re
from typing import Any

from relax_core.rewards.choice import extract_choice
from relax_core.rewards.math_rewards import equivalent
from relax_core.rewards.qa import normalise as normalise_text
from relax_core.rewards.registry import reward

_FORMAT = re.compile(r"^\s*<think>(?:(?!</?think>).)*</think>\s*<answer>(?:(?!</?answer>).)*</answer>\s*$",
                     re.DOTALL)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_LETTER_LABEL = re.compile(r"^\(?([A-J])\)?$")


@reward("openr1mm")
def openr1mm(response: str, label: Any, metadata: dict | None = None) -> dict[str, float]:
    """Open-R1 multimodal: score = accuracy of <answer> + format (<think>..</think><answer>..</answer>)."""
    accuracy = answer_accuracy(response, str(label))
    fmt = float(bool(_FORMAT.match(response)))
    return {"score": accuracy + fmt, "accuracy": accuracy, "format": fmt}


def answer_accuracy(response: str, label: str) -> float:
    answers = _ANSWER.findall(response)
    if not answers or not answers[-1].strip():
        return 0.0
    answer, label = answers[-1].strip(), _strip_tags(label)
    if _LETTER_LABEL.match(label):
        return float(extract_choice(answer) == _LETTER_LABEL.match(label).group(1))
    if normalise_text(answer) == normalise_text(label):
        return 1.0
    return float(equivalent(answer, label))


def _strip_tags(label: str) -> str:
    tagged = _ANSWER.findall(label)
    return (tagged[-1] if tagged else label).strip()
