"""Load a recipe: YAML file, then dotted overrides, then validation.

    recipe = load_recipe("recipes/quickstart.yaml", ["train.lr=2e-6"])

Every mistake a user can make raises `RecipeError`, whose message names the
file (with the line, when the key is in the file) or the override, the full
field path, and what to change; the CLI prints it and exits with code 2.
Nothing here writes anything.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from relax_core.config.schema import Recipe
from relax_core.errors import RecipeError

MAX_ERRORS_SHOWN = 8


def load_recipe(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """Read, override and validate a recipe; raise `RecipeError` on any mistake."""
    path = Path(path)
    raw, text = read_recipe_file(path)
    parsed = [parse_override(item) for item in overrides]
    for dotted, value, item in parsed:
        set_dotted(raw, dotted, value, item)
    _anchor_plugin_dirs(raw, path.parent)
    _anchor_rollout_paths(raw, path.parent)
    try:
        return Recipe.model_validate(raw)
    except ValidationError as exc:
        sources = {dotted: item for dotted, _, item in parsed}
        raise RecipeError(format_validation_error(exc, path, text, sources)) from None


def _anchor_plugin_dirs(raw: dict[str, Any], base: Path) -> None:
    """Relative `reward.plugin_dirs` mean "next to the recipe", wherever the job later runs."""
    reward = raw.get("reward")
    dirs = reward.get("plugin_dirs") if isinstance(reward, dict) else None
    if isinstance(dirs, list):
        reward["plugin_dirs"] = [str((base / d).resolve()) if _relative_path(d) else d for d in dirs]


def _anchor_rollout_paths(raw: dict[str, Any], base: Path) -> None:
    """`rollout.env.path` and `rollout.agent.cwd` are next to the recipe too (an unset cwd: its folder)."""
    rollout = raw.get("rollout")
    if not isinstance(rollout, dict):
        return
    env, agent = rollout.get("env"), rollout.get("agent")
    if isinstance(env, dict) and isinstance(env.get("path"), str) and _relative_path(env["path"]):
        env["path"] = str((base / env["path"]).resolve())
    args = env.get("args") if isinstance(env, dict) else None
    if isinstance(env, dict) and env.get("name") == "tools" and env.get("path") is None and isinstance(args, dict) \
            and _relative_path(args.get("tools")):  # the built-in tool environment's file
        args["tools"] = str((base / args["tools"]).resolve())
    if isinstance(agent, dict):
        cwd = agent.get("cwd")
        if cwd is None:
            agent["cwd"] = str(base.resolve())
        elif isinstance(cwd, str) and _relative_path(cwd):
            agent["cwd"] = str((base / cwd).resolve())


def read_recipe_file(path: Path) -> tuple[dict[str, Any], str]:
    """The recipe file as a mapping, plus its text (for line numbers in errors)."""
    if not path.exists():
        raise RecipeError(f"{path}: recipe file not found (check the path; `relax recipes` lists the shipped ones)")
    if path.is_dir():
        raise RecipeError(f"{path}: is a directory; give the path of a recipe .yaml file")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise RecipeError(f"{path}: cannot be read: {exc}") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise RecipeError(f"{path}: invalid YAML{_yaml_position(exc)}: {_yaml_problem(exc)}") from None
    if raw is None:
        raise RecipeError(f"{path}: the recipe is empty; it needs at least the sections name, model and data")
    if not isinstance(raw, dict):
        kind = type(raw).__name__
        raise RecipeError(
            f"{path}: the top level must be a mapping of sections (name:, model:, data:, ...), "
            f"but the file holds a {'YAML list' if kind == 'list' else kind}"
        )
    return raw, text


def _yaml_position(exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None)
    return f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""


def _yaml_problem(exc: yaml.YAMLError) -> str:
    return getattr(exc, "problem", None) or str(exc).splitlines()[0]


# ----------------------------------------------------------------- overrides
def parse_override(item: str) -> tuple[str, Any, str]:
    """`a.b.c=value` -> ("a.b.c", parsed value, item). Values are read as YAML."""
    if "=" not in item:
        raise RecipeError(
            f"override '{item}': expected KEY=VALUE with a dotted key, e.g. train.lr=2e-6 or cluster.rollout.nodes=4"
        )
    dotted, _, text = item.partition("=")
    dotted = dotted.strip()
    if not dotted or any(not part for part in dotted.split(".")):
        raise RecipeError(f"override '{item}': the key before '=' must be a dotted path such as train.lr")
    return dotted, parse_value(text), item


def parse_value(text: str) -> Any:
    """An override's value: numbers as numbers (YAML 1.1 would read `2e-6` as a string)."""
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    try:
        return yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        return text


def set_dotted(raw: dict[str, Any], dotted: str, value: Any, item: str) -> None:
    """Set `value` at the dotted path inside `raw`, creating sections as needed."""
    node = raw
    parts = dotted.split(".")
    for depth, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            where = ".".join(parts[: depth + 1])
            raise RecipeError(f"override '{item}': {where} is a value ({child!r}), not a section with keys")
        node = child
    node[parts[-1]] = value


