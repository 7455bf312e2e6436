"""A Hugging Face hub of our own on loopback: the few endpoints `huggingface_hub.snapshot_download` calls.

    GET  /api/{models,datasets}/ORG/NAME/revision/REV    repo_info: the commit (`sha`) and its files
    GET  /api/{models,datasets}/ORG/NAME/tree/REV[/DIR]  list_repo_tree: every file, size and blob id
    HEAD|GET /ORG/NAME/resolve/REV/FILE                  a model's file (headers: X-Repo-Commit, ETag, size)
    HEAD|GET /datasets/ORG/NAME/resolve/REV/FILE         a data set's file

Each repository is a local folder served at one fixed commit. An unknown repository answers 404 with
`X-Error-Code: RepoNotFound`, as the hub does. `requests` records every path asked for, so a test can
tell a download from a cache hit. Point `HF_ENDPOINT` at `url` (in a fresh process: huggingface_hub
reads it at import).
"""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


class FakeHub:
    def __init__(self, repos: dict[tuple[str, str], Path]):
        """`repos`: ("model" or "dataset", "Org/Name") -> the folder whose files the repository holds."""
        self.repos = {key: Path(folder) for key, folder in repos.items()}
        self.requests: list[str] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                hub._answer(self, body=True)

            def do_HEAD(self):
                hub._answer(self, body=False)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop serving and close the port: a client then gets "connection refused"."""
        if self._thread.is_alive():
            self.server.shutdown()
        self.server.server_close()

    # ------------------------------------------------------------------ answers
    def _answer(self, handler: BaseHTTPRequestHandler, body: bool) -> None:
        path = unquote(urlsplit(handler.path).path)
        self.requests.append(f"{handler.command} {path}")
        parts = path.strip("/").split("/")
        if parts[0] == "api" and len(parts) >= 6 and parts[1] in ("models", "datasets"):
            repo = (parts[1][:-1], "/".join(parts[2:4]))
            if parts[4] == "revision":
                return self._json(handler, repo, lambda files, sha: {
                    "id": repo[1], "sha": sha, "siblings": [{"rfilename": name} for name in files]})
            if parts[4] == "tree":
                prefix = "/".join(parts[6:])
                return self._json(handler, repo, lambda files, sha: [
                    {"type": "file", "path": name, "size": len(data), "oid": _blob_id(data)}
                    for name, data in files.items() if name.startswith(prefix)])
        kind = "dataset" if parts[0] == "datasets" else "model"
        parts = parts[1:] if kind == "dataset" else parts
        if len(parts) >= 5 and parts[2] == "resolve":
            return self._file(handler, (kind, "/".join(parts[:2])), "/".join(parts[4:]), body)
        return self._send(handler, 404, b"", {"X-Error-Code": "EntryNotFound"})

    def _json(self, handler, repo, make) -> None:
        files = self._files(repo)
        if files is None:
            return self._not_found(handler)
        self._send(handler, 200, json.dumps(make(files, _commit(files))).encode(),
                   {"Content-Type": "application/json"})

    def _file(self, handler, repo, name: str, body: bool) -> None:
        files = self._files(repo)
        if files is None:
            return self._not_found(handler)
        if name not in files:
            return self._send(handler, 404, b"", {"X-Error-Code": "EntryNotFound"})
        data = files[name]
        headers = {"X-Repo-Commit": _commit(files), "ETag": f'"{_blob_id(data)}"',
                   "Content-Type": "application/octet-stream"}
        self._send(handler, 200, data, headers, body=body)

    def _files(self, repo) -> dict[str, bytes] | None:
        folder = self.repos.get(repo)
        if folder is None:
            return None
        return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}

    def _not_found(self, handler) -> None:
        self._send(handler, 404, b'{"error": "Repository not found"}',
                   {"X-Error-Code": "RepoNotFound", "Content-Type": "application/json"})

    @staticmethod
    def _send(handler, status: int, data: bytes, headers: dict[str, str], body: bool = True) -> None:
        handler.send_response(status)
        for key, value in headers.items():
            handler.send_header(key, value)
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        if body and handler.command != "HEAD":
            handler.wfile.write(data)


def _blob_id(data: bytes) -> str:
    """Git's blob id of a file, as the hub reports it for a file not in LFS."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _commit(files: dict[str, bytes]) -> str:
    """One fixed commit per content: a folder served twice is the same revision."""
    digest = hashlib.sha1()
    for name, data in files.items():
        digest.update(name.encode() + b"\0" + _blob_id(data).encode())
    return digest.hexdigest()


MODEL_ID, DATA_ID = "relax-test/tiny-copy", "relax-test/copy-strings"


def tiny_repos(folder: Path) -> dict[tuple[str, str], Path]:
    """A tiny model (`MODEL_ID`) and a copy data set (`DATA_ID`: prompt/label columns, parquet files of a
    train and a test split, laid out as the hub's data sets are) to serve."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from relax_core.models import tiny

    model = tiny.materialize_tiny_model(folder / "model", alphabet="abcd")
    data = folder / "data-set" / "data"
    data.mkdir(parents=True)
    words = ["ab", "cd", "ba", "dc", "ac", "bd", "ca", "db"]
    pq.write_table(pa.table({"prompt": words, "label": words}), data / "train-00000-of-00001.parquet")
    pq.write_table(pa.table({"prompt": ["zz"], "label": ["zz"]}), data / "test-00000-of-00001.parquet")
    return {("model", MODEL_ID): model, ("dataset", DATA_ID): folder / "data-set"}


def hub_recipe(base: dict, **sections) -> dict:
    """A copy of `base` (a recipe as a dict) with the model and the data set of `tiny_repos` named by hub id."""
    import copy

    model = {"source": "hf", "path": MODEL_ID, "dtype": "float32"}
    data = {"source": "hub", "path": DATA_ID, "split": "train", "prompt_key": "prompt", "label_key": "label",
            "apply_chat_template": False}
    return copy.deepcopy(base) | {"model": model, "data": data} | sections
