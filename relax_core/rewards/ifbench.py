"""`ifbench`: verifiable instruction-following checks (a subset of IFEval/IFBench).

The instructions of a row come from `metadata["instructions"]`, or from the
label, as a list of `{"type": ..., <arguments>}` (a JSON string is accepted).
Each check is one small function `check(response, **arguments) -> bool`
registered in `CHECKS`. The score is the fraction of checks passed ("loose"
credit, gives a signal early); `all` is 1 only when every check passes. An
unknown check type is an error (the sample scores 0 and is counted), so a
typo in a data set shows up in the step metrics instead of as free reward.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from relax_core.rewards.answers import strip_think
from relax_core.rewards.registry import reward

CHECKS: dict[str, Callable[..., bool]] = {}


def check(name: str):
    def decorate(fn):
        CHECKS[name] = fn
        return fn
    return decorate


def _compare(count: int, relation: str, num: int) -> bool:
    relations = {"at least": count >= num, "at most": count <= num, "less than": count < num,
                 "more than": count > num, "exactly": count == num}
    if relation not in relations:
        raise ValueError(f"relation must be one of {sorted(relations)}, got '{relation}'")
    return relations[relation]


def _words(text: str) -> list[str]:
    return re.findall(r"\b[\w'-]+\b", text)


@check("word_count")
def word_count(response: str, num: int, relation: str = "at least") -> bool:
    return _compare(len(_words(response)), relation, num)


@check("sentence_count")
def sentence_count(response: str, num: int, relation: str = "at least") -> bool:
    sentences = [s for s in re.split(r"(?<=[.!?])\s+", response.strip()) if _words(s)]
    return _compare(len(sentences), relation, num)


@check("paragraph_count")
def paragraph_count(response: str, num: int, relation: str = "exactly") -> bool:
    """Paragraphs are separated by blank lines or by a line of `***`."""
    parts = re.split(r"\n\s*\n|\n\s*\*\*\*\s*\n", response.strip())
    return _compare(len([p for p in parts if p.strip()]), relation, num)


@check("include_keywords")
def include_keywords(response: str, keywords: list[str]) -> bool:
    return all(re.search(rf"\b{re.escape(k)}\b", response, re.IGNORECASE) for k in keywords)


@check("exclude_keywords")
def exclude_keywords(response: str, keywords: list[str]) -> bool:
    return not any(re.search(rf"\b{re.escape(k)}\b", response, re.IGNORECASE) for k in keywords)


@check("keyword_frequency")
def keyword_frequency(response: str, keyword: str, num: int, relation: str = "at least") -> bool:
    count = len(re.findall(rf"\b{re.escape(keyword)}\b", response, re.IGNORECASE))
    return _compare(count, relation, num)


@check("json_format")
def json_format(response: str) -> bool:
    """The whole response is JSON (a ```json fence around it is allowed)."""
    text = re.sub(r"^```(?:json)?\s*|\s*```$", "", response.strip())
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


@check("lowercase")
def lowercase(response: str) -> bool:
    return response == response.lower() and any(c.isalpha() for c in response)


@check("uppercase")
def uppercase(response: str) -> bool:
    return response == response.upper() and any(c.isalpha() for c in response)


@check("end_phrase")
def end_phrase(response: str, phrase: str) -> bool:
    return response.strip().endswith(phrase.strip())


@check("start_phrase")
def start_phrase(response: str, phrase: str) -> bool:
    return response.strip().startswith(phrase.strip())


@check("no_commas")
def no_commas(response: str) -> bool:
    return "," not in response


@reward("ifbench", in_process=True)
def ifbench(response: str, label: Any, metadata: dict | None = None) -> dict[str, float]:
    """Instruction following: fraction of the row's checks (word counts, keywords, JSON, case, ...) passed."""
    instructions = _instructions(label, metadata or {})
    text = strip_think(response)
    passed = [_run(item, text) for item in instructions]
    return {"score": sum(passed) / len(passed), "all": float(all(passed))}


def _instructions(label: Any, metadata: dict) -> list[dict]:
    spec = metadata.get("instructions", label)
    if isinstance(spec, str):
        spec = json.loads(spec)
    if isinstance(spec, dict):
        spec = [spec]
    if not isinstance(spec, list) or not spec or not all(isinstance(i, dict) for i in spec):
        raise ValueError("ifbench needs a non-empty list of {'type': ...} instructions "
                         "in metadata['instructions'] or the label")
    return spec


def _run(instruction: dict, response: str) -> bool:
    kind = instruction.get("type")
    if kind not in CHECKS:
        raise ValueError(f"unknown ifbench check '{kind}'; known: {', '.join(sorted(CHECKS))}")
    arguments = {k: v for k, v in instruction.items() if k != "type"}
    return bool(CHECKS[kind](response, **arguments))
