"""Text from the bus made safe to print on a terminal: control characters shown, not obeyed.

A log line, a metric key or a dead-letter reason comes from whoever can write to Redis. Printed
as it is, `ESC[2J` clears the screen, `ESC]52;c;…BEL` writes the clipboard, C1 `CSI` (U+009B)
does what `ESC[` does on terminals that read C1 codes, and a bidi override (U+202E) or mark
(U+200F) makes the text read differently from what it is (CVE-2021-42574). `printable` writes
each such character as its Python escape (`\\x1b`, `\\x9b`, `\\u202e`), so the rest of a
sequence is plain, inert text.
"""

from __future__ import annotations

import re

# C0 controls except tab and newline, DEL, C1 controls, the bidi marks (ALM LRM RLM), embeddings,
# overrides and isolates (LRE RLE PDF LRO RLO, LRI RLI FSI PDI). The page's printable()
# (dashboard/static/js/dom.js) shows the same characters.
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def printable(text: str) -> str:
    """`text` with every control character but tab and newline written as its escape."""
    return _CONTROL.sub(_escaped, text)


def _escaped(match: re.Match[str]) -> str:
    code = ord(match[0])
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def json_printable(text: str) -> str:
    """JSON text with DEL, C1 and bidi controls written as `\\uXXXX` escapes: the same JSON value
    (these characters can only stand inside its strings, where the escape means them), and safe
    on a terminal. orjson escapes C0 controls itself."""
    return _CONTROL.sub(lambda m: f"\\u{ord(m[0]):04x}", text)
