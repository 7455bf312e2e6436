"""`f1`: token-level F1 for short-answer QA, with SQuAD-style normalisation.

The answer is the content of `<answer>...</answer>` if present, else the last
"Answer:" line, else the whole response after any reasoning block. Both sides
are lower-cased, stripped of punctuation and of the articles a/an/the, and
split on whitespace; F1 is the harmonic mean of token precision and recall.
A label may be one string or a list of acceptable answers (the best counts).
"""

from __future__ import annotations

import re
import string
from collections import Counter
from typing import Any

from relax_core.rewards.answers import answer_line, strip_think
from relax_core.rewards.registry import reward

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)


@reward("f1", in_process=True)
def f1(response: str, label: Any, metadata: dict | None = None) -> dict[str, float]:
    """Token F1 of the answer against the label (or best of a list of labels); `em` is exact match."""
    golds = label if isinstance(label, (list, tuple)) else [label]
    answer = extract_answer(response)
    scores = [(token_f1(answer, str(g)), float(normalise(answer) == normalise(str(g)))) for g in golds]
    best_f1, best_em = max(scores, default=(0.0, 0.0))
    return {"score": best_f1, "em": best_em}


def extract_answer(response: str) -> str:
    text = strip_think(response)
    tagged = _ANSWER_TAG.findall(text)
    if tagged:
        return tagged[-1]
    return answer_line(text) or text


def normalise(text: str) -> str:
    """SQuAD normalisation: lower case, no punctuation, no articles, single spaces."""
    text = text.lower().translate(_PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def token_f1(prediction: str, gold: str) -> float:
    pred, ref = normalise(prediction).split(), normalise(gold).split()
    if not pred or not ref:
        return float(pred == ref)
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)
