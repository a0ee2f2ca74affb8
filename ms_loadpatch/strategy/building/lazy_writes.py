"""Copies into a lazy parameter while a call that builds then fills runs
(construction.built_with_draws).

mindspore's `Cell.load_state_dict` copies each value with
`Tensor.assign_value`, which writes into the parameter's data: on a lazy
parameter it leaves the initializer in place, and the later fill would
overwrite the copy. While this is held, `assign_value` in the accounting
thread on a parameter still lazy either takes a copy of the value with
`set_data` (`fast`: the state a plain parameter has after assign_value, as
api_probes.probe_lazy_assign checks), or is first filled with its own draw
and then assigned, which is what the plain build does. Other threads and
filled parameters get mindspore's own `assign_value`.
"""

from __future__ import annotations

import contextlib

import numpy as np
from mindspore import Parameter, Tensor

from ..lane import lane
from .session import holding
from .swaps import SharedSwaps, Swaps

# Tensor's own assign_value (a Parameter's class derives from Tensor and Parameter); kept once
# uninstalled, for a thread that looked the patched one up just before
_original = None


def _assign_value(self, value):
    build = lane.build
    fast = build.fast_assign if build is not None else None
    if fast is None or not isinstance(self, Parameter) or not self.has_init or id(self) in build.foreign:
        return _original(self, value)
    if fast and taken_as_copy(self, value):
        return self
    self.init_data()  # its own draw (draws.Ledger gives it back), as the plain build filled it
    return _original(self, value)


def taken_as_copy(param, value) -> bool:
    """`param.set_data` of a copy of `value` when the copy keeps everything
    assign_value keeps (same shape and dtype, a dtype numpy holds); False
    when it does not, nothing done."""
    from mindspore.common import dtype as mstype

    if (
        not isinstance(value, Tensor)
        or value.has_init
        or value.dtype != param.dtype
        or tuple(value.shape) != tuple(param.shape)
        or value.dtype == mstype.bfloat16
    ):
        return False
    param.set_data(Tensor(np.array(value.asnumpy(), copy=True)))
    return True


def _install():
    global _original
    _original = vars(Tensor)["assign_value"]
    return Swaps([(Tensor, "assign_value", _assign_value)])


_ASSIGNING = SharedSwaps(_install)


@contextlib.contextmanager
def assigning(fast: bool, foreign=frozenset()):
    """assign_value on a lazy parameter in this thread lands, as described
    above; those whose id is in `foreign` (not made by this build) are left
    to mindspore."""
    with _ASSIGNING, holding(fast_assign=fast, foreign=foreign):
        yield


def leftovers() -> list[str]:
    """What an ended call would have left patched (for tests)."""
    patched = vars(Tensor).get("assign_value") is _assign_value
    return [f"Tensor.assign_value still patched ({_ASSIGNING.users} user(s))"] if _ASSIGNING.users or patched else []
