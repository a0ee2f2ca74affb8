"""Models built with the fast-construction techniques are the same objects
as without them (ms_loadpatch/strategy/building/):

- the cell tree of a load with the techniques equals the one without them
  (`state.model_state`: every cell's class, `__dict__` keys in order and
  values, parameter metadata and initializers, primitives; `_create_time`
  is the documented per-instance value), for lazily built and for loaded
  models, transformers and diffusers;
- against an unpatched load: parameters bit-identical, forward outputs, one
  training step (value_and_grad + optimizer step: gradients and updated
  weights bit for bit), save_pretrained files byte for byte;
- from_config / _from_config with the techniques (seeded random init);
- a model under mindspore.jit (graph mode): forward and gradients;
- primitives built by primitive-defaults: the same Python and C++ state.
Faults and threads: tests/faults/test_faults_concurrency.py.
"""

import os

import mindspore as ms
import numpy as np
import pytest
from _building_helpers import (
    DF_ARCHS,
    MOE_FAMILIES,
    TF_ARCHS,
    assert_same_state,
    checkpoints,  # noqa: F401  (a fixture)
    seeded_load,
    sibling_clone_technique,
    techniques_off,
)
from mindspore import nn

import ms_loadpatch
from ms_loadpatch.strategy import building, reports
from ms_loadpatch.strategy.building import state
from ms_loadpatch.strategy.building.construction import lazy_construction
from ms_loadpatch.strategy.building.lazy import CONSTRUCTION_LOCK
from ms_loadpatch.testing import assert_same_model, global_random_state, load_both, set_global_random_state

pytestmark = pytest.mark.usefixtures("cpu_kernels", "plugin_enabled")


# nn.Embedding keeps the initializer of its table as `init_tensor`: an
# unpatched build draws it, a lazy one never does (README, "What differs")
NEVER_DRAWN = ("init_tensor",)


# -- the same objects: transformers


@pytest.mark.parametrize("arch", list(TF_ARCHS))
def test_transformers_same_objects(checkpoints, arch):
    cls, path = checkpoints[arch]
    with ms_loadpatch.disabled():
        reference = seeded_load(cls, path)
    fast = seeded_load(cls, path)
    assert reports.last_report().fast_construction_from == 0  # the suite's start: the first cell
    plain = seeded_load(cls, path, off="all")
    assert reports.last_report().fast_construction_from is None
    assert_same_state(plain, fast)
    assert_same_state(reference, fast, skip=NEVER_DRAWN)
    assert_same_model(reference, fast)
    assert [n for n, _ in reference.cells_and_names()] == [n for n, _ in fast.cells_and_names()]
    assert {n: p.name for n, p in reference.parameters_and_names()} == {
        n: p.name for n, p in fast.parameters_and_names()
    }


@pytest.mark.parametrize("arch", ["mixtral", "t5"])
def test_lazily_built_same_objects(arch):
    """The construction itself: lazy parameters with their initializers, every cell's state."""
    cls, config = TF_ARCHS[arch]
    ms.set_seed(2)
    with lazy_construction(fast=False):
        plain = cls(config())
    ms.set_seed(2)
    with lazy_construction(fast=True):
        fast = cls(config())
    assert all(p.has_init for p in fast.get_parameters() if p.init_mode is not None)
    assert_same_state(plain, fast)
    assert building.technique_status()


def _train_step(model, inputs, kwargs=None, loss_of=None):
    """One value_and_grad + Adam step over all trainable parameters; the loss,
    gradients and updated weights as arrays. `loss_of(model, *inputs)`: the
    loss (default: the mean of the model's first output)."""
    params = model.trainable_params()
    kwargs = kwargs or {}
    optimizer = nn.Adam(params, learning_rate=1e-2)

    def default_loss(model, *args):
        out = model(*args, **kwargs)
        out = out if isinstance(out, ms.Tensor) else out[0]
        return out.astype(ms.float32).mean()

    loss_of = loss_of or default_loss
    grad_fn = ms.value_and_grad(lambda *args: loss_of(model, *args), None, optimizer.parameters)
    loss, grads = grad_fn(*inputs)
    optimizer(grads)
    assert any(np.any(g.asnumpy() != 0) for g in grads)  # the step changes something
    return (loss.asnumpy(), [g.asnumpy() for g in grads], [p.asnumpy() for p in params])


