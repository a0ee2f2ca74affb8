"""The glue's call helpers: an argument read or replaced by name wherever the
caller put it, positions from the wrapped function's own signature, and the
wrappers that act only inside a load."""

import pytest

from ms_loadpatch.calls import argument, handles, on_load, with_argument


def loader(model, state_dict, files, *, dtype=None, keep=None):
    return model, state_dict, files, dtype, keep


class Owner:
    @classmethod
    def load(cls, model, state_dict=None):
        return model, state_dict

    def method(self, mode=True):
        return mode


@pytest.mark.parametrize(
    "args, kwargs",
    [
        (("m", "sd", "f"), {}),
        (("m",), {"state_dict": "sd", "files": "f"}),
        ((), {"model": "m", "state_dict": "sd", "files": "f", "dtype": "bf16"}),
    ],
)
def test_argument_by_position_or_name(args, kwargs):
    assert argument(loader, args, kwargs, "model") == "m"
    assert argument(loader, args, kwargs, "state_dict") == "sd"
    assert argument(loader, args, kwargs, "files") == "f"
    assert argument(loader, args, kwargs, "dtype") == kwargs.get("dtype")
    assert argument(loader, args, kwargs, "keep", "default") == "default"


def test_bound_methods_skip_their_first_parameter():
    assert argument(Owner.load, ("m", "sd"), {}, "state_dict") == "sd"
    assert argument(Owner.load, ("m",), {}, "state_dict", "none") == "none"
    assert argument(Owner().method, (False,), {}, "mode", True) is False
    assert argument(Owner().method, (), {}, "mode", True) is True


def test_with_argument_replaces_where_the_caller_put_it():
    assert with_argument(loader, ("m", "sd", "f"), {}, "state_dict", "new") == (("m", "new", "f"), {})
    assert with_argument(loader, ("m",), {"state_dict": "sd"}, "state_dict", "new") == (("m",), {"state_dict": "new"})
    assert with_argument(loader, ("m",), {}, "dtype", "fp16") == (("m",), {"dtype": "fp16"})
    args, kwargs = with_argument(loader, ("m", "sd", "f"), {}, "state_dict", "new")
    assert loader(*args, **kwargs)[1] == "new"


def test_a_name_the_function_lacks_is_an_error():
    with pytest.raises(TypeError, match="no parameter 'resolved_archive_file'"):
        argument(loader, ("m",), {}, "resolved_archive_file")


def test_on_load_dispatches_to_the_load_method_for_the_calls_it_models():
    """The one wrapper of the internal rows: straight through outside a load
    of the kind, and for a call form the method does not model; else the
    load's method with the call, its arguments by name."""

    class Kind:
        running = None

        @classmethod
        def current(cls):
            return cls.running

        @handles(accepts=lambda load, call: call.argument("files") != "other.bin")
        def on_loader(self, call):
            return ("accelerated", self, call.argument("state_dict"), call.with_argument("state_dict", "sd2")())

    wrapper = on_load(Kind, "on_loader")
    assert wrapper(loader, None, ("m", "sd", "f"), {}) == ("m", "sd", "f", None, None)
    load = Kind.running = Kind()
    assert wrapper(loader, None, ("m", "sd", "f"), {}) == ("accelerated", load, "sd", ("m", "sd2", "f", None, None))
    assert wrapper(loader, None, ("m", "sd"), {"files": "other.bin"}) == ("m", "sd", "other.bin", None, None)


def test_a_row_naming_a_load_method_resolves_to_its_dispatch():
    from ms_loadpatch import core

    wrapper = core._resolve_wrapper("ms_loadpatch.glue.transformers:TransformersLoad.on_convert_state_dict")
    assert wrapper.__qualname__ == "on_load(TransformersLoad.on_convert_state_dict)"
    assert core._resolve_wrapper("ms_loadpatch.glue.transformers:to").__name__ == "to"
