"""The fixed-seed slice of benchmarks/fuzz_loads.py: broken checkpoints
loaded patched and unpatched in a fresh process (tiny Qwen2 single and
sharded, tiny VAE, direct reads of 1 and 10,000 tensors). Every case must
hold the property its docstring states; the long run is by hand:
    python benchmarks/fuzz_loads.py --cases 20000 --seed 1

Besides the slice, regression cases the campaign found, replayed directly.
"""

import json
import os
import re
import subprocess
import sys

import pytest
from _helpers import REPO

sys.path.insert(0, os.path.join(REPO, "benchmarks"))


def test_fuzz_slice():
    env = dict(os.environ)
    env.pop("MS_LOADPATCH", None)
    proc = subprocess.run(
        [sys.executable, "benchmarks/fuzz_loads.py", "--cases", "60", "--seed", "0"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    detail = f"exit {proc.returncode}\nstdout:\n{proc.stdout[-6000:]}\nstderr:\n{proc.stderr[-3000:]}"
    lines = [line for line in proc.stdout.splitlines() if line.startswith("SUMMARY ")]
    assert lines, detail
    fields = dict(re.findall(r"(\w+)=(\S+)", lines[-1]))
    assert proc.returncode == 0 and fields["failures"] == "0", detail
    assert int(fields["cases"]) == 60, detail
    # the slice meets both outcomes and the full loads, not only the cheap reads
    assert int(fields["loaded"]) > 0 and int(fields["refused"]) > 0, detail
    targets = dict(item.split(":") for item in fields["targets"].split(","))
    assert {"tf-single", "tf-sharded", "df-single"} <= targets.keys(), detail


def test_mutations_change_the_file():
    """The harness breaks what it says: each header edit gives other bytes, the last entry's."""
    import fuzz_loads
    import numpy as np
    from safetensors.numpy import save

    blob = save({"a": np.zeros(4, np.float32), "b": np.ones(3, np.float16)}, metadata={"format": "pt"})
    header, _ = fuzz_loads._split(blob)
    assert fuzz_loads._last_entry(header) == max(("a", "b"), key=lambda k: header[k]["data_offsets"][0])
    for kind in fuzz_loads.HEADER_KINDS + fuzz_loads.BYTE_KINDS:
        assert fuzz_loads.mutate_file(blob, kind, 3, 5) != blob, kind
    renamed, _ = fuzz_loads._split(fuzz_loads.mutate_file(blob, "rename", 0, 0))
    assert fuzz_loads._last_entry(header) + "_renamed" in renamed


@pytest.mark.usefixtures("cpu_kernels", "plugin_enabled")
def test_broken_index_error_names_the_index(tmp_path):
    """A shard index that is not JSON: mindone's JSONDecodeError says where
    the text broke; the patched load's, the same type, names the index too."""
    import mindone.transformers as mt
    from _helpers import tiny_qwen2_config

    import ms_loadpatch
    from ms_loadpatch.testing import cpu_kernel_fallbacks

    with ms_loadpatch.disabled(), cpu_kernel_fallbacks():
        mt.Qwen2ForCausalLM(tiny_qwen2_config()).save_pretrained(tmp_path, max_shard_size="40KB")
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(index.read_text()[:-3])
    with ms_loadpatch.disabled(), pytest.raises(json.JSONDecodeError) as unpatched:
        mt.Qwen2ForCausalLM.from_pretrained(str(tmp_path))
    with pytest.raises(json.JSONDecodeError) as patched:
        mt.Qwen2ForCausalLM.from_pretrained(str(tmp_path))
    assert str(index) not in str(unpatched.value)
    assert str(index) in str(patched.value) and patched.value.pos == unpatched.value.pos


def test_safetensors_errors_are_checkpoint_errors():
    """mindone's own check raises the library's SafetensorError; the patched
    one raises that type and the plugin's CheckpointError in one."""
    from safetensors import SafetensorError

    from ms_loadpatch.strategy.safetensors_header import CheckpointError, SafetensorsFileError

    error = SafetensorsFileError("/x/model.safetensors", "header is not valid JSON")
    assert isinstance(error, SafetensorError) and isinstance(error, CheckpointError)
    assert "/x/model.safetensors" in str(error)


@pytest.mark.usefixtures("cpu_kernels", "plugin_enabled")
def test_unknown_metadata_format_error_names_the_file(tmp_path):
    """A single file whose metadata format mindone does not know: its
    ValueError says only the format; the patched one, the same type and
    text, names the file too."""
    import mindone.transformers as mt
    import numpy as np
    from _helpers import tiny_qwen2_config
    from safetensors.numpy import load_file, save_file

    import ms_loadpatch

    with ms_loadpatch.disabled():
        mt.Qwen2ForCausalLM(tiny_qwen2_config()).save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    save_file(
        {k: np.ascontiguousarray(v) for k, v in load_file(str(path)).items()}, str(path), metadata={"format": "xx"}
    )
    with ms_loadpatch.disabled(), pytest.raises(ValueError) as unpatched:
        mt.Qwen2ForCausalLM.from_pretrained(str(tmp_path))
    with pytest.raises(ValueError) as patched:
        mt.Qwen2ForCausalLM.from_pretrained(str(tmp_path))
    assert str(path) not in str(unpatched.value)
    assert str(patched.value).startswith(str(unpatched.value)) and str(path) in str(patched.value)


@pytest.mark.matrix  # mindspore's load_param_into_net, per version
@pytest.mark.usefixtures("cpu_kernels", "plugin_enabled")
def test_extra_trailing_ones_load_as_unpatched(tmp_path):
    """A diffusers checkpoint tensor with extra trailing 1-dims: mindspore's
    load_param_into_net takes it, and the parameter ends with the file's
    shape; the patched load gives the same model. With another element count
    both raise numpy's ValueError."""
    import mindone.diffusers as md
    import numpy as np
    from _helpers import tiny_vae
    from safetensors.numpy import load_file, save_file

    import ms_loadpatch
    from ms_loadpatch.testing import assert_same_model, load_both

    with ms_loadpatch.disabled():
        md.AutoencoderKL(**tiny_vae()).save_pretrained(tmp_path)
    path = tmp_path / "diffusion_pytorch_model.safetensors"
    tensors = load_file(str(path))
    weight = tensors["quant_conv.weight"]
    tensors["quant_conv.weight"] = weight.reshape(weight.shape + (1,))
    save_file(tensors, str(path), metadata={"format": "pt"})
    reference, accelerated = load_both(lambda: md.AutoencoderKL.from_pretrained(str(tmp_path)))
    assert_same_model(reference, accelerated)
    assert accelerated.quant_conv.weight.shape == weight.shape + (1,)
    tensors["quant_conv.weight"] = np.ascontiguousarray(tensors["quant_conv.weight"][:4])
    save_file(tensors, str(path), metadata={"format": "pt"})
    with ms_loadpatch.disabled(), pytest.raises(ValueError) as unpatched:
        md.AutoencoderKL.from_pretrained(str(tmp_path))
    with pytest.raises(ValueError) as patched:
        md.AutoencoderKL.from_pretrained(str(tmp_path))
    assert str(patched.value).startswith(str(unpatched.value)) and str(path) in str(patched.value)


def test_mutation_chains_never_break_the_harness():
    """Any chain of mutations gives bytes: a harness error would end a long run early."""
    import fuzz_loads
    import numpy as np
    from hypothesis import example, given, settings
    from hypothesis import strategies as st
    from safetensors.numpy import save

    blob = save({"a": np.zeros(4, np.float32), "b": np.ones((2, 3), np.float16)}, metadata={"format": "pt"})

    @settings(max_examples=300, derandomize=True, database=None, deadline=None)
    @given(
        st.lists(
            st.tuples(
                st.sampled_from(fuzz_loads.HEADER_KINDS + fuzz_loads.BYTE_KINDS),
                st.integers(0, 1 << 20),
                st.integers(0, 1 << 16),
            ),
            min_size=1,
            max_size=5,
        )
    )
    @example([("length-field", 0, 1), ("length-field", 16, 0)])  # a length of 2**64 - 1, then one past it
    def chain(mutations):
        mutated = blob
        for kind, a, b in mutations:
            mutated = fuzz_loads.mutate_file(mutated, kind, a, b)
        assert isinstance(mutated, bytes)

    chain()
