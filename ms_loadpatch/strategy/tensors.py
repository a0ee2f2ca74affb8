"""Checkpoint arrays to mindspore tensors, and the one cast the strategy uses."""

from __future__ import annotations

import mindspore as ms
import numpy as np


def to_tensor(array: np.ndarray) -> ms.Tensor:
    """Zero-copy: the tensor shares (and keeps alive) the array's buffer."""
    return ms.Tensor.from_numpy(array)


def adopted_parameter(array: np.ndarray, name: str) -> ms.Parameter:
    """A Parameter over `array`'s own buffer, in the state Parameter(array)
    leaves (which copies the buffer): made lazy (without a lock or any flag
    other threads read), then given the buffer by set_data, which aliases
    it. api_probes.probe_adoption checks it."""
    from mindspore.common.initializer import Zero

    from .building.lazy import unshared_lazy_parameter

    tensor = to_tensor(array)
    param = unshared_lazy_parameter(ms.Tensor(shape=tensor.shape, dtype=tensor.dtype, init=Zero()), name)
    param.set_data(tensor)
    param.init_mode = None  # what Parameter(array) has: no initializer, built from data
    param.is_default_input_init = False
    return param


def cast(tensor: ms.Tensor, dtype) -> ms.Tensor:
    """Cast with mindspore's own cast kernel, the one mindone's `set_dtype`
    uses, so values are bit-identical to the unpatched load. In place on the
    tensor object; a new buffer is allocated for the result."""
    tensor.set_dtype(dtype)
    return tensor
