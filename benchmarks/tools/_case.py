"""Loads a case file for the tools here: cases/*.py with NAMES, make(*args) -> {name: fn}, optional between."""

import importlib.util
from pathlib import Path


def load(path: str):
    spec = importlib.util.spec_from_file_location(f"case_{Path(path).stem}", path)
    case = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(case)
    return case
