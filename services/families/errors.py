"""Why a model's config.json cannot be served: two kinds, so callers can tell a broken
config from a sound one the engine does not implement."""

from __future__ import annotations


class ConfigError(ValueError):
    """config.json lacks a field or holds a value that no model could have."""


class UnsupportedModel(ConfigError):
    """A sound config whose family or field the engine does not compute exactly; the
    message names the family or the field."""
