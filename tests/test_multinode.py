"""Jobs of several "nodes" on this machine: one msrun launch per node
(`--node_rank`), each with its own MS_LOADPATCH_NODE_ID and, where FUSE is
available, its own mount of one storage harness (tools/slow_storage.py:
each mount has its own page cache, one process counts what the storage
serves). Every job ends by itself or is killed at JOB_SECONDS and fails.

- the nodes split the reading and hand each other the bytes
  (strategy/cooperative.py): the storage serves the checkpoint once, every
  rank's model bit for bit the unpatched load's;
- ranks that disagree about the checkpoint each read alone, correctly;
- a rank that never enters the agreement, a read error on a reading rank
  and a rank killed mid-load end the job with errors, never a hang.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from ms_loadpatch.strategy.cooperative import read_layouts
from ms_loadpatch.tools import slow_storage

from test_multirank import _arrays, _assert_same_arrays, _free_port, _msrun, _worker_logs

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "_msrun_worker.py")
JOB_SECONDS = 240
CHUNK_MB = 4
# The checkpoint: two shards of about 17 MB (fp32)
_CONFIG = dict(
    vocab_size=16384,
    hidden_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=512,
)

needs_fuse = pytest.mark.skipif(slow_storage.unavailable() is not None, reason=f"{slow_storage.unavailable()}")


def _python(code, *args, env=None):
    proc = subprocess.run(
        [sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


_SAVE = """
import sys, mindspore as ms
from transformers import Qwen2Config
import ms_loadpatch; ms_loadpatch.disable()
from ms_loadpatch.testing import cpu_kernel_fallbacks
from mindone.transformers import Qwen2ForCausalLM
ms.set_seed(int(sys.argv[2]))
with cpu_kernel_fallbacks():
    Qwen2ForCausalLM(Qwen2Config(**{config})).save_pretrained(sys.argv[1], max_shard_size="20MB")
"""

_UNPATCHED = """
import sys, numpy as np
import ms_loadpatch; ms_loadpatch.disable()
from ms_loadpatch.testing import cpu_kernel_fallbacks
from mindone.transformers import AutoModelForCausalLM
with cpu_kernel_fallbacks():
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
np.savez(sys.argv[2], **{name: p.float().asnumpy() for name, p in model.parameters_and_names()})
"""


def _checkpoint(directory, seed):
    _python(_SAVE.format(config=_CONFIG), directory, seed)
    assert len(list(directory.glob("*.safetensors"))) == 2
    reference = directory.parent / f"{directory.name}-unpatched.npz"
    _python(_UNPATCHED, directory, reference)
    return directory, reference


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return _checkpoint(tmp_path_factory.mktemp("multinode") / "qwen2", 0)


def _file_bytes(directory) -> int:
    return sum(path.stat().st_size for path in directory.glob("*.safetensors"))


def run_nodes(directory, nodes, ranks_per_node, model, env_extra=None, node_env=None, while_running=None):
    """One job of `nodes` msrun launches of `ranks_per_node` workers each, loading `model` ({node} replaced by
    node<i>); returns (exit codes, per-rank results, per-rank failures, seconds)."""
    out, port = directory / "out", _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("MS_LOADPATCH", "MS_LOADPATCH_REPORT")}
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env["MS_LOADPATCH_COOPERATIVE_CHUNK_MB"] = str(CHUNK_MB)
    env.update(env_extra or {})
    procs = []
    started = time.monotonic()
    for node in range(nodes):
        node_env_i = {**env, "MS_LOADPATCH_NODE_ID": f"node{node}", **((node_env or {}).get(node, {}))}
        command = [
            *_msrun(),
            f"--worker_num={nodes * ranks_per_node}",
            f"--local_worker_num={ranks_per_node}",
            f"--node_rank={node}",
            "--master_addr=127.0.0.1",
            f"--master_port={port}",
            "--join=True",
            "--cluster_time_out=120",
            f"--log_dir={directory / f'logs{node}'}",
            WORKER,
            "--out",
            str(out),
            "--model",
            str(model),
            "--import",
        ]
        log = open(directory / f"msrun{node}.out", "w")
        procs.append(
            subprocess.Popen(
                command, env=node_env_i, cwd=directory, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        )
        log.close()
        if node == 0:
            _wait_for_scheduler(port, procs[0])
    try:
        if while_running is not None:
            while_running(out)
        deadline = started + JOB_SECONDS
        for proc in procs:
            proc.wait(timeout=max(1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        for proc in procs:
            with_group = os.getpgid(proc.pid) if proc.poll() is None else None
            if with_group:
                os.killpg(with_group, signal.SIGKILL)
        pytest.fail(f"a {nodes}-node job did not end within {JOB_SECONDS} s\n" + _all_logs(directory))
    seconds = time.monotonic() - started
    results, failures = {}, {}
    for rank in range(nodes * ranks_per_node):
        for name, into in ((f"rank{rank}.json", results), (f"rank{rank}-failure.json", failures)):
            if (out / name).exists():
                into[rank] = json.loads((out / name).read_text())
    return [proc.returncode for proc in procs], results, failures, seconds


def _wait_for_scheduler(port, proc, seconds=60):
    """Until node 0's scheduler listens on `port` (so that it, not another launch's, is the job's)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and proc.poll() is None:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)


