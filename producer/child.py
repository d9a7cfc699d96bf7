"""A picklable handle with which a child process logs into its parent's run, under its own label.

    handle = run.child("rank0-loader")            # in the parent
    pool.apply_async(work, (handle,))             # spawn, forkserver or fork alike
    with handle.init() as child_run: ...          # in the child: a worker label, never primary

A label has one live writer, so a child never logs as its parent's label (LabelInUse); it joins
the parent's run whatever the parent's resume mode was.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from runbus.config import safe_url
from runbus.wire import check_name

if TYPE_CHECKING:
    from runbus.producer.run import Run


@dataclass(frozen=True)
class ChildLabel:
    """Where a child logs: its parent's run id and Redis, its own label, init() options."""

    run_id: str
    label: str
    redis_url: str
    options: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, run: Run, label: str, options: dict[str, Any]) -> ChildLabel:
        check_name("label", label)
        if label == run.label:
            raise ValueError(
                f"a child logs under a label of its own, not its parent's {label!r} "
                f'(e.g. run.child("{run.label}-worker"))'
            )
        for reserved in ("run_id", "label", "primary", "redis_url", "resume"):
            if reserved in options:
                raise TypeError(f"run.child() sets {reserved} itself")
        return cls(run.run_id, label, run.identity.redis_url, dict(options))

    def init(self, **options: Any) -> Run:
        """runbus.init() for this label, in the child (`options` add to or override the handle's)."""
        from runbus.producer import init

        return init(
            run_id=self.run_id,
            label=self.label,
            primary=False,
            redis_url=self.redis_url,
            resume="allow",
            **{**self.options, **options},
        )

    def __repr__(self) -> str:
        url = safe_url(self.redis_url)
        return f"ChildLabel(run_id={self.run_id!r}, label={self.label!r}, redis_url={url!r})"
