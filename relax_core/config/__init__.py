"""Recipe schema and loading (pydantic + YAML only; nothing heavy is imported)."""

from relax_core.config.loader import RecipeError, dump_recipe, load_recipe
from relax_core.config.schema import Recipe

__all__ = ["Recipe", "RecipeError", "dump_recipe", "load_recipe"]
