"""A seeded script draws the same numbers after a call with the plugin on as
without it: numpy's global RandomState (mindspore's initializers seed from
it), Python's random, mindspore's default generator. Fresh processes, one
PYTHONHASHSEED, the first call of a process (the probes run) and a later one.
"""

import json
import os
import subprocess
import sys

import pytest

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_random_state_child.py")
# the version matrix runs the probes, what differs between mindspore versions (2 processes a version)
CASES = ["diffusers-unet", "diffusers-vae", "transformers-from-config", pytest.param("probes", marks=pytest.mark.matrix)]


def run_python(args, env_extra):
    env = {k: v for k, v in os.environ.items() if k != "MS_LOADPATCH"}
    env.update(env_extra)
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=600,
                          cwd=os.path.dirname(CHILD))


@pytest.fixture(scope="module")
def diffusers_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("random-state")
    code = f"""
import os
os.environ["MS_LOADPATCH"] = "0"
import mindone.diffusers as D
from ms_loadpatch.testing import cpu_kernel_fallbacks
with cpu_kernel_fallbacks():
    D.UNet2DConditionModel(block_out_channels=(4, 8), layers_per_block=1, sample_size=8, in_channels=4,
        out_channels=4, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=8, norm_num_groups=4,
        attention_head_dim=2).save_pretrained(os.path.join({str(root)!r}, "diffusers-unet"))
    D.AutoencoderKL(block_out_channels=[4, 8], in_channels=3, out_channels=3,
        down_block_types=["DownEncoderBlock2D"] * 2, up_block_types=["UpDecoderBlock2D"] * 2, latent_channels=4,
        norm_num_groups=4, sample_size=16).save_pretrained(os.path.join({str(root)!r}, "diffusers-vae"))
"""
    proc = run_python(["-c", code], env_extra={"MS_LOADPATCH": "0"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return str(root)


def _draws(case, directory, plugin: bool):
    env = {"PYTHONHASHSEED": "0", "GLOG_v": "3"}
    if not plugin:
        env["MS_LOADPATCH"] = "0"
    proc = run_python([CHILD, case, directory], env_extra=env)
    for line in proc.stdout.splitlines():
        if line.startswith("DRAWS "):
            result = json.loads(line[len("DRAWS "):])
            assert result["enabled"] is plugin
            return result
    raise AssertionError(f"no DRAWS line; exit {proc.returncode}\n{proc.stderr[-4000:]}")


@pytest.mark.parametrize("case", CASES)
def test_global_random_state_after_call_is_unpatched(case, diffusers_checkpoints):
    unpatched = _draws(case, diffusers_checkpoints, plugin=False)
    patched = _draws(case, diffusers_checkpoints, plugin=True)
    # Where ms.set_seed does not fix mindspore's default generator (2.7.0: a state of its own per
    # process), what both processes must agree on is whether each call moved it from there.
    comparable = unpatched["seeded"] == patched["seeded"]
    for call, (want, got) in enumerate(zip(unpatched["after"], patched["after"]), start=1):
        if not comparable:
            want["mindspore"] = want["mindspore"] != unpatched["seeded"]
            got["mindspore"] = got["mindspore"] != patched["seeded"]
        assert got == want, f"{case}, call {call}: global random state differs from an unpatched process"


def test_kept_restores_numpy_and_python_generators_even_on_error(monkeypatch):
    """kept() launches no mindspore op: reading mindspore's generator state
    from two threads' first loads at once hung mindspore 2.10 (found by
    benchmarks/stress_loads.py)."""
    import random

    import mindspore as ms
    import numpy as np

    from ms_loadpatch.strategy import randomstate

    def no_op_allowed(*args, **kwargs):
        raise AssertionError("kept() must not launch a mindspore op")

    monkeypatch.setattr(ms, "get_rng_state", no_op_allowed)
    monkeypatch.setattr(ms, "set_rng_state", no_op_allowed)
    np.random.seed(3)
    random.seed(3)
    expected = (np.random.rand(), random.random())
    np.random.seed(3)
    random.seed(3)
    with pytest.raises(ValueError):
        with randomstate.kept():
            np.random.rand(5)
            random.random()
            raise ValueError("inside")
    assert (np.random.rand(), random.random()) == expected