def _assert_bits_equal(expected, actual):
    loss_e, grads_e, params_e = expected
    loss_a, grads_a, params_a = actual
    assert loss_e.tobytes() == loss_a.tobytes()
    assert len(grads_e) == len(grads_a) and len(params_e) == len(params_a)
    for e, a in zip(grads_e + params_e, grads_a + params_a):
        assert e.dtype == a.dtype and e.shape == a.shape and e.tobytes() == a.tobytes()


def test_transformers_forward_and_training_step(checkpoints):
    cls, path = checkpoints["qwen2"]
    reference, accelerated = load_both(lambda: cls.from_pretrained(path))
    ids = ms.Tensor(np.arange(12).reshape(1, 12) % 100, ms.int32)
    assert reference(ids)[0].asnumpy().tobytes() == accelerated(ids)[0].asnumpy().tobytes()
    _assert_bits_equal(_train_step(reference, (ids,)), _train_step(accelerated, (ids,)))


def _files(directory):
    return {name: open(os.path.join(directory, name), "rb").read() for name in sorted(os.listdir(directory))}


@pytest.mark.parametrize("arch", ["qwen2", "vae"])
def test_save_pretrained_identical_files(checkpoints, tmp_path, arch):
    cls, path = checkpoints[arch]
    reference, accelerated = load_both(lambda: cls.from_pretrained(path))
    reference.save_pretrained(str(tmp_path / "reference"))
    accelerated.save_pretrained(str(tmp_path / "accelerated"))
    expected, actual = _files(tmp_path / "reference"), _files(tmp_path / "accelerated")
    assert list(expected) == list(actual) and any(n.endswith(".safetensors") for n in actual)
    for name in expected:
        assert expected[name] == actual[name], name


@pytest.mark.parametrize("arch", MOE_FAMILIES)
def test_transformers_from_config_same_objects(arch):
    cls, config = TF_ARCHS[arch]
    ms.set_seed(3)
    start = global_random_state()  # set_seed leaves mindspore's generator (Tensor.normal_'s) where it is
    with ms_loadpatch.disabled():
        reference = cls._from_config(config())
    cloned = sibling_clone_technique().cloned
    set_global_random_state(start)
    fast = cls._from_config(config())
    assert sibling_clone_technique().cloned == cloned  # random values are drawn while building: never copied
    set_global_random_state(start)
    with techniques_off():
        plain = cls._from_config(config())
    assert_same_model(reference, fast)
    assert_same_state(plain, fast)


# -- the same objects: diffusers


@pytest.mark.parametrize("arch", list(DF_ARCHS))
def test_diffusers_same_objects(checkpoints, arch):
    cls, path = checkpoints[arch]
    with ms_loadpatch.disabled():
        reference = seeded_load(cls, path, mindspore_dtype=ms.bfloat16)
    fast = seeded_load(cls, path, mindspore_dtype=ms.bfloat16)
    assert reports.last_report().library == "diffusers"
    assert reports.last_report().fast_construction_from == 0  # the suite's start: the first cell
    plain = seeded_load(cls, path, off="all", mindspore_dtype=ms.bfloat16)
    assert reports.last_report().fast_construction_from is None  # every technique off: built plainly
    assert_same_state(plain, fast)
    assert_same_state(reference, fast)
    assert_same_model(reference, fast)


