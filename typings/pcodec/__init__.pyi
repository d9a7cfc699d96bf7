"""pcodec ships no type information: the part of it runbus calls (storage/columns.py), typed."""

from pcodec import standalone as standalone

class DeltaSpec:
    @staticmethod
    def auto() -> DeltaSpec: ...
    @staticmethod
    def try_consecutive(order: int) -> DeltaSpec: ...

class ChunkConfig:
    def __init__(self, compression_level: int = ..., delta_spec: DeltaSpec = ...) -> None: ...

class Progress:
    n_processed: int
    finished: bool
