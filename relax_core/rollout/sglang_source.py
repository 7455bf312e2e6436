"""SGLang's server arguments, read from its source without importing it.

`import sglang.srt.server_args` needs SGLang's GPU dependencies (triton, ...),
which a login node submitting a run lacks, so the arguments are read with
`ast` from the installed package's files, the same way SGLang's argparse
builds them (0.5.x: `ServerArgs` assembles the namespace classes listed in
`server_args._INPUT_NAMESPACES`, declared in `srt/arg_groups/fields/*.py` as
`name: A[type, "help" | Arg(...)] = default`, plus the flags its
`add_cli_args` registers by hand). Each argument comes out as
`name: (flag, kind)`, its kind saying how a value becomes flags:

    flag     store_true, off by default: true -> the flag, false -> nothing
    flag_on  store_true that is on by default (cannot be turned off)
    bool     --x / --no-x (argparse.BooleanOptionalAction)
    list     several values after the flag (nargs)
    value    one value after the flag

`python -m relax_core.rollout.sglang_source --write` regenerates the list
kept for the pinned SGLang from the installed copy (install it with
`pip install --no-deps sglang==<version>`), in two modules split by kind:
`sglang_server_switches.py` the on/off switches (flag, flag_on, bool: no value
follows the flag), `sglang_server_args.py` the arguments that take values and
`SERVER_ARGS`, both joined.
"""

from __future__ import annotations

import argparse
import ast
import importlib.metadata
import importlib.util
import json
import sys
from pathlib import Path

PINNED_MODULE = Path(__file__).with_name("sglang_server_args.py")
SWITCHES_MODULE = "sglang_server_switches.py"  # written beside PINNED_MODULE
SWITCH_KINDS = ("flag", "flag_on", "bool")


def package_dir() -> Path | None:
    """The installed `sglang` package's folder (found without importing it), or None."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def installed() -> tuple[str, dict[str, tuple[str, str]]] | None:
    """The installed SGLang's version and server arguments, or None when it is not installed."""
    root = package_dir()
    if root is None:
        return None
    try:
        version = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:  # its files without its metadata (half installed or removed)
        return None
    return version, server_args(root)


def server_args(root: Path) -> dict[str, tuple[str, str]]:
    """`{name: (flag, kind)}` of every command-line server argument of the SGLang source under `root`."""
    server_args_py = ast.parse((root / "srt" / "server_args.py").read_text())
    namespaces = set(_input_namespaces(server_args_py))
    table: dict[str, tuple[str, str]] = {}
    for path in sorted((root / "srt" / "arg_groups" / "fields").glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef) and node.name in namespaces:
                table.update(_declared_args(node))
    for name, arg in _registered_args(server_args_py):
        table.setdefault(name, arg)
    return dict(sorted(table.items()))


def _input_namespaces(module: ast.Module) -> list[str]:
    for node in module.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_INPUT_NAMESPACES" for t in node.targets):
            return [elt.id for elt in node.value.elts]
    raise ValueError("server_args.py has no _INPUT_NAMESPACES: SGLang's layout changed; update sglang_source.py")


# ------------------------------------------------------------- declared fields
def _declared_args(cls: ast.ClassDef) -> dict[str, tuple[str, str]]:
    """The fields of one namespace class that get a command-line flag."""
    out = {}
    for node in cls.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        annotation = node.annotation
        if not (isinstance(annotation, ast.Subscript) and _name(annotation.value) in ("A", "Annotated")):
            continue
        typ, *extras = annotation.slice.elts
        meta = _arg_meta(extras)
        if meta is None or _constant(meta.get("no_cli")) is True:
            continue
        name = node.target.id
        flag = _constant(meta.get("cli_name")) or "--" + name.replace("_", "-")
        out[name] = (flag, _kind(typ, meta, node.value))
    return out


def _arg_meta(extras: list[ast.expr]) -> dict[str, ast.expr] | None:
    """The `Arg(...)` keywords of an annotation (a bare help string: none), or None when it has neither."""
    for extra in extras:
        if isinstance(extra, ast.Constant) and isinstance(extra.value, str):
            return {}
        if isinstance(extra, ast.Call) and _name(extra.func) == "Arg":
            return {kw.arg: kw.value for kw in extra.keywords}
    return None


def _kind(typ: ast.expr, meta: dict[str, ast.expr], default: ast.expr | None) -> str:
    """How `add_cli_args_from_dataclass` registers a field of type `typ` (see the module docstring)."""
    if "action" in meta:
        return _action_kind(meta["action"], meta.get("action_kwargs"), default)
    inner = _unwrap_optional(typ)
    if isinstance(inner, ast.Subscript) and _name(inner.value) == "Literal":
        return "value"
    if isinstance(inner, ast.Subscript) and _name(inner.value) in ("List", "list") and "type_parser" not in meta:
        return "list"
    if _name(inner) == "bool":
        return _store_true(default)
    return "list" if _constant(meta.get("nargs")) in ("*", "+") else "value"


def _action_kind(action: ast.expr, kwargs: ast.expr | None, default: ast.expr | None) -> str:
    name = _constant(action) if isinstance(action, ast.Constant) else _name(action)
    if name == "BooleanOptionalAction":
        return "bool"
    if name in ("store_true", "DeprecatedStoreTrueAction"):
        return _store_true(default)
    nargs = None
    if isinstance(kwargs, ast.Dict):
        nargs = next((_constant(v) for k, v in zip(kwargs.keys, kwargs.values) if _constant(k) == "nargs"), None)
    return "list" if nargs in ("*", "+") else "value"


