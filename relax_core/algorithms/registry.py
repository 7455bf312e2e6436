"""Name -> implementation of the RL algorithm pieces, filled where each function is defined.

Each implementation registers itself with a decorator next to its
definition (as verl does):

    @register_estimator("grpo")                  # estimators.py
    @register_loss("ppo_clip")                   # policy_losses.py
    @register_token_selection("m2")              # policy_losses.py
    @register_kl("k3", aliases=("low_var_kl",))  # kl.py
    @register_loss_agg("token-mean")             # aggregation.py

An algorithm's spec (config/algorithm_specs.py) names the pieces it is made of; the trainer
resolves those names here. The built-in implementations live in the torch
modules of `_HOMES`, which are imported the first time a name of their kind
is resolved, so importing this module (as recipe validation and `relax list
algorithms` do through the specs) imports no torch. A function defined
elsewhere (a test, a plug-in) is registered as soon as its module is imported.
Formulas: docs/algorithms.md.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

_PKG = "relax_core.algorithms"

# kind -> the module holding the built-in implementations of that kind (imported on first resolve).
_HOMES = {
    "estimator": f"{_PKG}.estimators",
    "loss": f"{_PKG}.policy_losses",
    "token_selection": f"{_PKG}.policy_losses",
    "kl": f"{_PKG}.kl",
    "loss_agg": f"{_PKG}.aggregation",
}
_TABLES: dict[str, dict[str, Callable[..., Any]]] = {kind: {} for kind in _HOMES}


def _register(kind: str, name: str, aliases: tuple[str, ...]) -> Callable[[Callable], Callable]:
    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        for key in (name, *aliases):
            if _TABLES[kind].get(key, fn) is not fn:
                raise ValueError(f"{kind} '{key}' is already registered ({_TABLES[kind][key].__qualname__})")
            _TABLES[kind][key] = fn
        return fn

    return decorate


def register_estimator(name: str, *, aliases: tuple[str, ...] = ()) -> Callable[[Callable], Callable]:
    """Register `fn(batch: AdvantageBatch, **params) -> AdvantageResult` (estimators.py)."""
    return _register("estimator", name, aliases)


def register_loss(name: str, *, aliases: tuple[str, ...] = ()) -> Callable[[Callable], Callable]:
    """Register `fn(logp, logp_old, advantages, *, mask, logp_rollout=None, **params) -> PolicyLossOutput`."""
    return _register("loss", name, aliases)


def register_token_selection(name: str, *, aliases: tuple[str, ...] = ()) -> Callable[[Callable], Callable]:
    """Register `fn(logp_old, logp_rollout, mask, **params) -> bool [B, T]`, run once over the whole step."""
    return _register("token_selection", name, aliases)


def register_kl(name: str, *, aliases: tuple[str, ...] = ()) -> Callable[[Callable], Callable]:
    """Register a per-token KL estimator `fn(logp, logp_ref) -> [B, T]`."""
    return _register("kl", name, aliases)


def register_loss_agg(name: str, *, aliases: tuple[str, ...] = ()) -> Callable[[Callable], Callable]:
    """Register `fn(loss, mask, *, global_tokens=None, global_seqs=None, norm_len=None) -> scalar`."""
    return _register("loss_agg", name, aliases)


def resolve(kind: str, name: str) -> Callable[..., Any]:
    """The implementation registered as `name` under `kind`; a KeyError naming the valid ones otherwise."""
    table = _table(kind)
    if name not in table:
        importlib.import_module(_HOMES[kind])
    if name not in table:
        raise KeyError(f"unknown {kind} '{name}'; valid names: {', '.join(sorted(table))}")
    return table[name]


def names(kind: str) -> list[str]:
    """Every name registered under `kind` (imports the built-in implementations)."""
    table = _table(kind)
    importlib.import_module(_HOMES[kind])
    return sorted(table)


def get_estimator(name: str) -> Callable[..., Any]:
    """An estimator of the batch interface: `fn(AdvantageBatch, **params) -> AdvantageResult`."""
    return resolve("estimator", name)


def get_loss(name: str) -> Callable[..., Any]:
    """A masked policy loss: `fn(logp, logp_old, advantages, *, mask, logp_rollout=None, **params)`."""
    return resolve("loss", name)


def get_token_selection(name: str) -> Callable[..., Any]:
    """A step-wide token selection: `fn(logp_old, logp_rollout, mask, **params) -> keep mask`."""
    return resolve("token_selection", name)


def get_kl_estimator(name: str) -> Callable[..., Any]:
    return resolve("kl", name)


def get_loss_aggregator(name: str) -> Callable[..., Any]:
    return resolve("loss_agg", name)


def _table(kind: str) -> dict[str, Callable[..., Any]]:
    if kind not in _TABLES:
        raise KeyError(f"unknown algorithm kind '{kind}'; valid kinds: {', '.join(_TABLES)}")
    return _TABLES[kind]
