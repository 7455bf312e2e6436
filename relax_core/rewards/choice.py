"""`multiple_choice`: GPQA/MMLU-style option letter extraction from free text.

Models answer "The answer is (C)", "I'd go with C).", "My choice: (D)",
"**C** is correct", "C) 42", "\\boxed{C}", "So: C)" or just "C", or wrap it in
`<answer>` tags ("<answer> C </answer>": its content is what counts). The extractor
tries, in order: a response that is one letter; the last `\\boxed{}`; the last
statement that commits to a letter (models revise, so the last one wins);
a bold letter; an option letter opening a line. A statement that names two
letters ("A or B") is a hedge and yields no answer.

A letter counts only as a word of its own ("Because" holds no B), and a
lower-case "a" or "i" followed by a word is the article or the pronoun
("a good answer is C" answers C, not A).
"""

from __future__ import annotations

import re
from typing import Any

from relax_core.rewards.answers import all_boxed, strip_think
from relax_core.rewards.registry import reward

# One option letter standing alone, maybe in brackets; not "a"/"i" used as a word.
_LETTER = r"(?<![\w\\])[\(\[]?(?P<letter>[A-Ja-j])(?![\w'’])(?!(?<=[ai])\s+[a-z=])"
_ADVERB = r"(?:(?:definitely|clearly|probably|likely|obviously|actually)\s+)?"
_OPTION = r"(?:(?:option|choice|letter)\s+)?"
_STATEMENTS = [re.compile(pattern, re.MULTILINE) for pattern in (
    # "The answer is B", "Final answer: B", "the correct choice is b", "My choice: (D)", "must be C"
    r"(?i:\b(?:answer|choice|option|pick|selection)\s*(?:(?:is|would\s+be|will\s+be|should\s+be|must\s+be)"
    rf"\s*:?|[:=\-])\s*{_ADVERB}{_OPTION}){_LETTER}",
    # "I'd go with C)", "I choose B)", "I pick B", "I'd say E", "it's B"
    r"(?i:\b(?:go(?:ing)?\s+(?:with|for)|choose|chose|pick|picked|select|selected|opt\s+for|say|it'?s|it\s+is"
    rf"|that'?s)\s+{_ADVERB}{_OPTION}){_LETTER}",
    # "B is correct", "A) is wrong, B) is right", "B is the correct answer"
    rf"{_LETTER}(?i:\)?\s*(?:is|seems|looks)\s+(?:the\s+)?(?:correct|right|best|true|answer)\b)",
    # a letter that ends a line after a conclusion: "So: B)", "Therefore, D", "option B"
    rf"(?i:\b(?:so|thus|therefore|hence|option|choice)\s*[:,]?\s*){_LETTER}\)?[.!]?[ \t]*$",
)]
_HEDGE = re.compile(r"[\s\)\]\}.]*(?i:or|and|/|,|&)\s*[\(\[]?[A-J](?![\w'])")
_MARKUP = re.compile(r"\\text(?:bf)?\{([^{}]*)\}|\\[()\[\]]|[*$]")
_BOLD = re.compile(r"\*\*\(?([A-J])\)?[\).:]?\*\*")
_LEADING = re.compile(r"^[ \t]*(?:\(([A-J])\)|([A-J])[\).:])", re.MULTILINE)
_ONLY = re.compile(r"^\W*([A-Ja-j])\W*$")
_FIRST = re.compile(rf"^\W*?{_LETTER}")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


@reward("multiple_choice", in_process=True)
def multiple_choice(response: str, label: Any, metadata: dict | None = None) -> float:
    """1.0 when the option letter the response commits to equals the label's letter (A-J)."""
    gold = extract_choice(str(label))
    return float(gold is not None and extract_choice(response) == gold)


def extract_choice(text: str) -> str | None:
    """The single option letter (upper case) `text` commits to, or None (no answer, or a hedge). A response
    (or label) with `<answer>...</answer>` tags, as R1-style system prompts ask for, is judged by what
    its last tags hold."""
    text = strip_think(text).strip()
    tagged = _ANSWER_TAG.findall(text)
    if tagged:
        text = tagged[-1].strip()
    only = _ONLY.match(text)
    if only:
        return only.group(1).upper()
    boxed = all_boxed(text)
    if boxed:
        first = _FIRST.match(_plain(boxed[-1]))
        return _committed(first.string, first.end("letter")) if first else None
    plain = _plain(text)
    ends = [m.end("letter") for pattern in _STATEMENTS for m in pattern.finditer(plain)]
    if ends:
        return _committed(plain, max(ends))
    bold = _BOLD.findall(text)
    if bold:
        return bold[-1]
    leading = [a or b for a, b in _LEADING.findall(plain)]
    return leading[-1] if leading else None


def _plain(text: str) -> str:
    """`text` without markdown emphasis, math delimiters and `\\text{}` wrappers."""
    return _MARKUP.sub(lambda m: m.group(1) or "", text)


def _committed(text: str, end: int) -> str | None:
    """The letter just before `end`, unless a second letter follows it ("A or B": a hedge)."""
    return None if _HEDGE.match(text, end) else text[end - 1].upper()
