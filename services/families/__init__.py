"""The model families the engine serves, each described once (`served.py`), and a model's
config.json read through its description (`config.py`).

The engine, its checkpoint loader, the registry (base-model registration and adapter
validation) and the CLI all read these descriptions; nothing here imports torch.
"""

from .config import ACTIVATIONS, ModelConfig, RopeConfig
from .description import COMMON_KEYS, HARMLESS, IMPLEMENTED, Family, LoraTarget, Refused
from .errors import ConfigError, UnsupportedModel
from .served import FAMILIES, MIXTURES_OF_EXPERTS, family_of

__all__ = [
    "ACTIVATIONS",
    "COMMON_KEYS",
    "FAMILIES",
    "HARMLESS",
    "IMPLEMENTED",
    "MIXTURES_OF_EXPERTS",
    "ConfigError",
    "Family",
    "LoraTarget",
    "ModelConfig",
    "Refused",
    "RopeConfig",
    "UnsupportedModel",
    "family_of",
]
