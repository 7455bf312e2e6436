"""Token ids of a conversation that grows turn by turn, without re-rendering what the model said.

A multi-turn trajectory is one token sequence:

    prompt (chat template, assistant turn opened) | model turn 1 | environment | model turn 2 | ...

The model's turns are kept exactly as the engine generated them (re-tokenizing
their text could give other ids, and a template such as Qwen3's renders an
earlier assistant turn differently from the last one), so only what the
environment adds is rendered: the rest of the template's closing of the model's
turn (`<|im_end|>` unless the model generated it, then `\\n`), the new user or
tool messages, and the next assistant turn opened. That text is what the chat
template writes for those messages after a conversation, found by rendering
marker conversations once; it is tokenized alone, so its ids are exactly the
ids the trainer sees with loss mask 0.

Without a chat template (`data.apply_chat_template: false`) an observation's
text is appended as it is.
"""

from __future__ import annotations

from typing import Any

from relax_core.errors import UserError

_USER, _MODEL, _NEXT = "\u2063relax-user\u2063", "\u2063relax-model\u2063", "\u2063relax-next\u2063"


class ChatTurns:
    """Renders a trajectory's prompt and the environment's turns for one tokenizer.

    Args:
        tokenizer: the policy's tokenizer (with its chat template).
        chat_template: `data.apply_chat_template`.
        system_prompt: put before a prompt that has no system message.
    """

    def __init__(self, tokenizer, chat_template: bool = True, system_prompt: str | None = None) -> None:
        self.tokenizer, self.chat_template, self.system_prompt = tokenizer, chat_template, system_prompt
        self._closing: str | None = None

    def _render(self, messages: list[dict], generation: bool = False, tools=None) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=generation,
                                                  tokenize=False)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt_ids(self, prompt: str | list[dict[str, Any]], tools: list | None = None) -> list[int]:
        """The first prompt: the template with the assistant's turn opened (or the text alone)."""
        if not self.chat_template:
            if not isinstance(prompt, str):
                raise UserError("data.apply_chat_template: an environment's first observation is a list of chat "
                                "messages, which only the chat template turns into text; set it to true")
            return list(self.tokenizer.encode(prompt))
        messages = list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]
        if self.system_prompt and messages[0].get("role") != "system":
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        ids = self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    @property
    def closing(self) -> str:
        """What the template writes after an assistant message's content, before the next message."""
        if self._closing is None:
            self._closing = self._find_closing() if self.chat_template else ""
        return self._closing

    def _find_closing(self) -> str:
        user, nxt = {"role": "user", "content": _USER}, {"role": "user", "content": _NEXT}
        whole = self._render([user, {"role": "assistant", "content": _MODEL}, nxt])
        after_user = self._render([user, nxt])[len(self._render([user])):]
        start = whole.find(_MODEL)
        end = whole.find(after_user, start) if start >= 0 else -1
        if start < 0 or end < 0:
            raise UserError("the model's chat template does not render a conversation the way multi-turn rollouts "
                            "need (an assistant message, then a user message after it, each once); give the model "
                            "a standard chat template")
        return whole[start + len(_MODEL):end]

    def observation_ids(self, messages: list[dict[str, Any]], closed: bool) -> list[int]:
        """The ids the environment adds after a model turn: the turn's closing (all of it, or without its first
        token when the model generated that one: `closed`), `messages` and the assistant's next turn opened.
        Without a chat template: the messages' text."""
        if not self.chat_template:
            return self._encode("".join(str(m.get("content") or "") for m in messages))
        closing = self._encode(self.closing)
        if closed and closing:
            closing = closing[1:]
        user = [{"role": "user", "content": _USER}]
        before = self._render(user)
        after = self._render(user + list(messages), generation=True)
        if not after.startswith(before):
            raise UserError("the model's chat template renders earlier messages differently once more follow; "
                            "multi-turn rollouts need a template that only appends")
        return closing + self._encode(after[len(before):])

    def closes_turn(self, last_token: int | None) -> bool:
        """Whether a model turn ending in `last_token` generated the first token of the closing (`<|im_end|>`)."""
        closing = self._encode(self.closing) if self.chat_template else []
        return bool(closing) and last_token == closing[0]
