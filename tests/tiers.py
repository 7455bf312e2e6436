"""The two tiers of the suite.

`bash tests/run` runs the default tier: every capability end to end at least once, in at most 20
minutes on a 2-core machine. `bash tests/run --full` runs the full tier too: the tests marked
`@pytest.mark.full(covered_by="<node id>")`, each a variant or a longer proof of what the named
default-tier test already proves end to end. A full-tier test named on the command line
(`path::name`) runs without `--full`.

A `full` mark must name a default-tier test that exists: collection fails otherwise, so the default
tier cannot lose a capability by marking its last test `full`.
"""

from __future__ import annotations

import pytest

LEFT_OUT = pytest.StashKey[int]()


def covered_by(item: pytest.Item) -> str | None:
    """The default-tier node id a full-tier test names, or None for a default-tier test."""
    mark = item.get_closest_marker("full")
    if mark is None:
        return None
    named = mark.kwargs.get("covered_by") or (mark.args[0] if mark.args else None)
    if not named:
        raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.full needs covered_by=<the default-tier test's node id>")
    return named


def select_tier(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Check every `full` mark; without --full, deselect the full tier except tests named on the command line."""
    asked = [arg for arg in config.args if "::" in arg]
    ids = {item.nodeid: item for item in items}
    files = set() if asked else {nodeid.split("::")[0] for nodeid in ids}  # whole files only
    for item in items:
        named = covered_by(item)
        if named is None or named.split("::")[0] not in files:
            continue  # a default-tier test, or the covering test's file is not in this run
        base = ids.get(named) or next((i for n, i in ids.items() if n.startswith(named + "[")), None)
        if base is None:
            raise pytest.UsageError(f"{item.nodeid}: covered_by={named!r} names no test")
        if covered_by(base) is not None:
            raise pytest.UsageError(f"{item.nodeid}: covered_by={named!r} is in the full tier itself")
    if config.getoption("--full"):
        return

    def named_here(item: pytest.Item) -> bool:
        return any(item.nodeid == a or item.nodeid.startswith(a + "[") for a in asked)

    left_out = [item for item in items if covered_by(item) is not None and not named_here(item)]
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = [item for item in items if covered_by(item) is None or named_here(item)]
        config.stash[LEFT_OUT] = len(left_out)


def pytest_terminal_summary(terminalreporter, exitstatus, config):  # registered by conftest
    left = config.stash.get(LEFT_OUT, 0)
    if left:
        terminalreporter.write_line(f"default tier: {left} full-tier tests not run (bash tests/run --full runs them)")
