"""Registry of reward functions, looked up by the name a recipe (or a data row) gives.

A reward is a function `fn(response: str, label, metadata: dict)` returning a
float or a dict of named floats; it may be `async def`. `@reward("name")`
registers it. Built-ins (the modules in `_BUILTIN_MODULES`) are imported on
first lookup, so importing this module stays cheap. Plugins: every `*.py`
file in `relax_core/rewards/plugins/` and in the folders a recipe lists under
`reward.plugin_dirs` is imported on lookup, and whatever it registers becomes
available by name; no other registration step. A plugin that fails to import
raises `RewardPluginError` naming the file, so a run does not start.

The reward hub (hub.py) turns names into calls: in-process for cheap rewards,
in worker processes with a time limit for the rest.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relax_core.errors import UserError
from relax_core.plugin_files import import_file

RewardFn = Callable[[str, Any, dict], Any]

DEFAULT_PLUGIN_DIR = Path(__file__).parent / "plugins"
_BUILTIN_MODULES = (
    "relax_core.rewards.builtin",
    "relax_core.rewards.math_rewards",
    "relax_core.rewards.choice",
    "relax_core.rewards.qa",
    "relax_core.rewards.ifbench",
    "relax_core.rewards.openr1mm",
    "relax_core.rewards.genrm",
)


@dataclass(frozen=True)
class RewardSpec:
    """A registered reward and how the hub should call it.

    Attributes:
        name: the name recipes and data rows use.
        fn: the function.
        in_process: True for cheap rewards that cannot hang (string checks):
            the hub calls them directly instead of paying a worker round trip.
        source: where it was defined (module name or plugin file), for messages.
    """

    name: str
    fn: RewardFn
    in_process: bool = False
    source: str = ""

    @property
    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self.fn)


class RewardPluginError(UserError):
    """A reward plugin file could not be imported (or its folder does not exist)."""


_REWARDS: dict[str, RewardSpec] = {}
_LOADED_FILES: set[Path] = set()
_PLUGIN_SOURCES: dict[str, str] = {}  # module name -> plugin file, so a spec can name its file


def reward(name: str, *, in_process: bool = False) -> Callable[[RewardFn], RewardFn]:
    """Decorator: register `fn` under `name` (re-registering a name replaces it).

    Args:
        name: the name a recipe's `reward.name` or a data row's reward column uses.
        in_process: call it in the caller's process (only for cheap checks that
            cannot hang; they then have no time limit).
    """

    def decorate(fn: RewardFn) -> RewardFn:
        source = getattr(fn, "__module__", "") or ""
        _REWARDS[name] = RewardSpec(name, fn, in_process, _PLUGIN_SOURCES.get(source, source))
        return fn

    return decorate


def get_spec(name: str, plugin_dirs: Iterable[str | Path] = ()) -> RewardSpec:
    """The registered reward `name`, with built-ins and plugins loaded."""
    load_all(plugin_dirs)
    if name not in _REWARDS:
        raise KeyError(f"unknown reward '{name}'; registered rewards: {', '.join(sorted(_REWARDS))}")
    return _REWARDS[name]


def get_reward(name: str, plugin_dirs: Iterable[str | Path] = ()) -> RewardFn:
    """The reward function registered as `name`."""
    return get_spec(name, plugin_dirs).fn


def list_rewards(plugin_dirs: Iterable[str | Path] = ()) -> list[str]:
    """Names of all registered rewards (built-ins and plugins), sorted."""
    load_all(plugin_dirs)
    return sorted(_REWARDS)


def load_all(plugin_dirs: Iterable[str | Path] = ()) -> None:
    """Import the built-ins, the default plugin folder and `plugin_dirs` (each file once)."""
    for module in _BUILTIN_MODULES:
        importlib.import_module(module)
    for folder in [DEFAULT_PLUGIN_DIR, *plugin_dirs]:
        load_plugin_dir(folder)


def load_plugin_dir(folder: str | Path) -> list[Path]:
    """Import every `*.py` file in `folder` (not `_*.py`); the files imported."""
    path = Path(folder).expanduser().resolve()
    if not path.is_dir():
        raise RewardPluginError(f"reward.plugin_dirs: '{folder}' is not a folder")
    files = sorted(p for p in path.glob("*.py") if not p.name.startswith("_"))
    for file in files:
        _import_plugin(file)
    return files


def _import_plugin(file: Path) -> None:
    if file in _LOADED_FILES:
        return
    import_file(file, "relax_reward_plugins", RewardPluginError, "reward plugin",
                before_exec=lambda name: _PLUGIN_SOURCES.__setitem__(name, str(file)))
    _LOADED_FILES.add(file)
