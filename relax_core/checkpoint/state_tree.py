"""Flatten a nested training state into DCP entries and put it back, keeping key types.

torch.distributed.checkpoint stores a flat mapping of dotted names to
tensors or pickled objects. Its own flattening turns every dict key into a
string, which breaks `torch.optim.Optimizer.load_state_dict` (its `state`
is keyed by int parameter index, and string keys are silently ignored). So
Relax flattens the state itself, the same way DCP does (dicts always,
lists only when they hold tensors or dicts), and stores the original paths
beside the data (`PATHS_KEY`), so loading can rebuild entries the caller's
template lacks, e.g. the Adam moments of a freshly built optimizer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

# One step of a path: the key, and whether the container holding it is a dict ("d") or a list ("l").
Step = tuple[Any, str]
Path_ = tuple[Step, ...]
PATHS_KEY = "_relax_paths"


def _descend(value: Any) -> bool:
    """Whether flattening goes inside `value` (DCP's rule, so names match its conventions)."""
    if isinstance(value, Mapping):
        return True
    if isinstance(value, list):
        return any(isinstance(v, (torch.Tensor, Mapping)) or (isinstance(v, list) and _descend(v)) for v in value)
    return False


def fqn(path: Path_) -> str:
    return ".".join(str(key) for key, _ in path)


def flatten(state: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Path_]]:
    """Leaves by dotted name, and each name's path with the original key objects."""
    flat: dict[str, Any] = {}
    paths: dict[str, Path_] = {}

    def visit(path: Path_, value: Any) -> None:
        if _descend(value):
            kind, items = ("d", value.items()) if isinstance(value, Mapping) else ("l", enumerate(value))
            for key, child in items:
                visit(path + ((key, kind),), child)
            return
        name = fqn(path)
        if name in flat:
            raise ValueError(f"two entries of the state flatten to the same name {name!r}; rename one")
        flat[name], paths[name] = value, path

    for key, value in state.items():
        visit(((key, "d"),), value)
    return flat, paths


def set_path(root: dict, path: Path_, value: Any) -> None:
    """Put `value` at `path` inside `root`, creating dicts and lists (of the saved kind) on the way."""
    node: Any = root
    for (key, _), (_, child_kind) in zip(path[:-1], path[1:]):
        node = _child(node, key, child_kind)
    _assign(node, path[-1][0], value)


def _assign(node: Any, key: Any, value: Any) -> None:
    if isinstance(node, list):
        node.extend([None] * (key + 1 - len(node)))
    node[key] = value


def _child(node: Any, key: Any, kind: str) -> Any:
    present = key < len(node) if isinstance(node, list) else key in node
    existing = node[key] if present else None
    if existing is None:
        existing = [] if kind == "l" else {}
        _assign(node, key, existing)
    return existing
