"""host-factories: `mint.ones / zeros / empty` in the building thread made from host memory."""

from __future__ import annotations

import math
import threading

from . import window
from .swaps import Swaps
from .technique import ProbeFailed, Technique


class HostFactories(Technique):
    """`Parameter(mint.ones(n))`, the weight of an RMSNorm in most of
    mindone's models (`ops.ones` in some, Qwen2 among them), runs an op
    through mindspore's asynchronous pipeline and the Parameter then waits
    for it (`param_info` -> `wait_pipeline`):
    a hand-off between threads per tensor, whatever its size. In the building thread the fast path makes the same
    tensor from a numpy array: same shape, dtype and values (`empty`'s are
    undefined either way). The array is wrapped, not copied, when
    `Tensor.from_numpy` does that on this mindspore (`_array_wrapper`): the
    array is ours alone, and an `empty` one is never touched. A form it does
    not know (a device, pinned memory, a dtype without a numpy counterpart,
    sizes that are not ints) takes mindspore's own function. So does a
    function and dtype whose first use in the process, checked against
    mindspore's own call, raised or differed (mindspore 2.7's `mint.empty`
    needs a device on the CPU wheel: its error stays the user's). Filled
    tensors above MAX_ELEMENTS take mindspore's function."""

    name = "host-factories"
    description = (
        "mint.ones / zeros / empty and ops.ones / zeros while a model is built: made from host memory, "
        "without a round trip through mindspore's op pipeline"
    )
    # Installed from a build's first cell (not after window.DEFAULT_START
    # cells): it saves milliseconds per tensor and its own probe model is tiny.
    engages_early = True
    # Larger `ones` / `zeros` take mindspore's own op: its fill reuses its
    # pool and beats numpy's into fresh pages. A larger `empty` is served from
    # the host when its array is wrapped without a copy (nothing touched); a
    # copied one (a fill and its memory) is not. A model's norms and biases are
    # far below this; fused expert weights (GraniteMoE, JetMoE) can be above.
    MAX_ELEMENTS = 1 << 18
    # (module, function): ops' take the dtype as a second positional argument too
    FUNCTIONS = (("mint", "ones"), ("mint", "zeros"), ("mint", "empty"), ("ops", "ones"), ("ops", "zeros"))

    def __init__(self):
        self.modules: dict = {}
        self.originals: dict = {}
        self.swaps = Swaps()
        self.made = self.made_before = 0  # tensors made on the host: in all, before the last install
        self.checked: dict = {}  # (module, name, dtype) -> whether mindspore's own call gave the same tensor
        self.wrap_array = None  # Tensor.from_numpy when it wraps an array without a copy (prepare)

    def prepare(self):
        import mindspore as ms
        import numpy as np
        from mindspore import mint, ops

        modules, originals = {"mint": mint, "ops": ops}, {}
        for key in self.FUNCTIONS:
            function = getattr(modules[key[0]], key[1], None)
            if not callable(function):
                raise ProbeFailed(f"mindspore.{key[0]} has no {key[1]}")
            originals[key] = function
        # mindspore dtype -> (numpy dtype the array is made in, dtype given to Tensor or None)
        numpy_of = {}
        for ms_name, np_type in (
            ("float32", np.float32),
            ("float16", np.float16),
            ("float64", np.float64),
            ("int8", np.int8),
            ("int16", np.int16),
            ("int32", np.int32),
            ("int64", np.int64),
            ("uint8", np.uint8),
            ("bool_", np.bool_),
        ):
            dtype = getattr(ms, ms_name, None)
            if dtype is not None:
                numpy_of[dtype] = (np_type, None)
        if getattr(ms, "bfloat16", None) is not None:  # numpy has none: made in float32, converted on the host
            numpy_of[ms.bfloat16] = (np.float32, ms.bfloat16)
        self.modules, self.originals, self.numpy_of = modules, originals, numpy_of
        self.fills = {"ones": np.ones, "zeros": np.zeros, "empty": np.empty}
        self.tensor = ms.Tensor
        self.wrap_array = self._array_wrapper(ms, np)
        self.checked = {}  # verdicts on what `_make` made before this prepare do not hold for what it makes now
        self.default_dtype = ms.float32  # mint's documented default when dtype is None; the probe checks it

    @staticmethod
    def _shape(args, varargs: bool):
        """The shape from `ones(size)` / `empty(*size)` arguments, None for anything else."""
        if varargs and len(args) != 1:
            size = args
        elif len(args) == 1:
            size = args[0]
        else:
            return None
        if type(size) is int:
            size = (size,)
        elif type(size) not in (tuple, list):
            return None
        if not all(type(n) is int and n >= 0 for n in size):
            return None
        return tuple(size)

    @staticmethod
    def _array_wrapper(ms, np):
        """`Tensor.from_numpy` when, on this mindspore, it gives a `Tensor` of
        the array's shape and dtype over the array's own memory (a write to the
        array shows in the tensor); None otherwise (arrays are then copied by
        `Tensor(array)`). Whether its tensors equal mindspore's own is checked
        per function and dtype (`_same_as_mindspore`) and by the probe."""
        from_numpy = getattr(ms.Tensor, "from_numpy", None)
        if not callable(from_numpy):
            return None
        try:
            array = np.zeros(3, np.float32)
            wrapped = from_numpy(array)
            array[1] = 2.0
            shares = wrapped.asnumpy().tolist() == [0.0, 2.0, 0.0]
            if type(wrapped) is ms.Tensor and wrapped.shape == (3,) and wrapped.dtype == ms.float32 and shares:
                return from_numpy
        except Exception:  # noqa: BLE001 - any failure: arrays are copied instead
            pass
        return None

    def _make(self, name, shape, dtype):
        np_type, convert_to = self.numpy_of[dtype]
        array = self.fills[name](shape, np_type)
        if convert_to is not None:
            return self.tensor(array, dtype=convert_to)
        return self.tensor(array) if self.wrap_array is None else self.wrap_array(array)

    def _too_large(self, name, shape, dtype) -> bool:
        """Left to mindspore's op for its size (MAX_ELEMENTS)."""
        if math.prod(shape) <= self.MAX_ELEMENTS:
            return False
        return not (name == "empty" and self.wrap_array is not None and self.numpy_of[dtype][1] is None)

    def _same_as_mindspore(self, key, original, dtype) -> bool:
        """Once per process and (function, dtype): mindspore's own call and the
        host one give the same type, shape, dtype, device and values."""
        verdict = self.checked.get((*key, dtype))
        if verdict is None:
            try:
                expected, made = original(2, dtype=dtype), self._make(key[1], (2,), dtype)
                # read even for `empty`: mindspore 2.7's CPU wheel fails its mint.empty(n, dtype=...) only
                # when the op runs, and the error would otherwise surface in the user's next op
                expected_bytes = expected.asnumpy().tobytes()
                verdict = (
                    type(made) is type(expected)
                    and made.shape == expected.shape
                    and made.dtype == expected.dtype
                    and str(getattr(made, "device", None)) == str(getattr(expected, "device", None))
                    and (key[1] == "empty" or made.asnumpy().tobytes() == expected_bytes)
                )
            except Exception:  # noqa: BLE001 - mindspore's own call fails here: the user's call gets its error
                verdict = False
            self.checked[(*key, dtype)] = verdict
        return verdict

    def _host(self, key, original, args, kwargs):
        """The tensor `<module>.<name>(*args, **kwargs)` gives, made from numpy; None: a form not handled."""
        module, name = key
        if module == "ops" and len(args) == 2 and "dtype" not in kwargs:
            args, kwargs["dtype"] = args[:1], args[1]
        dtype = kwargs.pop("dtype", None)
        if name == "empty" and kwargs.get("device", 0) is None:
            kwargs.pop("device")
        if kwargs or not args:
            return None
        shape = self._shape(args, varargs=name == "empty")
        if shape is None:
            return None
        if dtype is None:
            dtype = self.default_dtype
        if dtype not in self.numpy_of or self._too_large(name, shape, dtype):
            return None
        if not self._same_as_mindspore(key, original, dtype):
            return None
        self.made += 1
        return self._make(name, shape, dtype)

    def install(self):
        if any(
            getattr(self.modules[module], name, None) is not original
            for (module, name), original in self.originals.items()
        ):
            return False
        technique, serving = self, window.state.generation
        wrappers = {}
        for key, original in self.originals.items():

            def factory(*args, _key=key, _original=original, **kwargs):
                if window.state.builder == threading.get_ident() and window.state.generation == serving:
                    made = technique._host(_key, _original, args, dict(kwargs))
                    if made is not None:
                        return made
                return _original(*args, **kwargs)

            factory.__wrapped__ = original
            factory.__doc__ = original.__doc__
            factory.__name__ = factory.__qualname__ = key[1]
            wrappers[key] = factory
        self.swaps = Swaps((self.modules[module], name, wrapper) for (module, name), wrapper in wrappers.items())
        self.swaps.install()
        self.made_before = self.made
        return True

    def uninstall(self):
        self.swaps.uninstall()
        self.swaps = Swaps()
        if window.state.recording:
            window.state.notes[self.name] = {"tensors": self.made - self.made_before}

    def leftovers(self):
        return [
            f"mindspore.{module}.{name} is not mindspore's"
            for (module, name), original in self.originals.items()
            if getattr(self.modules[module], name, None) is not original
        ]

    def probe_started(self):
        return self.made

    def probe_finished(self, token):
        return None if self.made > token else "the probe model's factories were not served from host memory"

    # The probe: a model of its own (the shared one has no factories), built plain and with this technique:
    # the parameters, buffers and tensor attributes cells hold. Each function and dtype is also checked
    # against mindspore's own call at its first use (`_same_as_mindspore`).

    @staticmethod
    def probe_model():
        import mindspore as ms
        from mindspore import Parameter, mint, nn, ops

        class Norm(nn.Cell):
            def __init__(self):
                super().__init__()
                self.weight = Parameter(mint.ones(4))
                self.bias = Parameter(mint.zeros((2, 3), dtype=ms.float16))
                self.half = Parameter(mint.ones([3], dtype=ms.bfloat16))
                self.register_buffer("positions", mint.zeros(5, dtype=ms.int64))
                self.step = mint.ones((), dtype=ms.int32)
                self.scale = Parameter(ops.ones(3))
                self.offset = Parameter(ops.zeros((2,), ms.float16))

            def construct(self, x):
                return x * self.weight

        class Model(nn.Cell):
            def __init__(self):
                super().__init__()
                self.norms = nn.CellList([Norm()])
                self.gate = Parameter(mint.zeros(2, dtype=ms.int64), name="gate", requires_grad=False)

            def construct(self, x):
                return self.norms[0](x)

        return Model()

    def probe_values(self, model) -> list:
        """What the state comparison leaves out: each parameter's values, and
        where every parameter, buffer and tensor attribute lives."""
        out = [
            (name, str(getattr(param, "device", None)), param.asnumpy().tobytes())
            for name, param in model.parameters_and_names()
        ]
        for name, cell in model.cells_and_names():
            tensors = list(vars(cell).items()) + list(getattr(cell, "_buffers", {}).items())
            out += [
                (f"{name}.{key}", str(getattr(value, "device", None)))
                for key, value in tensors
                if isinstance(value, self.tensor)
            ]
        return out