def _all_logs(directory) -> str:
    parts = [_worker_logs_in(directory / f"logs{i}") for i in range(4)]
    parts += [p.read_text(errors="replace")[-2000:] for p in sorted(directory.glob("msrun*.out"))]
    parts.append(_worker_logs(directory) if (directory / "logs").exists() else "")
    return "\n".join(parts)


def _worker_logs_in(logs) -> str:
    return "\n".join(
        f"--- {path}\n" + path.read_text(errors="replace")[-3000:] for path in sorted(logs.glob("worker_*.log"))
    )


def _launch_failed(directory, node, code) -> bool:
    """Whether launch `node` failed. msrun on the host of the master address
    starts a scheduler: on this one host every launch does, and the second's
    cannot bind the port, so msrun exits 1 after its workers succeeded."""
    if code == 0:
        return False
    scheduler = directory / f"logs{node}" / "scheduler.log"
    duplicate = node > 0 and scheduler.exists() and "Failed to init the tcp server" in scheduler.read_text(errors="replace")
    output = (directory / f"msrun{node}.out").read_text(errors="replace")
    return not duplicate or "Worker process" in output and "exit with exception" in output


def _assert_loaded(directory, codes, results, ranks, reference, references=None):
    failed = [node for node, code in enumerate(codes) if _launch_failed(directory, node, code)]
    assert not failed and sorted(results) == list(range(ranks)), (
        f"exit codes {codes}, reports from ranks {sorted(results)}\n" + _all_logs(directory)
    )
    for rank in range(ranks):
        if references is not None:
            reference = references[rank]
        report = results[rank]["report"]
        assert report is not None, f"rank {rank}: the load was not accelerated"
        assert results[rank]["threads_after_load"] == [], results[rank]["threads_after_load"]
        _assert_same_arrays(
            _arrays(reference), _arrays(directory / "out" / f"rank{rank}-loaded.npz"), f"rank {rank} loaded"
        )


@needs_fuse
@pytest.mark.parametrize("nodes,ranks_per_node", [(2, 1), (2, 2), (3, 1)])
def test_nodes_read_each_byte_once(checkpoint, tmp_path, nodes, ranks_per_node):
    """Through one storage harness mounted once per node: it serves the
    checkpoint's bytes about once (not once per node), each node reads
    about its share, and every rank loads what the unpatched load gives."""
    model, reference = checkpoint
    with slow_storage.SlowStorage(model, slow_storage.StorageSettings(latency_ms=0.0), mounts=nodes) as storage:
        for node in range(nodes):
            os.symlink(storage.mountpoints[node], tmp_path / f"node{node}")
        codes, results, _, _ = run_nodes(
            tmp_path, nodes, ranks_per_node, tmp_path / "{node}", {"MS_LOADPATCH_COOPERATIVE": "on"}
        )
        served = storage.served()[0]
    ranks = nodes * ranks_per_node
    _assert_loaded(tmp_path, codes, results, ranks, reference)
    size = _file_bytes(model)
    assert served <= 1.05 * size, f"the storage served {served} bytes for a checkpoint of {size} ({served / size:.2f}x)"
    _assert_shared(results, nodes, ranks, model)


def _assert_shared(results, nodes, ranks, model):
    """One rank per node read from storage, about 1/nodes of the data each; every rank has all of it."""
    data = sum(layout.data_len for layout in read_layouts(sorted(model.glob("*.safetensors")))[0])
    from_storage = [results[rank]["report"]["bytes_from_storage"] for rank in range(ranks)]
    readers = [rank for rank in range(ranks) if from_storage[rank]]
    assert len(readers) == nodes and sum(from_storage) == data, f"bytes from storage per rank: {from_storage}"
    assert max(from_storage) <= 1.5 * data / nodes, f"the nodes' shares are unbalanced: {from_storage}"
    for rank in range(ranks):
        report = results[rank]["report"]
        assert report["cooperative"].startswith(f"with the job: {nodes} nodes"), report["cooperative"]
        assert report["bytes_from_storage"] + report["bytes_received"] == data, report


def test_nodes_on_one_disk_share_the_reading(checkpoint, tmp_path):
    """Without FUSE: two "nodes" reading the same local files still split the
    reading and hand each other the bytes, every rank bit-identical."""
    model, reference = checkpoint
    for node in range(2):
        os.symlink(model, tmp_path / f"node{node}")
    codes, results, _, _ = run_nodes(tmp_path, 2, 1, tmp_path / "{node}", {"MS_LOADPATCH_COOPERATIVE": "on"})
    _assert_loaded(tmp_path, codes, results, 2, reference)
    _assert_shared(results, 2, 2, model)