def _store_true(default: ast.expr | None) -> str:
    return "flag_on" if default is not None and _constant(default) is True else "flag"


def _unwrap_optional(typ: ast.expr) -> ast.expr:
    """`X` of `Optional[X]`, `Union[X, None]` and `X | None`."""
    if isinstance(typ, ast.Subscript) and _name(typ.value) == "Optional":
        return typ.slice
    if isinstance(typ, ast.Subscript) and _name(typ.value) == "Union":
        args = [a for a in typ.slice.elts if not _is_none(a)]
        return args[0] if len(args) == 1 else typ
    if isinstance(typ, ast.BinOp) and isinstance(typ.op, ast.BitOr):
        args = [a for a in (typ.left, typ.right) if not _is_none(a)]
        return args[0] if len(args) == 1 else typ
    return typ


def _is_none(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and node.value is None


# ---------------------------------------------------------- registered by hand
def _registered_args(module: ast.Module) -> list[tuple[str, tuple[str, str]]]:
    """The `parser.add_argument(...)` calls of `ServerArgs.add_cli_args`."""
    method = next(node for cls in module.body if isinstance(cls, ast.ClassDef) and cls.name == "ServerArgs"
                  for node in cls.body if isinstance(node, ast.FunctionDef) and node.name == "add_cli_args")
    out = []
    for call in ast.walk(method):
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                and call.func.attr == "add_argument"):
            continue
        flags = [_constant(a) for a in call.args]
        kwargs = {kw.arg: kw.value for kw in call.keywords}
        long_flag = next(f for f in flags if f.startswith("--"))
        name = _constant(kwargs["dest"]) if "dest" in kwargs else long_flag[2:].replace("-", "_")
        out.append((name, (long_flag, _registered_kind(kwargs))))
    return out


def _registered_kind(kwargs: dict[str, ast.expr]) -> str:
    if "action" in kwargs:
        action = kwargs["action"]
        name = _constant(action) if isinstance(action, ast.Constant) else _name(action)
        if name in ("store_true", "DeprecatedStoreTrueAction"):
            return _store_true(kwargs.get("default"))
        if name == "BooleanOptionalAction":
            return "bool"
    return "list" if _constant(kwargs.get("nargs")) in ("*", "+") else "value"


# --------------------------------------------------------------------- helpers
def _name(node: ast.expr | None) -> str | None:
    """`x` of `x` and of `a.b.x`."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _constant(node: ast.expr | None):
    return node.value if isinstance(node, ast.Constant) else None


def render(version: str, table: dict[str, tuple[str, str]]) -> dict[str, str]:
    """The text of each pinned module for SGLang `version`, by file name: the switches, then the rest."""
    switches = {name: arg for name, arg in table.items() if arg[1] in SWITCH_KINDS}
    values = {name: arg for name, arg in table.items() if arg[1] not in SWITCH_KINDS}
    return {
        SWITCHES_MODULE: _header(f"SGLang {version}'s on/off server arguments, `name: (flag, kind)` (kinds flag, "
                                 "flag_on and bool:\nno value follows the flag; see sglang_source.py).")
        + _rows("SWITCHES", switches),
        PINNED_MODULE.name: _header(f"SGLang {version}'s server arguments, `name: (flag, kind)` (kinds: see "
                                    f"sglang_source.py): those that take values,\nthe on/off switches in "
                                    f"{SWITCHES_MODULE}, and `SERVER_ARGS`, all of them.")
        + "from relax_core.rollout.sglang_server_switches import SWITCHES\n\n"
        + f"SGLANG_VERSION = {json.dumps(version)}\n\n" + _rows("VALUES", values)
        + "\nSERVER_ARGS: dict[str, tuple[str, str]] = dict(sorted({**VALUES, **SWITCHES}.items()))\n",
    }


def _header(summary: str) -> str:
    return (
        "# ruff: noqa: E501  (generated: one argument a line, however long its flag)\n"
        f'"""{summary}\n\n'
        "Generated, do not edit: `pip install --no-deps sglang==<version>`, then\n"
        "`python -m relax_core.rollout.sglang_source --write` reads the installed SGLang's source\n"
        "(without importing it). Used to check `rollout.engine_args` where SGLang is not installed;\n"
        'a test keeps it equal to what the reader finds in the installed SGLang.\n"""\n\n'
    )


def _rows(name: str, table: dict[str, tuple[str, str]]) -> str:
    rows = "".join(f"    {json.dumps(arg)}: ({json.dumps(flag)}, {json.dumps(kind)}),\n"
                   for arg, (flag, kind) in table.items())
    return f"{name}: dict[str, tuple[str, str]] = {{\n{rows}}}\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m relax_core.rollout.sglang_source", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true",
                        help=f"write {SWITCHES_MODULE} and {PINNED_MODULE.name} (default: print them)")
    args = parser.parse_args(argv)
    found = installed()
    if found is None:
        print("sglang is not installed: pip install --no-deps sglang==<version>", file=sys.stderr)
        return 2
    texts = render(*found)
    for name, text in texts.items():
        if args.write:
            PINNED_MODULE.with_name(name).write_text(text)
            print(f"wrote {PINNED_MODULE.with_name(name)}")
        else:
            print(f"# ---- {name}\n{text}", end="")
    if args.write:
        print(f"SGLang {found[0]}: {len(found[1])} arguments")
    return 0


if __name__ == "__main__":
    sys.exit(main())
