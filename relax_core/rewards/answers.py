"""Finding the final answer in a model's free text; shared by the built-in rewards.

Models wrap answers in `\\boxed{...}`, end with "Answer: ...", think aloud in
`<think>...</think>`, and get cut off mid-sentence. These helpers turn such
text into the candidate answer string(s) a reward then compares with the label.
"""

from __future__ import annotations

import re

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_ANSWER_LINE = re.compile(r"(?i)(?:final\s+answer|answer)\s*(?:is\s*:?|:)\s*([^\n]*)")
_THINK_OPEN, _THINK_CLOSE = "<think>", "</think>"


def strip_think(text: str) -> str:
    """The text after the reasoning block; "" when the reasoning never ended (truncated)."""
    if _THINK_CLOSE in text:
        return text.rsplit(_THINK_CLOSE, 1)[1]
    return "" if _THINK_OPEN in text else text


def all_boxed(text: str) -> list[str]:
    """Contents of every complete `\\boxed{...}` (braces balanced), in order.

    A `\\boxed{` whose braces never close (a truncated response) is skipped.
    """
    found = []
    for match in _BOXED.finditer(text):
        content = _balanced(text, match.end())
        if content is not None:
            found.append(content.strip())
    return found


def _balanced(text: str, start: int) -> str | None:
    """Text from `start` up to the brace that closes the one just before it."""
    depth = 1
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start:i]
    return None


def answer_line(text: str) -> str | None:
    """What follows the last "Answer:" / "The final answer is" on its line, cleaned."""
    matches = _ANSWER_LINE.findall(text)
    if not matches:
        return None
    answer = clean(matches[-1])
    return answer or None


def clean(answer: str) -> str:
    """Strip markdown emphasis, math delimiters and a trailing full stop."""
    answer = answer.strip().strip("*").strip()
    for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if answer.startswith(left) and answer.endswith(right) and len(answer) >= len(left) + len(right):
            answer = answer[len(left):len(answer) - len(right)].strip()
    return answer.rstrip(".").strip()


def final_answers(text: str) -> list[str]:
    """The candidate final answers: every boxed one, else the last answer line, else none."""
    text = strip_think(text)
    boxed = all_boxed(text)
    if boxed:
        return boxed
    line = answer_line(text)
    return [line] if line else []
