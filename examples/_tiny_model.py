"""Shared by the examples: a tiny Qwen2 checkpoint generated locally (no
download), and the CPU kernel stand-ins mindone needs on mindspore's CPU wheel.

train.py must stay a script that knows nothing about the plugin: this
module never leaves ms_loadpatch enabled unless it already was.
"""

import contextlib
import os
import sys
import tempfile

TINY_QWEN2 = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=64)


def cpu_fallbacks():
    """mindspore's CPU wheel lacks kernels mindone calls (`mint.arange`,
    RmsNorm, ...): on CPU, ms_loadpatch.testing routes them to equivalent ops.
    Not needed on Ascend."""
    import mindspore as ms

    if ms.get_context("device_target") != "CPU":
        return contextlib.nullcontext()
    already_imported = "ms_loadpatch" in sys.modules
    import ms_loadpatch
    from ms_loadpatch.testing import cpu_kernel_fallbacks

    if not already_imported:
        ms_loadpatch.disable()  # imported only for the helper: `import ms_loadpatch` would have enabled it
    return cpu_kernel_fallbacks()


def tiny_model(directory=None):
    """Path of a tiny Qwen2ForCausalLM checkpoint, written on first use."""
    directory = directory or os.path.join(tempfile.gettempdir(), "ms_loadpatch_example_qwen2")
    if os.path.isfile(os.path.join(directory, "config.json")):
        return directory
    import mindspore as ms
    from transformers import Qwen2Config

    from mindone.transformers import Qwen2ForCausalLM

    ms.set_seed(0)
    partial = f"{directory}.partial-{os.getpid()}"
    with cpu_fallbacks():
        model = Qwen2ForCausalLM(Qwen2Config(**TINY_QWEN2))
        model.save_pretrained(partial)
    try:
        os.rename(partial, directory)  # whole or not at all: other processes may be waiting for it
    except OSError:  # another process got there first
        import shutil

        shutil.rmtree(partial, ignore_errors=True)
    return directory
