"""Progress of a long read (strategy/progress.py): a line on a terminal
that moves with the bytes read, ending at the checkpoint's size; nothing
where stderr is not a terminal or the library's progress bars are off."""

import io
import os
import sys
import threading

import mindone.transformers as mt
import pytest
from _helpers import tiny_qwen2_config

import ms_loadpatch
from ms_loadpatch.strategy import progress
from ms_loadpatch.testing import assert_same_model, cpu_kernel_fallbacks

pytestmark = pytest.mark.usefixtures("cpu_kernels", "plugin_enabled")


class Terminal(io.StringIO):
    def __init__(self, terminal=True):
        super().__init__()
        self.terminal = terminal

    def isatty(self):
        return self.terminal


def test_lines_follow_the_bytes_and_end_with_a_newline():
    stream = Terminal()
    shown = progress.ReadProgress(3_000_000, stream=stream, after=0.0, every=0.01).start()
    first, second = shown.file(), shown.file()
    adders = [threading.Thread(target=lambda c=c: [c.add(1000) for _ in range(500)]) for c in (first, first, second)]
    for adder in adders:
        adder.start()
    for adder in adders:
        adder.join()
    first.done(1_000_000)  # counted in full: nothing added
    second.done(2_000_000)  # a header's bytes not counted by the data reads: added
    assert shown.read == 3_000_000
    shown.close()
    text = stream.getvalue()
    last = text.rsplit("\r", 1)[1]
    assert last.startswith("ms_loadpatch: read 3.00 of 3.00 MB (") and last.endswith(" MB/s)\n"), text
    assert text.count("\n") == 1 and text.startswith("\rms_loadpatch: read ")


def test_a_short_load_draws_nothing():
    stream = Terminal()
    shown = progress.ReadProgress(10, stream=stream, after=60.0).start()
    shown.add(10)
    shown.close()
    assert stream.getvalue() == ""


def test_wanted_only_on_a_terminal_with_bars_on():
    assert progress.wanted(Terminal(), None)
    assert progress.wanted(Terminal(), lambda: True)
    assert not progress.wanted(Terminal(), lambda: False)
    assert not progress.wanted(Terminal(terminal=False), None)
    closed = open(os.devnull, "w")
    closed.close()
    assert not progress.wanted(closed, None)  # isatty() on a closed file raises


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("progress") / "qwen2"
    with ms_loadpatch.disabled(), cpu_kernel_fallbacks():
        mt.Qwen2ForCausalLM(tiny_qwen2_config()).save_pretrained(directory, max_shard_size="20KB")
    return str(directory)


@pytest.mark.parametrize("setting", ["terminal", "not a terminal", "bars off"])
def test_a_load_shows_its_read_on_a_terminal_only(checkpoint, monkeypatch, setting):
    from transformers.utils import logging as hf_logging

    monkeypatch.setattr(progress, "PROGRESS_AFTER", 0.0)
    monkeypatch.setattr(progress, "PROGRESS_EVERY", 0.001)
    stream = Terminal(terminal=setting != "not a terminal")
    monkeypatch.setattr(sys, "stderr", stream)
    if setting == "bars off":
        hf_logging.disable_progress_bar()
    try:
        accelerated = mt.Qwen2ForCausalLM.from_pretrained(checkpoint)
    finally:
        hf_logging.enable_progress_bar()
    ours = [line for line in stream.getvalue().split("\r") if line.startswith("ms_loadpatch: read")]
    if setting != "terminal":
        assert ours == []
    else:
        size = sum(
            os.path.getsize(os.path.join(checkpoint, n)) for n in os.listdir(checkpoint) if n.endswith(".safetensors")
        )
        assert ours and ours[-1].startswith(f"ms_loadpatch: read {size / 1e6:.2f} of {size / 1e6:.2f} MB")
        assert ours[-1].endswith("\n")
    assert not any(t.name == "ms_loadpatch-progress" and t.is_alive() for t in threading.enumerate())
    monkeypatch.undo()
    with ms_loadpatch.disabled():
        assert_same_model(mt.Qwen2ForCausalLM.from_pretrained(checkpoint), accelerated)
