"""The configuration system: `load(argv) -> MaxTextConfig` (frozen, validated, derived)."""

from maxtext.config.keys import all_keys
from maxtext.config.loader import from_overrides, load, load_with_sources
from maxtext.config.maxtext_config import MaxTextConfig
from maxtext.errors import ConfigError

__all__ = ["ConfigError", "MaxTextConfig", "all_keys", "from_overrides", "load", "load_with_sources"]
