"""`multiple_choice`: GPQA/MMLU-style option letter extraction from free text.

Models answer "The answer is (C)", "**C**", "C) 42", "\\boxed{C}", "Answer: C"
or just "C". The extractor tries explicit answer statements first (the last
one wins, since models revise), then a bare option at the start of a line,
then a response that is a single letter. A statement that names two different
letters ("A or B") is a hedge and yields no answer.
"""

from __future__ import annotations

import re
from typing import Any

from relax_core.rewards.answers import all_boxed, strip_think
from relax_core.rewards.registry import reward

_STATEMENT = re.compile(
    r"(?i:(?:final\s+)?answer(?:\s+is)?|correct\s+(?:answer|option|choice)\s+is)"
    r"\s*(?:is)?\s*[:\-]?\s*([^\n]*)")
_BOLD = re.compile(r"\*\*\(?([A-J])\)?[\).:]?\*\*")
_LEADING = re.compile(r"^[ \t]*(?:\(([A-J])\)|([A-J])[\).:])", re.MULTILINE)
_ONLY = re.compile(r"^\W*([A-J])\W*$")
_FIRST = re.compile(r"^[\s\*\(\[\{:$]*([A-J])(?![A-Za-z])")
_HEDGE = re.compile(r"^[\s\*\)\]\}.]*(?:or|and|/|,|&)\s*[\*\(]*[A-J](?![A-Za-z])", re.IGNORECASE)


@reward("multiple_choice", in_process=True)
def multiple_choice(response: str, label: Any, metadata: dict | None = None) -> float:
    """1.0 when the option letter the response commits to equals the label's letter (A-J)."""
    gold = extract_choice(str(label))
    return float(gold is not None and extract_choice(response) == gold)


def extract_choice(text: str) -> str | None:
    """The single option letter `text` commits to, or None (no answer, or a hedge)."""
    text = strip_think(text).strip()
    if not text:
        return None
    only = _ONLY.match(text)
    if only:
        return only.group(1)
    for finder in (_from_boxed, _from_statement):
        letters = finder(text)
        if letters is not None:
            return letters
    bold = _BOLD.findall(text)
    if bold:
        return bold[-1]
    leading = [a or b for a, b in _LEADING.findall(text)]
    return leading[-1] if leading else None


def _from_boxed(text: str) -> str | None:
    boxed = all_boxed(text)
    return _single_letter(boxed[-1]) if boxed else None


def _from_statement(text: str) -> str | None:
    statements = _STATEMENT.findall(text)
    for statement in reversed(statements):
        letter = _single_letter(statement)
        if letter is not None:
            return letter
    return None


def _single_letter(fragment: str) -> str | None:
    """The option letter a short answer fragment starts with; None if none or a hedge ("A or B")."""
    fragment = re.sub(r"\\text(?:bf)?\{([^{}]*)\}", r"\1", fragment)
    first = _FIRST.match(fragment)
    if first is None or _HEDGE.match(fragment[first.end():]):
        return None
    return first.group(1)
