"""pytest plugin (entry point `pytest11`): helpers for "patched equals unpatched" tests.

A top-level module, not part of the ms_loadpatch package: pytest imports
every installed plugin at start-up, and importing the package would enable
patching in every test session of the environment. ms_loadpatch is imported
only when a fixture or the marker is used.

    def test_my_model_loads_identically(ms_loadpatch_compare):
        ms_loadpatch_compare("path/to/checkpoint")                  # class from config.json
        ms_loadpatch_compare(lambda: MyModel.from_pretrained(path))  # or any load

    @pytest.mark.ms_loadpatch_disabled
    def test_reference_behaviour():  # runs unpatched; the previous state is restored after
        ...

`ms_loadpatch_compare` loads twice in the test process (testing.load_both:
unpatched, then patched) and fails with the first differing tensors. For a
check in separate processes use `ms-loadpatch verify PATH`.
"""

from __future__ import annotations

import os

import pytest

MARKER = "ms_loadpatch_disabled"


def pytest_configure(config):
    config.addinivalue_line(
        "markers", f"{MARKER}: run the test with ms_loadpatch disabled; its previous state is restored afterwards"
    )


def _load_path(path, model_class=None, subfolder=None, **from_pretrained_kwargs):
    from ms_loadpatch.tools._child import import_model_class
    from ms_loadpatch.tools.spec import LoadSpec

    spec = LoadSpec.resolve(path, model_class if isinstance(model_class, str) else None, subfolder)
    cls = model_class if model_class is not None and not isinstance(model_class, str) else import_model_class(spec)[0]
    if subfolder:
        from_pretrained_kwargs["subfolder"] = subfolder
    return lambda: cls.from_pretrained(spec.path, **from_pretrained_kwargs)


def assert_loads_identically(load, model_class=None, *, skip_values=(), cpu_fallbacks="auto", **from_pretrained_kwargs):
    """Load unpatched, then patched, in this process; assert both models are
    identical (names, shapes, dtypes, requires_grad, ties, values bit for bit).

    load: a checkpoint directory (its class inferred from config.json unless
    `model_class`, a class or a mindone class name, is given; extra keyword
    arguments go to from_pretrained) or a callable returning a model.
    cpu_fallbacks: route kernels missing from mindspore's CPU wheel
    (testing.cpu_kernel_fallbacks) around both loads; "auto" does so on CPU.
    Returns (unpatched model, patched model).
    """
    __tracebackhide__ = True
    from ms_loadpatch import testing

    if isinstance(load, (str, os.PathLike)):
        load = _load_path(load, model_class, **from_pretrained_kwargs)
    elif model_class is not None or from_pretrained_kwargs:
        raise TypeError("model_class and from_pretrained keyword arguments go with a path, not a callable")
    if cpu_fallbacks == "auto":
        import mindspore as ms

        cpu_fallbacks = ms.get_context("device_target") == "CPU"
    if cpu_fallbacks:
        with testing.cpu_kernel_fallbacks():
            reference, accelerated = testing.load_both(load)
    else:
        reference, accelerated = testing.load_both(load)
    problems = testing.compare(testing.snapshot(reference), testing.snapshot(accelerated), skip_values)
    if problems:
        shown = "\n  ".join(problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise AssertionError(
            f"patched load differs from unpatched load ({len(problems)} difference(s)):\n  {shown}{more}"
        )
    return reference, accelerated


@pytest.fixture
def ms_loadpatch_compare():
    """`assert_loads_identically(path_or_load, model_class=None, *, skip_values=(), **from_pretrained_kwargs)`."""
    return assert_loads_identically


@pytest.fixture
def ms_loadpatch_unpatched():
    """The test body runs with ms_loadpatch disabled; the previous state is restored after."""
    import ms_loadpatch

    with ms_loadpatch.disabled():
        yield


@pytest.fixture(autouse=True)
def _ms_loadpatch_disabled_marker(request):
    if request.node.get_closest_marker(MARKER) is None:
        yield
        return
    import ms_loadpatch

    with ms_loadpatch.disabled():
        yield
