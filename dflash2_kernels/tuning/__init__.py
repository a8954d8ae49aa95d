"""Launch configurations that tune themselves on the user's GPU (tuner.py), from each
kernel's closed space of tested configurations (spaces.py)."""

from .space import Config, Space, rows_class
from .spaces import SPACES
from .tuner import ENV, TUNER, Tuner, cache_dir, key_text

__all__ = ["Config", "ENV", "SPACES", "Space", "TUNER", "Tuner", "cache_dir", "key_text", "rows_class"]
