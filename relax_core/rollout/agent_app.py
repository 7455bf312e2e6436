"""Agent programs: one process per trajectory, talking to the policy through an OpenAI-compatible endpoint.

    rollout:
      agent: {command: "python agent.py", cwd: ., timeout_s: 60}

For each trajectory Relax starts `command` (with `/bin/sh -c`, in a process
group of its own) with:

    OPENAI_BASE_URL    http://127.0.0.1:PORT/v1   this process's endpoint (loopback only)
    OPENAI_API_KEY     the trajectory's id: a random token; a call with any other key is refused (401)
    RELAX_TASK_FILE    JSON {"prompt", "label", "metadata"}: the data row
    RELAX_REWARD_FILE  where the program writes its reward (a number)

so `openai.OpenAI().chat.completions.create(model=..., messages=...)` works
unchanged. Each call is generated on the trajectory's engine with the
recipe's sampling parameters (the program's `temperature`, `top_p`, ... are
ignored: the log-probs must be those of the policy the trainer learns from;
`max_tokens` only caps a call) and recorded as tokens:

    a call whose messages extend the previous call's (its messages + the reply it got)
        -> the new messages are rendered as the environment's tokens (loss mask 0), the reply as the
           model's (mask 1), in the same token sequence (chat_turns.py), as `rollout.env` does
    any other call (a program that rewrote the history)
        -> a new segment with its own prompt; each segment is one training sample with the trajectory's reward

Every token after a segment's prompt counts against `rollout.max_new_tokens`;
a call with no budget left gets an empty reply with finish reason "length".
A program still running after `timeout_s` is killed with its whole process
group, scores 0 and is counted (`agent/timeouts`); one that ends without a
readable reward file scores 0 and is counted (`agent/failures`), its output
logged. A trajectory that made no call still gives one sample (its prompt and
a masked end token), so each prompt keeps its n rewards.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import shutil
import subprocess
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request  # at module level: the handlers' annotations name Request

from relax_core.cluster.lifetime import Child
from relax_core.rollout.chat_turns import ChatTurns
from relax_core.rollout.multiturn import Trajectory, TurnFn
from relax_core.rollout.tools import parse_calls

log = logging.getLogger(__name__)

HOST = "127.0.0.1"  # the programs run beside the rollout manager
MODEL_NAME = "relax-policy"
MAX_SEGMENTS = 64  # manager.SEGMENT_STRIDE
POLL_S = 0.05


class RequestError(Exception):
    """A call the endpoint refuses (HTTP 400), with OpenAI's error shape."""


def _text(content: Any) -> str:
    """A message's content as text (OpenAI allows a list of parts)."""
    if content is None:
        return ""
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return str(content)


def _canonical(message: dict[str, Any]) -> tuple:
    """What must be equal for a call to continue the previous one's conversation."""
    calls = []
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        arguments = function.get("arguments")
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except ValueError:
            pass
        calls.append((function.get("name"), json.dumps(arguments, sort_keys=True)))
    return message.get("role"), _text(message.get("content")).strip(), tuple(calls)


def _for_template(message: dict[str, Any]) -> dict[str, Any]:
    out = {key: value for key, value in message.items() if value is not None}
    if "content" in message:
        out["content"] = _text(message["content"])
    return out


