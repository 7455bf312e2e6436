"""Math rewards: `math` (equivalence checked with math-verify) and `dapo` (+1 / -1).

Both take the final answer from the response (answers.py) and compare it with
the label. Sympy can take very long on adversarial expressions, so these run
in the hub's worker processes with a time limit; math-verify's own
signal-based limits are used as well when called on a main thread.
"""

from __future__ import annotations

import re
import threading
from typing import Any

from relax_core.rewards.answers import all_boxed, answer_line, clean, final_answers, strip_think
from relax_core.rewards.registry import reward

_VERIFY_TIMEOUT_S = 5


@reward("math")
def math_reward(response: str, label: Any, metadata: dict | None = None) -> float:
    """1.0 when the final answer (\\boxed{} or an "Answer:" line) equals the label mathematically (math-verify).

    Every boxed answer must be right: a response that boxes two different
    answers (hedging) scores 0. A response with no complete answer (empty,
    truncated) scores 0.
    """
    candidates = final_answers(response)
    if not candidates:
        return 0.0
    return float(all(equivalent(c, str(label)) for c in candidates))


def equivalent(answer: str, label: str) -> bool:
    """`answer` and `label` denote the same value (math-verify), or read the same once normalised."""
    if normalise(answer) == normalise(label):
        return True
    gold, pred = _parse(label), _parse(answer)
    if not gold or not pred:
        return False
    from math_verify import verify

    return bool(verify(gold, pred, timeout_seconds=_timeout()))


def _parse(text: str) -> list:
    try:
        from math_verify import parse
    except ImportError:
        raise ImportError("the math rewards need math-verify: pip install math-verify==0.9.0") from None

    inner = all_boxed(text)
    text = clean(inner[-1] if inner else text)
    return parse(f"${text}$", parsing_timeout=_timeout())


def _timeout() -> int | None:
    # math-verify's limits use signal.alarm, which only works on the main thread
    return _VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


# ----------------------------------------------------------------------- dapo
_UNIT_WORDS = ("degrees", "degree", "units", "unit", "dollars", "cents", "cm", "meters", "inches", "feet",
               "hours", "minutes", "seconds", "mph", "km", "square", "ways", "points", "students")


@reward("dapo")
def dapo(response: str, label: Any, metadata: dict | None = None) -> dict[str, float]:
    """DAPO-Math-17k: score +1 when the last "Answer:" line (or last \\boxed{}) is right, else -1; `acc` is 1/0."""
    predicted = _dapo_answer(response)
    right = predicted is not None and (
        normalise(predicted) == normalise(str(label)) or equivalent(predicted, str(label)))
    return {"score": 1.0 if right else -1.0, "acc": float(right)}


def _dapo_answer(response: str) -> str | None:
    # the DAPO prompt asks for a last line "Answer: $Answer"; a boxed answer is accepted too
    text = strip_think(response)
    line = answer_line(text)
    if line is not None:
        return line
    boxed = all_boxed(text)
    return boxed[-1] if boxed else None


def normalise(answer: str) -> str:
    """A canonical string form: no TeX wrappers, units, spaces or thousands separators."""
    text = clean(answer)
    boxed = all_boxed(text)
    text = boxed[-1] if boxed else text
    text = re.sub(r"\\(?:text|textbf|mathrm|mbox)\s*\{([^{}]*)\}", r"\1", text)
    text = text.replace("\\!", "").replace("\\,", "").replace("\\ ", "").replace("\\%", "").replace("%", "")
    text = text.replace("dfrac", "frac").replace("tfrac", "frac").replace("\\left", "").replace("\\right", "")
    text = text.split("=")[-1]
    for word in _UNIT_WORDS:
        text = re.sub(rf"(?<=\d)\s*{word}\b", "", text)
    text = re.sub(r"(?<=\d),(?=\d{3}\b)", "", text)
    return text.replace(" ", "").rstrip(".").lower()


__all__ = ["math_reward", "dapo", "equivalent", "normalise", "strip_think"]
