"""pcodec's standalone format: one chunk of numbers, with its header, as bytes."""

from typing import Any

import numpy as np
import numpy.typing as npt
from pcodec import ChunkConfig, Progress

def simple_compress(nums: npt.NDArray[Any], config: ChunkConfig) -> bytes: ...
def simple_decompress(src: bytes) -> npt.NDArray[np.generic] | None: ...
def simple_decompress_into(src: bytes, dst: npt.NDArray[Any]) -> Progress: ...
