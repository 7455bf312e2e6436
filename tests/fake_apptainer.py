#!/usr/bin/env python3
"""A stand-in for `apptainer exec`, which cannot run on the test machine (no user namespaces for it).

    fake_apptainer.py exec [--cleanenv] [--nv] [--bind SPEC]... [--env K=V]... IMAGE COMMAND...

It does what the tests rely on apptainer for, as Apptainer documents it, and
then really runs COMMAND (on the host's root file system, with the binds'
paths where they already are):

- refuses an option it does not know, a bind source or an image that does not
  exist (`FATAL: ...`, exit 255), as apptainer does;
- builds the command's environment: with `--cleanenv` only HOME, TERM and
  LANG of the caller's, else all of it; then `APPTAINERENV_K` (or
  `SINGULARITYENV_K` where no `APPTAINERENV_K` is set) as `K`; then each
  `--env` value, read as one CSV record, last;
- PATH inside: the folders an image file that holds JSON `{"path": [...]}`
  lists (its stand-in executables, e.g. another Relax's `python3`), then the
  caller's PATH (the image's Python is the host's); its `"env"` mapping is the
  image's own environment, applied before `APPTAINERENV_*` and `--env`;
- appends `{"argv": ..., "env": ...}` of each call as a JSON line to
  `$FAKE_APPTAINER_LOG` when that is set.

Tests put it first on PATH as `apptainer` with `on_path`.
"""

from __future__ import annotations

import csv
import json
import os
import sys
from pathlib import Path

KEPT_BY_CLEANENV = ("HOME", "TERM", "LANG")


def on_path(folder: Path) -> str:
    """Make `folder/bin` hold this stand-in as `apptainer` and this interpreter as `python3` (the image's
    Python is the host's); returns the PATH that finds them first."""
    bin_dir = folder / "bin"
    bin_dir.mkdir()
    (bin_dir / "apptainer").write_text(f'#!/bin/sh\nexec {sys.executable} {Path(__file__).resolve()} "$@"\n')
    (bin_dir / "apptainer").chmod(0o755)
    (bin_dir / "python3").symlink_to(sys.executable)
    return f"{bin_dir}:{os.environ['PATH']}"


def fatal(message: str) -> None:
    print(f"FATAL:   {message}", file=sys.stderr)
    sys.exit(255)


def main() -> None:
    args = sys.argv[1:]
    if os.environ.get("FAKE_APPTAINER_LOG"):
        with open(os.environ["FAKE_APPTAINER_LOG"], "a") as log:
            log.write(json.dumps({"argv": sys.argv, "env": dict(os.environ)}) + "\n")
    if not args or args[0] != "exec":
        fatal(f"unknown command {args[:1]}")
    i, clean, binds, envs = 1, False, [], []
    while i < len(args) and args[i].startswith("-"):
        if args[i] in ("--nv", "--cleanenv"):
            clean |= args[i] == "--cleanenv"
            i += 1
        elif args[i] in ("--bind", "--env") and i + 1 < len(args):
            (binds if args[i] == "--bind" else envs).append(args[i + 1])
            i += 2
        else:
            fatal(f"unknown flag: {args[i]}")
    if len(args) < i + 2:
        fatal("exec needs an image and a command")
    image, command = Path(args[i]), args[i + 1:]
    if not image.is_file():
        fatal(f"could not open image {image}: no such file")
    for value in binds:
        for spec in next(csv.reader([value])):
            if not Path(spec.split(":")[0]).exists():
                fatal(f"container creation failed: mount {spec}: no such file or directory")
    try:
        manifest = json.loads(image.read_text())
    except (UnicodeDecodeError, ValueError):
        manifest = {}
    env = {k: os.environ[k] for k in KEPT_BY_CLEANENV if k in os.environ} if clean else dict(os.environ)
    env["PATH"] = os.pathsep.join([*manifest.get("path", []), os.environ.get("PATH", "")])
    env.update(manifest.get("env", {}))  # the image's own environment (%environment)
    for prefix in ("SINGULARITYENV_", "APPTAINERENV_"):  # APPTAINERENV_ wins
        env.update({k[len(prefix):]: v for k, v in os.environ.items() if k.startswith(prefix)})
    for value in envs:
        for pair in next(csv.reader([value])):
            key, _, val = pair.partition("=")
            env[key] = val
    os.execvpe(command[0], command, env)


if __name__ == "__main__":
    main()