def test_diffusers_forward_and_training_step(checkpoints):
    """Flux: the small diffusers model whose forward runs on the CPU backend
    (with _helpers.flux_cpu_routes). Its full backward does not run
    on this backend, unpatched either ("pointer[input_tensor] is null"), so
    the training step goes through its embedders and output head."""
    from _helpers import flux_cpu_routes

    cls, path = checkpoints["flux"]
    reference, accelerated = load_both(lambda: cls.from_pretrained(path))
    rng = np.random.default_rng(0)

    def tensor(*shape):
        return ms.Tensor(rng.standard_normal(shape).astype(np.float32))

    inputs = dict(
        hidden_states=tensor(1, 16, 4),
        encoder_hidden_states=tensor(1, 8, 32),
        pooled_projections=tensor(1, 32),
        img_ids=tensor(16, 3),
        txt_ids=tensor(8, 3),
        timestep=ms.Tensor([1.0]),
    )

    def loss_of(model, hidden, context, timestep, pooled):
        temb = model.time_text_embed(timestep, pooled)
        out = model.proj_out(model.norm_out(model.x_embedder(hidden), temb))
        return out.mean() + model.context_embedder(context).mean()

    with flux_cpu_routes():
        assert reference(**inputs)[0].asnumpy().tobytes() == accelerated(**inputs)[0].asnumpy().tobytes()
        step_inputs = (
            inputs["hidden_states"],
            inputs["encoder_hidden_states"],
            inputs["timestep"],
            inputs["pooled_projections"],
        )
        _assert_bits_equal(
            _train_step(reference, step_inputs, loss_of=loss_of), _train_step(accelerated, step_inputs, loss_of=loss_of)
        )


def test_diffusers_from_config_same_objects():
    cls, config = DF_ARCHS["unet"]
    with ms_loadpatch.disabled():
        ms.set_seed(5)
        reference = cls.from_config(config)
    ms.set_seed(5)
    fast = cls.from_config(config)
    ms.set_seed(5)
    with techniques_off():
        plain = cls.from_config(config)
    assert_same_model(reference, fast)
    assert_same_state(plain, fast)


# -- graph mode


class _Mlp(nn.Cell):
    def __init__(self):
        super().__init__()
        self.layers = nn.SequentialCell([nn.Dense(6, 8), nn.ReLU(), nn.Dense(8, 4)])
        self.norm = nn.LayerNorm((4,))
        self.proj = ms.mint.nn.Linear(4, 2, bias=False)

    def construct(self, x):
        return self.proj(self.norm(self.layers(x)))


def test_jit_forward_and_gradients():
    """mindone's models do not compile on the CPU backend (masking code); a
    mindspore model built with the techniques runs under mindspore.jit."""
    with CONSTRUCTION_LOCK, building.fast_construction():
        fast = _Mlp()
    with techniques_off(), CONSTRUCTION_LOCK, building.fast_construction():
        plain = _Mlp()
    assert_same_state(plain, fast)
    for (_, a), (_, b) in zip(plain.parameters_and_names(), fast.parameters_and_names()):
        b.set_data(ms.Tensor(a.asnumpy()))
    x = ms.Tensor(np.linspace(-2, 2, 18, dtype=np.float32).reshape(3, 6))
    results = []
    for model in (plain, fast):

        @ms.jit
        def loss(inputs, model=model):
            return model(inputs).sum()

        value, grads = ms.value_and_grad(loss, None, model.trainable_params())(x)
        results.append([value.asnumpy().tobytes()] + [g.asnumpy().tobytes() for g in grads])
    assert results[0] == results[1]


# -- primitive-defaults


def test_primitives_built_without_arguments_equal_the_decorators():
    """Primitives of both decorators, with and without defaults, built in the window
    (served from the cache after the first) and plainly: the same Python and C++ state."""
    from mindspore.ops.auto_generate.gen_ops_prim import Dense
    from mindspore.ops.operations.other_ops import Load

    technique = next(t for t in building.TECHNIQUES if t.name == "primitive-defaults")
    classes = (Load, Dense, ms.ops.AffineGrid, ms.ops.Cast, ms.ops.Gather)
    plain = [cls() for cls in classes for _ in range(3)]
    served = technique.served
    with CONSTRUCTION_LOCK, lazy_construction(fast=True):
        fast = [cls() for cls in classes for _ in range(3)]
        with_arguments = ms.ops.AffineGrid(align_corners=True)
    assert technique.served - served >= 2 * len(classes)  # each class's first build noticed it
    for a, b in zip(plain, fast):
        assert state.comparable(a, {}) == state.comparable(b, {}), type(a)
        assert a.attrs is not b.attrs and a.init_attrs is not b.init_attrs
    assert with_arguments.get_attr_dict()["align_corners"] is True
    assert building.leftovers() == []