def _reply(text: str) -> dict[str, Any]:
    """The assistant message of a reply: Qwen `<tool_call>` blocks become OpenAI `tool_calls`."""
    calls = [c for c in parse_calls(text) if isinstance(c, dict)]
    if not calls:
        return {"role": "assistant", "content": text}
    content = text[:text.find("<tool_call>")].strip() or None
    return {"role": "assistant", "content": content, "tool_calls": [
        {"id": f"call_{uuid.uuid4().hex[:12]}", "type": "function",
         "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}} for c in calls]}


class Session:
    """One trajectory's calls, recorded as segments (see the module docstring); runs on the manager's loop."""

    def __init__(self, chat: ChatTurns, turn: TurnFn, max_new_tokens: int, max_prompt_len: int,
                 loop: asyncio.AbstractEventLoop) -> None:
        self.chat, self.turn, self.loop = chat, turn, loop
        self.max_new_tokens, self.max_prompt_len = max_new_tokens, max_prompt_len
        self.segments: list[Trajectory] = []
        self.history: list[list[tuple]] = []  # each segment's conversation so far, canonical
        self.calls = 0
        self.lock = asyncio.Lock()  # one call at a time: a trajectory is one sequence

    async def chat_completion(self, body: dict[str, Any]) -> dict[str, Any]:
        async with self.lock:
            return await self._completion(body)

    async def _completion(self, body: dict[str, Any]) -> dict[str, Any]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise RequestError("messages: a non-empty list of chat messages is required")
        if body.get("stream"):
            raise RequestError("stream: streaming is not supported by Relax's endpoint; send stream=false")
        if int(body.get("n") or 1) != 1:
            raise RequestError("n: one choice per call (each call is one turn of the trajectory)")
        segment, index = self._segment(messages, body.get("tools"))
        cap = body.get("max_completion_tokens") or body.get("max_tokens")
        left = self.max_new_tokens - len(segment.response_ids)
        limit = min(left, int(cap)) if cap else left
        if limit <= 0:
            self.history[index] = [_canonical(m) for m in messages] + [_canonical(_reply(""))]
            return self._completion_json(body, _reply(""), "length", len(segment.prompt_ids), 0)
        out = await self.turn(segment.prompt_ids + segment.response_ids, limit, self.calls)
        self.calls += 1
        text = self.chat.tokenizer.decode(out.output_ids, skip_special_tokens=True)
        last = out.output_ids[-1] if out.output_ids else None
        segment.add_model(out, text, closed=out.finish_reason == "stop" and self.chat.closes_turn(last))
        reply = _reply(text)
        self.history[index] = [_canonical(m) for m in messages] + [_canonical(reply)]
        finish = "tool_calls" if reply.get("tool_calls") else ("length" if out.finish_reason == "length" else "stop")
        return self._completion_json(body, reply, finish, len(segment.prompt_ids) + len(segment.response_ids)
                                     - len(out.output_ids), len(out.output_ids))

    def _segment(self, messages: list[dict], tools) -> tuple[Trajectory, int]:
        canonical = [_canonical(m) for m in messages]
        if self.segments:
            seen, segment = self.history[-1], self.segments[-1]
            if len(canonical) > len(seen) and canonical[:len(seen)] == seen:
                ids = self.chat.observation_ids([_for_template(m) for m in messages[len(seen):]], segment.closed)
                if len(segment.response_ids) + len(ids) < self.max_new_tokens:
                    segment.add_env(ids)
                    return segment, len(self.segments) - 1
                segment.finish_reason = "length"  # no room for these messages: the rest is a new segment
        if len(self.segments) >= MAX_SEGMENTS:
            raise RequestError(f"more than {MAX_SEGMENTS} calls that do not continue the previous conversation")
        prompt_ids = self.chat.prompt_ids([_for_template(m) for m in messages], tools=tools)
        if len(prompt_ids) > self.max_prompt_len:
            raise RequestError(f"messages: {len(prompt_ids)} tokens, more than rollout.max_prompt_len="
                               f"{self.max_prompt_len}")
        self.segments.append(Trajectory(prompt_ids))
        self.history.append([])
        return self.segments[-1], len(self.segments) - 1

    @staticmethod
    def _completion_json(body: dict, message: dict, finish: str, prompt_tokens: int, completion_tokens: int) -> dict:
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": str(body.get("model") or MODEL_NAME),
                "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                          "total_tokens": prompt_tokens + completion_tokens}}


def _error(status: int, message: str, kind: str):
    from fastapi.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": None}},
                        status_code=status)


def build_app(sessions: dict[str, Session]):
    """The endpoint: `POST /v1/chat/completions` and `GET /v1/models`, each trajectory by its key."""
    app = FastAPI(title="Relax agent endpoint", docs_url=None, redoc_url=None, openapi_url=None)

    def session_of(request: Request) -> Session | None:
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        return sessions.get(key) if scheme.lower() == "bearer" and key else None

    @app.get("/v1/models")
    async def models(request: Request):
        if session_of(request) is None:
            return _error(401, "unknown API key: each trajectory has its own (OPENAI_API_KEY)", "invalid_request_error")
        return {"object": "list", "data": [{"id": MODEL_NAME, "object": "model", "created": 0, "owned_by": "relax"}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        session = session_of(request)
        if session is None:
            return _error(401, "unknown API key: each trajectory has its own (OPENAI_API_KEY); this one has "
                               "ended or never existed", "invalid_request_error")
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "the body is not JSON", "invalid_request_error")
        if not isinstance(body, dict):
            return _error(400, "the body must be a JSON object", "invalid_request_error")
        future = asyncio.run_coroutine_threadsafe(session.chat_completion(body), session.loop)
        try:
            return await asyncio.wrap_future(future)
        except RequestError as exc:
            return _error(400, str(exc), "invalid_request_error")

    return app


class Endpoint:
    """The OpenAI-compatible server of one rollout process: uvicorn in a thread of its own, on loopback."""

    def __init__(self) -> None:
        import uvicorn

        from relax_core.cluster.ports import listening_socket

        self.sessions: dict[str, Session] = {}
        sock = listening_socket(HOST)
        self.url = f"http://{HOST}:{sock.getsockname()[1]}/v1"
        config = uvicorn.Config(build_app(self.sessions), log_level="warning", access_log=False, lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        name="relax-agent-endpoint", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the agent endpoint did not start on {self.url}")
            time.sleep(0.01)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)


class AgentPrograms:
    """Runs `rollout.agent` programs for the rollout manager (see the module docstring).

    Args:
        config: the recipe's `rollout.agent` (`AgentConfig`).
        chat: renders the calls' messages (chat_turns.py).
        max_new_tokens: each segment's budget after its prompt (`rollout.max_new_tokens`).
        max_prompt_len: a call whose new prompt is longer is refused (400).
    """

    def __init__(self, config, chat: ChatTurns, max_new_tokens: int, max_prompt_len: int) -> None:
        self.config, self.chat = config, chat
        self.max_new_tokens, self.max_prompt_len = max_new_tokens, max_prompt_len
        self.endpoint: Endpoint | None = None
        self._starting: asyncio.Lock | None = None  # the first trajectories of a step start the endpoint once
        self.workdir = Path(tempfile.mkdtemp(prefix="relax-agents-"))  # 0700: the tasks hold labels
        self._stats = self._zero()
        self._logged: set[str] = set()

    @staticmethod
    def _zero() -> dict[str, float]:
        return {"agent/timeouts": 0.0, "agent/failures": 0.0, "agent/calls": 0.0, "agent/programs": 0.0}

    def step_stats(self) -> dict[str, float]:
        """The programs' counts since the last call: time-outs, failures, and calls per program."""
        stats, self._stats = self._stats, self._zero()
        programs = max(stats.pop("agent/programs"), 1.0)
        stats["agent/calls_mean"] = stats.pop("agent/calls") / programs
        return stats

    async def run(self, row: dict[str, Any], turn: TurnFn) -> list[Trajectory]:
        if self._starting is None:
            self._starting = asyncio.Lock()
        async with self._starting:
            if self.endpoint is None:
                self.endpoint = await asyncio.to_thread(Endpoint)
        key = secrets.token_urlsafe(24)
        session = Session(self.chat, turn, self.max_new_tokens, self.max_prompt_len, asyncio.get_running_loop())
        folder = Path(tempfile.mkdtemp(prefix="t-", dir=self.workdir))
        self.endpoint.sessions[key] = session
        try:
            reward, status = await self._program(row, key, folder)
        finally:
            self.endpoint.sessions.pop(key, None)
            output = (folder / "output.log").read_text(errors="replace")[-2000:] if (folder / "output.log").exists() \
                else ""
            shutil.rmtree(folder, ignore_errors=True)
        self._stats["agent/programs"] += 1
        self._stats["agent/calls"] += session.calls
        if status != "ok":
            self._stats["agent/timeouts" if status == "timeout" else "agent/failures"] += 1
            if status not in self._logged:
                self._logged.add(status)
                log.warning("an agent program %s; it scores 0 (logged once per kind). Its output:\n%s",
                            status if status != "timeout" else f"ran past rollout.agent.timeout_s="
                            f"{self.config.timeout_s:g}s and was killed with its process group", output)
        segments = session.segments or [self._no_call(row)]
        for segment in segments:
            segment.reward = reward
        return segments

    def _no_call(self, row: dict[str, Any]) -> Trajectory:
        """A trajectory without a call: its prompt and a masked end token, so the prompt keeps n samples."""
        prompt = row["prompt"] if isinstance(row["prompt"], list) else [{"role": "user", "content": str(row["prompt"])}]
        traj = Trajectory(self.chat.prompt_ids(prompt)[: self.max_prompt_len])
        traj.add_env([self.chat.tokenizer.eos_token_id])
        return traj

    async def _program(self, row: dict[str, Any], key: str, folder: Path) -> tuple[float, str]:
        """Start the program, wait for it within its time limit, read its reward: (reward, status)."""
        cfg = self.config
        task, reward_file = folder / "task.json", folder / "reward"
        task.write_text(json.dumps({k: row.get(k) for k in ("prompt", "label", "metadata")}, default=str))
        env = dict(os.environ, OPENAI_BASE_URL=self.endpoint.url, OPENAI_API_KEY=key,
                   RELAX_TASK_FILE=str(task), RELAX_REWARD_FILE=str(reward_file))
        process = Child(["/bin/sh", "-c", cfg.command], log=folder / "output.log", cwd=cfg.cwd, env=env,
                        stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + cfg.timeout_s
        try:
            while process.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(POLL_S)
            timed_out = process.poll() is None
        finally:  # whatever it left behind (a hung call, a child it started) ends with it
            process.stop(grace_s=0)
        if timed_out:
            return 0.0, "timeout"
        try:
            return float(json.loads(reward_file.read_text())), "ok"
        except (OSError, ValueError, TypeError):
            return 0.0, f"exited with code {process.returncode} without writing a number to RELAX_REWARD_FILE"

    def close(self) -> None:
        if self.endpoint is not None:
            self.endpoint.stop()
            self.endpoint = None
        shutil.rmtree(self.workdir, ignore_errors=True)