# -------------------------------------------------------------- error report
def format_validation_error(
    exc: ValidationError, path: Path, text: str, override_sources: dict[str, str]
) -> str:
    errors = exc.errors()
    lines = [f"{path}: {len(errors)} problem{'s' if len(errors) != 1 else ''} in the recipe"]
    for err in errors[:MAX_ERRORS_SHOWN]:
        field_path, model = resolve_location(err["loc"])
        dotted = ".".join(field_path)
        if not dotted and err["type"] == "value_error":  # cross-field checks name their fields themselves
            lines += [f"  {problem}" for problem in _explain(err, field_path, model).split("; ")]
            continue
        where = _where(dotted, path, text, override_sources)
        lines.append(f"  {dotted or '(recipe)'}{where}: {_explain(err, field_path, model)}")
    if len(errors) > MAX_ERRORS_SHOWN:
        lines.append(f"  ... and {len(errors) - MAX_ERRORS_SHOWN} more")
    return "\n".join(lines)


def _where(dotted: str, path: Path, text: str, override_sources: dict[str, str]) -> str:
    for key, item in override_sources.items():
        if dotted == key or dotted.startswith(key + ".") or key.startswith(dotted + "."):
            return f" (from override '{item}')"
    line = yaml_line_of(text, dotted.split(".")) if dotted else None
    return f" ({path.name} line {line})" if line else ""


def _explain(err: dict[str, Any], field_path: list[str], model: type[BaseModel] | None) -> str:
    kind, msg = err["type"], err["msg"]
    if kind == "extra_forbidden":
        valid = sorted(model.model_fields) if model else []
        guess = _closest(field_path[-1], valid)
        hint = f"; did you mean '{guess[0]}'?" if guess else "."
        return f"unknown key{hint} Valid keys here: {', '.join(valid)}"
    if kind == "missing":
        return "required key is missing"
    if kind == "union_tag_invalid":
        return msg
    if kind == "value_error":
        return msg.removeprefix("Value error, ")
    return f"{msg} (got {err.get('input')!r})" if "input" in err and not isinstance(err["input"], dict) else msg


def _closest(key: str, valid: list[str]) -> list[str]:
    """The valid key the user most likely meant (typo, or a prefix of it)."""
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    return close or [v for v in valid if len(v) > 1 and (key.startswith(v) or v.startswith(key))][:1]


def resolve_location(loc: tuple[Any, ...]) -> tuple[list[str], type[BaseModel] | None]:
    """Turn pydantic's error location into the user's field path.

    Pydantic puts the tag of a discriminated union into the location
    (`train.torch.lr`); the user wrote `train.lr`. Returns the path without
    tags, and the model that owns the last key (for listing valid keys).
    """
    model: type[BaseModel] | None = Recipe
    owner: type[BaseModel] | None = Recipe
    path: list[str] = []
    pending_union: dict[str, type[BaseModel]] | None = None
    for part in loc:
        if pending_union is not None and str(part) in pending_union:
            model, pending_union = pending_union[str(part)], None
            continue
        path.append(str(part))
        owner = model
        model, pending_union = _child_model(model, str(part))
    return path, owner


def _child_model(model: type[BaseModel] | None, key: str):
    """The model (or tag -> model map, for a union) of field `key` of `model`."""
    if model is None or key not in model.model_fields:
        return None, None
    candidates = _models_in(model.model_fields[key].annotation)
    if len(candidates) == 1:
        family = getattr(candidates[0], "tagged_models", None)  # an open family picked by tag (algorithms)
        return (None, family()) if family else (candidates[0], None)
    if candidates:
        return None, {_tag_of(m): m for m in candidates} | _extra_tags(candidates)
    return None, None


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    found: list[type[BaseModel]] = []
    for arg in getattr(annotation, "__args__", ()) or getattr(annotation, "__metadata__", ()):
        found += [m for m in _models_in(arg) if m not in found]
    origin = getattr(annotation, "__origin__", None)
    if origin is not None and not found:
        found += _models_in(origin)
    return found


def _tag_of(model: type[BaseModel]) -> str:
    for field in ("source", "backend", "name"):
        info = model.model_fields.get(field)
        if info is not None and isinstance(info.default, str):
            return info.default
    return model.__name__


def _extra_tags(models: list[type[BaseModel]]) -> dict[str, type[BaseModel]]:
    """Tags of models whose discriminator admits several values (FileData: file, hub)."""
    tags: dict[str, type[BaseModel]] = {}
    for model in models:
        info = model.model_fields.get("source")
        for value in getattr(info.annotation, "__args__", ()) if info else ():
            if isinstance(value, str):
                tags[value] = model
    return tags


def yaml_line_of(text: str, keys: list[str]) -> int | None:
    """1-based line of the deepest key of `keys` present in the YAML text."""
    try:
        node = yaml.compose(text)
    except yaml.YAMLError:
        return None
    line = None
    for key in keys:
        if not isinstance(node, yaml.MappingNode):
            break
        match = next(((k, v) for k, v in node.value if getattr(k, "value", None) == key), None)
        if match is None:
            break
        line, node = match[0].start_mark.line + 1, match[1]
    return line


def dump_recipe(recipe: Recipe) -> str:
    """The resolved recipe as YAML (what `relax validate` prints and runs record)."""
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False, allow_unicode=True)


def _relative_path(value: Any) -> bool:
    return isinstance(value, str) and not Path(value).expanduser().is_absolute()
