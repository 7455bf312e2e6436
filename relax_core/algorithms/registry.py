"""Name -> implementation tables for the RL algorithm pieces.

A recipe names its advantage estimator, policy loss, KL estimator and loss
aggregation by string; the trainer resolves those strings here. The tables
hold dotted paths ("module:function") and import the implementation only when
it is asked for, so importing this module (as `relax list algorithms` does)
pulls in no torch. Formulas: /work/shared/ALGORITHMS.md.

Kinds "estimator" and "loss" are the algorithm suite's uniform interfaces
(estimators.py, policy_losses.py) that `AlgorithmSpec` names refer to;
"advantage" and "policy_loss" are the older per-sample / unmasked forms.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

_PKG = "relax_core.algorithms"

# kind -> name -> "module:attribute" (lazy) or a callable (registered at run time).
_TABLES: dict[str, dict[str, str | Callable[..., Any]]] = {
    "advantage": {
        "grpo": f"{_PKG}.advantages:grpo",
        "dr_grpo": f"{_PKG}.advantages:dr_grpo",
        "rloo": f"{_PKG}.advantages:rloo",
    },
    "policy_loss": {
        "ppo_clip": f"{_PKG}.losses:ppo_clip",
    },
    # The suite's batch interface (estimators.py): every estimator maps an
    # AdvantageBatch to per-token advantages, per-sample and per-token alike.
    "estimator": {
        name: f"{_PKG}.estimators:{name}"
        for name in ("grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae", "opd")
    },
    # The suite's masked policy-loss interface (policy_losses.py).
    "loss": {
        name: f"{_PKG}.policy_losses:{name}"
        for name in ("ppo_clip", "gspo", "cispo", "sapo", "m2po")
    },
    "kl": {
        "k1": f"{_PKG}.kl:k1",
        "k2": f"{_PKG}.kl:k2",
        "k3": f"{_PKG}.kl:k3",
        "low_var_kl": f"{_PKG}.kl:k3",
    },
    "loss_agg": {
        "token-mean": f"{_PKG}.aggregation:token_mean",
        "seq-mean-token-sum": f"{_PKG}.aggregation:seq_mean_token_sum",
        "seq-mean-token-mean": f"{_PKG}.aggregation:seq_mean_token_mean",
        "seq-mean-token-sum-norm": f"{_PKG}.aggregation:seq_mean_token_sum_norm",
    },
}


def register(kind: str, name: str, fn: Callable[..., Any]) -> None:
    """Add (or replace) an implementation, e.g. from a user plug-in."""
    _table(kind)[name] = fn


def resolve(kind: str, name: str) -> Callable[..., Any]:
    """Return the implementation registered as `name` under `kind`."""
    table = _table(kind)
    if name not in table:
        valid = ", ".join(sorted(table))
        raise KeyError(f"unknown {kind} '{name}'; valid names: {valid}")
    entry = table[name]
    if callable(entry):
        return entry
    module_name, attr = entry.split(":")
    return getattr(importlib.import_module(module_name), attr)


def list_algorithms() -> dict[str, list[str]]:
    """All registered names, by kind (what `relax list algorithms` prints)."""
    return {kind: sorted(table) for kind, table in _TABLES.items()}


def get_advantage_estimator(name: str) -> Callable[..., Any]:
    return resolve("advantage", name)


def get_policy_loss(name: str) -> Callable[..., Any]:
    return resolve("policy_loss", name)


def get_kl_estimator(name: str) -> Callable[..., Any]:
    return resolve("kl", name)


def get_loss_aggregator(name: str) -> Callable[..., Any]:
    return resolve("loss_agg", name)


def get_estimator(name: str) -> Callable[..., Any]:
    """An estimator of the batch interface: `fn(AdvantageBatch, **params) -> AdvantageResult`."""
    return resolve("estimator", name)


def get_loss(name: str) -> Callable[..., Any]:
    """A masked policy loss: `fn(logp, logp_old, advantages, *, mask, logp_rollout=None, **params)`."""
    return resolve("loss", name)


def _table(kind: str) -> dict[str, str | Callable[..., Any]]:
    if kind not in _TABLES:
        raise KeyError(
            f"unknown algorithm kind '{kind}'; valid kinds: {', '.join(_TABLES)}"
        )
    return _TABLES[kind]
