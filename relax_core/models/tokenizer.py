"""The one way the driver and the rollout service load a model directory's tokenizer.

`AutoTokenizer` imports transformers' configuration code, which imports torch: about 1.6 s of CPU
on the start-up's critical path of a process that needs no torch otherwise. A directory whose
`tokenizer_config.json` names the plain `tokenizers`-backed class (`TokenizersBackend`, formerly
`PreTrainedTokenizerFast`: the tiny models' and many exported checkpoints') is loaded with that class
directly, which is the class `AutoTokenizer` would pick (unless an `auto_map` names code of its own); any
other goes through `AutoTokenizer`.
"""

from __future__ import annotations

import json
from pathlib import Path

PLAIN_FAST = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})


def load_tokenizer(model_dir: str | Path, trust_remote_code: bool = False):
    try:
        config = json.loads((Path(model_dir) / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        config = {}
    if config.get("tokenizer_class") in PLAIN_FAST and "auto_map" not in config:  # no code of its own
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(model_dir)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
