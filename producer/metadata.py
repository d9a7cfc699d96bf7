"""A label's run metadata as training code sets it: config and summary values, the run's name
and tags. Each change is sent as one `meta` event (runbus.wire), ordered by the label's seq like
every other event and never dropped.

What is sent is checked here as the ingester would check it, so a bad value raises at the call
rather than turning into a dead letter: plain JSON values (numbers, strings, lists, objects;
tensors and numpy scalars as their number, other objects as their str()), non-finite floats as
the strings "NaN", "Infinity", "-Infinity", keys of 1 to 256 characters, at most half a MiB of
JSON per update, and no secret: values are redacted by name and shape (runbus.redact) before they
leave the process, keys by shape.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from runbus import wire
from runbus.errors import InvalidName
from runbus.redact import MAX_DEPTH, redact, redact_text

if TYPE_CHECKING:
    from runbus.producer.run import Run

# The most JSON one config or summary update (or the config at init) may hold: half an event's
# data, so that the event with its other fields stays inside wire.MAX_DATA_BYTES.
MAX_UPDATE_BYTES = wire.MAX_DATA_BYTES // 2
# Arrays (numpy, torch) of up to this many elements are sent as lists; bigger ones as their str().
MAX_ARRAY_ITEMS = 1000


def plain_values(values: Any, what: str) -> dict[str, Any]:
    """`values` (a mapping; for config also an object such as an argparse.Namespace) as the plain,
    redacted JSON object a meta event or start event carries; TypeError / ValueError say why not."""
    values = _as_mapping(values, what)
    plain = {_top_key(what, key): _plain(value, 1) for key, value in values.items()}
    if len(plain) > wire.MAX_META_KEYS:
        raise ValueError(f"{what} sets {len(plain)} keys, over the limit of {wire.MAX_META_KEYS}")
    size = len(_encoded(what, plain))
    if size > MAX_UPDATE_BYTES:
        raise ValueError(f"{what} is {size} bytes as JSON, over the limit of {MAX_UPDATE_BYTES}")
    # Secrets (api_key=, tokens, URL passwords) never leave the process: see runbus.redact.
    redacted: dict[str, Any] = redact(plain)
    return redacted


def _as_mapping(values: Any, what: str) -> Mapping[Any, Any]:
    if values is None:
        return {}
    if isinstance(values, Mapping):
        return values
    if what == "config" and hasattr(values, "__dict__"):  # argparse.Namespace, simple objects
        fields: dict[str, Any] = vars(values)
        return fields
    raise TypeError(f"{what} must be a dict, not {type(values).__name__}")


def _top_key(what: str, key: Any) -> str:
    name = key if type(key) is str else str(key)
    if not 0 < len(name) <= wire.MAX_KEY_LENGTH:
        raise ValueError(f"{what} key {name[:40]!r} must have 1 to {wire.MAX_KEY_LENGTH} characters")
    return name


def _plain(value: Any, depth: int) -> Any:
    """`value` as plain JSON: what orjson writes as it is, non-finite floats as the wire's
    strings, scalars read from tensors and numpy, anything else as its str()."""
    if value is None or type(value) is str or type(value) is bool:
        return value
    if isinstance(value, float):  # numpy.float64 too
        return float(value) if math.isfinite(value) else wire.finite_to_wire(float(value))
    if isinstance(value, int) and not isinstance(value, bool):
        # Beyond 64 bits JSON readers disagree (orjson refuses): kept as its digits.
        return int(value) if -(2**63) <= value < 2**64 else str(value)
    if isinstance(value, str):
        return str.__str__(value)
    if depth > MAX_DEPTH:
        raise ValueError(f"a value nests deeper than {MAX_DEPTH} levels (does it hold itself?)")
    if isinstance(value, Mapping):
        return {(k if type(k) is str else str(k)): _plain(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v, depth + 1) for v in value]
    if isinstance(value, set | frozenset):
        return [_plain(v, depth + 1) for v in sorted(value, key=repr)]
    return _plain_object(value, depth)


def _plain_object(value: Any, depth: int) -> Any:
    """A tensor or numpy value as its number or list (small arrays), else its str()."""
    items = _element_count(value)
    if items == 1 and callable(getattr(value, "item", None)):
        try:
            return _plain(value.item(), depth + 1)
        except Exception:  # a tensor on the meta device, a fake tensor: no value to read
            return str(value)
    if items is not None and items <= MAX_ARRAY_ITEMS and callable(getattr(value, "tolist", None)):
        try:
            return _plain(value.tolist(), depth + 1)
        except Exception:  # an array whose values cannot be read (as for .item() above): its text
            return str(value)
    return str(value)


def _element_count(value: Any) -> int | None:
    """How many elements a tensor or numpy value holds; None for other objects."""
    numel: Callable[[], int] | None = getattr(value, "numel", None)
    if callable(numel) and getattr(value, "dim", None) is not None:  # a torch.Tensor
        try:
            return int(numel())
        except Exception:  # a tensor whose size cannot be read: treated as no array
            return None
    size = getattr(value, "size", None)
    if isinstance(size, int) and hasattr(value, "ndim") and hasattr(value, "dtype"):  # numpy
        return size
    return None


def _encoded(what: str, plain: dict[str, Any]) -> bytes:
    import orjson

    try:
        return orjson.dumps(plain)
    except TypeError as exc:  # lone surrogates: not UTF-8
        raise ValueError(f"{what} holds text that is not valid UTF-8 ({exc})") from None


def checked_name(name: Any) -> str:
    """A run name as the wire takes it (wire.check_run_name), holding no secret."""
    checked = wire.check_run_name(name)
    if redact_text(checked) != checked:
        raise InvalidName(f"run name {checked[:40]!r} looks like it holds a secret: it is not sent")
    return checked


def checked_tags(tags: Any) -> list[str]:
    """Tags as the wire takes them (wire.check_tags), holding no secret."""
    checked = wire.check_tags(tags)
    for tag in checked:
        if redact_text(tag) != tag:
            raise InvalidName(f"tag {tag[:40]!r} looks like a secret: it is not sent")
    return checked


class RunValues(Mapping[str, Any]):
    """`run.config` or `run.summary`: what this label set, readable like a dict (values as sent:
    plain JSON, redacted). `update()` and `[key] = value` set more: each call is one meta event.

    Keys are top-level: an update replaces a key's whole value (nested dicts are not merged).
    A summary holds final values (best accuracy, last loss): the last write of each key wins.
    """

    def __init__(self, run: Run, field: str, initial: dict[str, Any] | None = None) -> None:
        self._run = run
        self._field = field
        self._values: dict[str, Any] = dict(initial or {})

    def __getitem__(self, key: str) -> Any:
        return self._values[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"<{self._run.label} {self._field} {self._values!r}>"

    def update(self, values: Any = None, /, **more: Any) -> None:
        """Set the keys of `values` (a dict; for config also an argparse.Namespace) and `more`.

        Raises RunFinished after finish(), TypeError / ValueError for what the ingester would
        refuse (see runbus.producer.metadata); nothing is sent then."""
        plain = plain_values({**_as_mapping(values, self._field), **more}, self._field)
        if not plain:
            return
        known = len(self._values.keys() | plain.keys())
        if known > wire.MAX_META_KEYS:
            raise ValueError(
                f"{self._field} would hold {known} keys from this label, "
                f"over the limit of {wire.MAX_META_KEYS}"
            )
        self._run._send_meta({self._field: plain})
        self._values.update(plain)

    def __setitem__(self, key: str, value: Any) -> None:
        self.update({key: value})

    def __delitem__(self, key: str) -> None:
        raise TypeError(f"{self._field} keys cannot be removed once set: set the key to None instead")
