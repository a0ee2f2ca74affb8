"""Models built from another model (glue/derived.py): ControlNetModel and
SparseControlNetModel `from_unet`, FluxControlNetModel `from_transformer`,
UNetMotionModel `from_unet2d`. Patched and
unpatched calls in one process, from the same random state (load_both): the
same model (names, shapes, dtypes, bits, parameter metadata, cell state),
numpy's and Python's generators left alike, the copies aliasing the same
source tensors; a call failing halfway leaves the process as it was."""

import mindspore as ms
import numpy as np
import pytest

from _helpers import tiny_unet
import mindone.diffusers as md
import ms_loadpatch
from ms_loadpatch.testing import assert_same_model, load_both

pytestmark = pytest.mark.usefixtures("cpu_kernels", "plugin_enabled")


@pytest.fixture(scope="module")
def unets():
    """The tiny UNet, one wide enough for motion modules (GroupNorm of 32 groups), a tiny Flux transformer."""
    from ms_loadpatch.testing import cpu_kernel_fallbacks

    with ms_loadpatch.disabled(), cpu_kernel_fallbacks():
        return {"tiny": md.UNet2DConditionModel(**_unet_config()), "wide": md.UNet2DConditionModel(**_wide_config()),
                "flux": _tiny_flux()}


def _unet_config():
    """The tiny UNet's, with lists of its own: SparseControlNetModel.from_unet
    edits the source's `down_block_types` in place (patched and unpatched)."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in tiny_unet().items()}


def _wide_config():
    return dict(_unet_config(), block_out_channels=[32, 64], norm_num_groups=8, attention_head_dim=8)


def _aliased(model, source) -> list:
    """Names of `model`'s parameters sharing memory with `source`'s parameter of that name."""
    by_name = dict(source.parameters_and_names())
    return sorted(n for n, p in model.parameters_and_names() if n in by_name and p.data_ptr() == by_name[n].data_ptr())


def _tiny_flux():
    return md.FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
                                     attention_head_dim=8, num_attention_heads=2, joint_attention_dim=8,
                                     pooled_projection_dim=8, axes_dims_rope=(2, 2, 4))


CASES = {
    "controlnet": ("tiny", lambda unet: md.ControlNetModel.from_unet(unet)),
    "controlnet-random": ("tiny", lambda unet: md.ControlNetModel.from_unet(unet, load_weights_from_unet=False)),
    "sparse-controlnet": ("wide", lambda unet: md.SparseControlNetModel.from_unet(unet)),
    "motion": ("wide", lambda unet: md.UNetMotionModel.from_unet2d(unet)),
    "flux-controlnet": ("flux", lambda flux: md.FluxControlNetModel.from_transformer(
        flux, num_layers=1, num_single_layers=1, attention_head_dim=8, num_attention_heads=2)),
}


@pytest.mark.parametrize("case", CASES)
def test_same_model_as_unpatched(unets, case):
    which, build = CASES[case]
    unet = unets[which]
    reference, accelerated = load_both(lambda: build(unet))  # raises if the random state ends elsewhere
    assert_same_model(reference, accelerated)
    report = ms_loadpatch.last_report()
    assert report is not None and report.model_class == type(accelerated).__name__
    assert "draws taken when made" in report.technique
    assert report.missing_initialised > 0  # what the source lacks was filled here, not at creation
    shared = _aliased(reference, unet)
    assert _aliased(accelerated, unet) == shared
    assert bool(shared) is (case != "controlnet-random")
    # what the plain build leaves on every parameter, also where load_param_into_net wrote to a lazy one
    for (name, ref), (_, acc) in zip(reference.parameters_and_names(), accelerated.parameters_and_names()):
        assert ("init_param" in vars(acc)) == ("init_param" in vars(ref)), name
        assert getattr(acc, "init_mode", None) is None and not acc.has_init, name


def test_zeroed_blocks_and_random_embedding(unets):
    """What the UNet lacks: the conditioning embedding keeps its initializers'
    values (the same draws), the zero modules are zeros."""
    reference, accelerated = load_both(lambda: md.ControlNetModel.from_unet(unets["tiny"]))
    for model in (reference, accelerated):
        assert not model.controlnet_mid_block.weight.asnumpy().any()
        assert model.controlnet_cond_embedding.conv_in.weight.asnumpy().std() > 0
    np.testing.assert_array_equal(accelerated.controlnet_cond_embedding.conv_in.weight.asnumpy(),
                                  reference.controlnet_cond_embedding.conv_in.weight.asnumpy())


def test_failure_halfway_leaves_the_process_as_it_was(unets):
    """A UNet whose down block is float16 fails load_param_into_net's strict
    dtype check after the build: the same error, the same random state, and
    nothing of the plugin left behind."""
    from test_bad_input import assert_state_restored, process_state, raised

    unet = unets["tiny"]
    param = unet.down_blocks[0].resnets[0].conv1.weight
    param.set_dtype(ms.float16)
    try:
        start = np.random.get_state()
        with ms_loadpatch.disabled():
            unpatched = raised(lambda: md.ControlNetModel.from_unet(unet))
        after_unpatched = np.random.get_state()
        np.random.set_state(start)
        before = process_state()
        patched = raised(lambda: md.ControlNetModel.from_unet(unet))
        assert_state_restored(before)
    finally:
        param.set_dtype(ms.float32)
    assert type(patched) is type(unpatched) and str(patched) == str(unpatched)
    assert np.random.get_state()[2] == after_unpatched[2]
    assert (np.random.get_state()[1] == after_unpatched[1]).all()


def test_float16_source_runs_plainly():
    """A source in another dtype: the plain build casts its random float32
    values to it, which a lazy build, filling in that dtype, cannot round the
    same way; the call runs as mindone's."""
    from ms_loadpatch.strategy import context

    with ms_loadpatch.disabled():
        unet = md.UNet2DConditionModel(**_wide_config()).to(ms.float16)
    before = context.last_report()
    reference, accelerated = load_both(lambda: md.UNetMotionModel.from_unet2d(unet))
    assert context.last_report() is before  # no accelerated call happened
    assert_same_model(reference, accelerated)
    assert accelerated.dtype == ms.float16
