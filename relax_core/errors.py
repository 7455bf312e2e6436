"""Exceptions that mean "the user must change something" (the CLI exits with 2).

Kept free of imports so the CLI can catch them without loading anything.
"""


class UserError(Exception):
    """A mistake the user can fix (recipe, override, path, resources); exit code 2."""


class RecipeError(UserError):
    """A mistake in a recipe or an override; the message says what to change."""