def test_nodes_loading_other_checkpoints_each_read_alone(checkpoint, tmp_path_factory, tmp_path):
    """Node 1 loads another checkpoint of the same shapes: the agreement sees
    it, both nodes read alone (the report says why), each rank gets its own
    checkpoint's values."""
    model, reference = checkpoint
    other, other_reference = _checkpoint(tmp_path_factory.mktemp("other") / "qwen2", 1)
    os.symlink(model, tmp_path / "node0")
    os.symlink(other, tmp_path / "node1")
    codes, results, _, _ = run_nodes(tmp_path, 2, 1, tmp_path / "{node}", {"MS_LOADPATCH_COOPERATIVE": "on"})
    _assert_loaded(tmp_path, codes, results, 2, None, references=[reference, other_reference])
    for rank in range(2):
        report = results[rank]["report"]
        assert report["cooperative"] == "alone: rank 1 loads other files than rank 0 (names, sizes or headers differ)"
        assert report["bytes_received"] is None


def test_a_rank_that_never_enters_the_agreement(checkpoint, tmp_path):
    """Node 1 runs unpatched (MS_LOADPATCH=0) and never enters the
    agreement: node 0 waits no longer than the collective's own timeout,
    then reads alone; both ranks load the checkpoint's values."""
    model, reference = checkpoint
    for node in range(2):
        os.symlink(model, tmp_path / f"node{node}")
    codes, results, _, seconds = run_nodes(
        tmp_path, 2, 1, tmp_path / "{node}", {"MS_LOADPATCH_COOPERATIVE": "on"}, {1: {"MS_LOADPATCH": "0"}}
    )
    assert not any(_launch_failed(tmp_path, node, code) for node, code in enumerate(codes)), _all_logs(tmp_path)
    assert results[1]["report"] is None and not results[1]["enabled"]
    assert results[0]["report"]["cooperative"].startswith("alone: the agreement over the job's collective failed")
    for rank in range(2):
        _assert_same_arrays(_arrays(reference), _arrays(tmp_path / "out" / f"rank{rank}-loaded.npz"), f"rank {rank}")


def _assert_failed_cleanly(directory, failures, rank, *texts):
    assert rank in failures, f"rank {rank} wrote no failure report\n" + _all_logs(directory)
    failure = failures[rank]
    assert all(text in failure["error"] for text in texts), failure
    assert failure["state_restored"] == "yes", failure["state_restored"]
    assert failure["threads_left"] == [], failure["threads_left"]


@needs_fuse
def test_a_read_error_reaches_every_rank(checkpoint, tmp_path):
    """The storage fails every read after half the checkpoint: each rank's
    load fails with an error naming a checkpoint file, none waits for bytes
    that never come, and each process is left as it was."""
    model, _ = checkpoint
    settings = slow_storage.StorageSettings(latency_ms=0.0, fail_after_bytes=_file_bytes(model) // 2)
    with slow_storage.SlowStorage(model, settings, mounts=2) as storage:
        for node in range(2):
            os.symlink(storage.mountpoints[node], tmp_path / f"node{node}")
        codes, _, failures, _ = run_nodes(tmp_path, 2, 1, tmp_path / "{node}", {"MS_LOADPATCH_COOPERATIVE": "on"})
    assert codes[0] != 0
    for rank in range(2):
        _assert_failed_cleanly(tmp_path, failures, rank, "model-0000")
        assert failures[rank]["error_type"] == "CheckpointError", failures[rank]


@needs_fuse
def test_a_rank_killed_mid_load(checkpoint, tmp_path):
    """Rank 1 is killed while the checkpoint crosses the job: rank 0's load
    ends (the collective's timeout) with an error naming rank 1, its
    process as it was; the job ends."""
    model, _ = checkpoint
    settings = slow_storage.StorageSettings(latency_ms=2.0, total_mb_s=8.0)

    def kill_rank_1_once_reading(out):
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if storage.served()[0] > _file_bytes(model) // 4 and (out / "rank1.pid").exists():
                os.kill(int((out / "rank1.pid").read_text()), signal.SIGKILL)
                return
            time.sleep(0.05)
        pytest.fail("the job never got far enough to kill rank 1\n" + _all_logs(tmp_path))

    with slow_storage.SlowStorage(model, settings, mounts=2) as storage:
        for node in range(2):
            os.symlink(storage.mountpoints[node], tmp_path / f"node{node}")
        codes, results, failures, _ = run_nodes(
            tmp_path, 2, 1, tmp_path / "{node}", {"MS_LOADPATCH_COOPERATIVE": "on"},
            while_running=kill_rank_1_once_reading,
        )
    assert 0 not in results, "rank 0 returned a model although rank 1 died mid-load"
    _assert_failed_cleanly(tmp_path, failures, 0, "rank(s) 1")
