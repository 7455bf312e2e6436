"""Command line of the CPU engine (flags named like `sglang.launch_server`'s).

    python -m relax_core.rollout.cpu_engine --model-path DIR --host 127.0.0.1 --port 30000 \
        [--api-key TOKEN] [--max-running-requests N] [--seed S] [--trust-remote-code] [--enable-memory-saver]

Loads the model, then serves; prints `READY_PREFIX ...` once it accepts
connections (the launcher in `relax_core.cluster` and the tests wait for
`/health` or for that line).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

READY_PREFIX = "relax-cpu-engine ready"
# How long an idle client connection stays open: SGLang's SGLANG_TIMEOUT_KEEP_ALIVE (srt/environ.py, 5 s by
# default), read from the same variable, which Relax sets for the engines it starts (rollout/router.py).
KEEP_ALIVE_DEFAULT_S = 5


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m relax_core.rollout.cpu_engine", description=__doc__.split("\n")[0])
    p.add_argument("--model-path", required=True, help="Hugging Face model directory")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (only this one)")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--fd", type=int, default=None,
                   help="serve on this inherited, already listening socket (its address is --host:--port)")
    p.add_argument(
        "--api-key",
        default=os.environ.get("RELAX_ENGINE_API_KEY"),
        help="require 'Authorization: Bearer KEY' on all but /health* (default: $RELAX_ENGINE_API_KEY, "
        "which keeps the key out of the process list)",
    )
    p.add_argument("--max-running-requests", type=int, default=128, help="rows decoded together at most")
    p.add_argument("--seed", "--random-seed", dest="seed", type=int, default=0, help="server sampling seed")
    p.add_argument("--weight-version", default="default", help="initial weight version reported")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--trust-remote-code", action="store_true", help="run the code the model directory ships")
    p.add_argument("--enable-memory-saver", action="store_true",
                   help="allow /release_memory_occupation and /resume_memory_occupation (colocate)")
    p.add_argument("--num-threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument("--log-level", default="warning")
    # How a video is sampled into frames: the rollout side's `data.video_fps/min_frames/max_frames`, so the engine
    # reads the same frames as the trainer (SGLang samples with its own settings).
    p.add_argument("--video-fps", type=float, default=None, help="frames per second of video sampled")
    p.add_argument("--video-min-frames", type=int, default=None, help="fewest frames sampled from a video")
    p.add_argument("--video-max-frames", type=int, default=None, help="most frames sampled from a video")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch
    import uvicorn

    from relax_core.rollout.cpu_engine.server import create_app, load_engine_state

    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    state = load_engine_state(
        args.model_path,
        dtype=args.dtype,
        max_running=args.max_running_requests,
        seed=args.seed,
        weight_version=args.weight_version,
        trust_remote_code=args.trust_remote_code,
        enable_memory_saver=args.enable_memory_saver,
        video={k: v for k, v in (("video_fps", args.video_fps), ("video_min_frames", args.video_min_frames),
                                 ("video_max_frames", args.video_max_frames)) if v is not None},
    )
    app = create_app(state, api_key=args.api_key)
    from relax_core.rollout.router import KEEP_ALIVE_ENV

    keep_alive = int(os.environ.get(KEEP_ALIVE_ENV, KEEP_ALIVE_DEFAULT_S))
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False,
                            timeout_keep_alive=keep_alive)

    class _Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets=sockets)
            if self.started:
                print(f"{READY_PREFIX} on http://{args.host}:{args.port} model={args.model_path}", flush=True)

    # A socket handed over by the launcher: it chose the port by binding it, so no one else can take it.
    sockets = [socket.socket(fileno=args.fd)] if args.fd is not None else None
    try:
        _Server(config).run(sockets=sockets)
    finally:
        state.batcher.stop()
    sys.exit(0)


if __name__ == "__main__":
    main()
