"""Checkpoint arrays to mindspore tensors, and the one cast the strategy uses."""

from __future__ import annotations

import mindspore as ms
import numpy as np


def to_tensor(array: np.ndarray) -> ms.Tensor:
    """Zero-copy: the tensor shares (and keeps alive) the array's buffer."""
    return ms.Tensor.from_numpy(array)


def cast(tensor: ms.Tensor, dtype) -> ms.Tensor:
    """Cast with mindspore's own cast kernel, the one mindone's `set_dtype`
    uses, so values are bit-identical to the unpatched load. In place on the
    tensor object; a new buffer is allocated for the result."""
    tensor.set_dtype(dtype)
    return tensor
