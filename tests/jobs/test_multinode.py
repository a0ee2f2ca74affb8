"""Jobs of several "nodes" on this machine: one msrun launch per node
(`--node_rank`), each with its own MS_LOADPATCH_NODE_ID and, where FUSE is
available, its own mount of one storage harness (tools/slow_storage.py:
each mount has its own page cache, one process counts what the storage
serves). Every job ends by itself or is killed at JOB_SECONDS and fails.

- the nodes split the reading and hand each other the bytes
  (strategy/cooperative.py): the storage serves the checkpoint once, every
  rank's model bit for bit the unpatched load's;
- ranks that disagree about the checkpoint each read alone, correctly;
- a rank that never enters the agreement, a read error on a reading rank,
  a rank killed mid-load and one whose load fails end the job with errors
  naming the rank or file, never a hang.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _helpers import TESTS_DIR, assert_same_arrays, npz_arrays

from ms_loadpatch.strategy.shares import read_layouts
from ms_loadpatch.tools import slow_storage
from ms_loadpatch.tools.nodes import NodesJob

HERE = TESTS_DIR
WORKER = os.path.join(HERE, "_msrun_worker.py")
JOB_SECONDS = 240
CHUNK_MB = 4
SEED = 7
COOPERATE = {"MS_LOADPATCH_COOPERATIVE": "on"}
WAIT, WAIT_VAR = 10, "MS_LOADPATCH_COOPERATIVE_WAIT"  # the default wait for every rank to reach a load
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
import json, sys, numpy as np, mindspore as ms
sys.path.insert(0, sys.argv[4])
import ms_loadpatch; ms_loadpatch.disable()
from ms_loadpatch.testing import cpu_kernel_fallbacks
from mindone.transformers import AutoModelForCausalLM
from _process_state import random_state_digest
kwargs = {"dtype": getattr(ms, sys.argv[3])} if sys.argv[3] != "-" else {}
with cpu_kernel_fallbacks():
    ms.set_seed(int(sys.argv[5]))
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1], **kwargs)
    state = random_state_digest()
np.savez(sys.argv[2], **{name: p.float().asnumpy() for name, p in model.parameters_and_names()})
with open(sys.argv[2][:-4] + ".json", "w") as f:
    json.dump(state, f)
"""


def _unpatched(model, dtype=None):
    """The unpatched load of `model` (as `dtype`) after ms.set_seed(SEED): parameters in an .npz, the random
    state after it in a .json beside."""
    reference = model.parent / f"{model.name}-unpatched-{dtype or 'stored'}.npz"
    _python(_UNPATCHED, model, reference, dtype or "-", HERE, SEED)
    return reference


def _checkpoint(directory, seed):
    _python(_SAVE.format(config=_CONFIG), directory, seed)
    assert len(list(directory.glob("*.safetensors"))) == 2
    return directory, _unpatched(directory)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return _checkpoint(tmp_path_factory.mktemp("multinode") / "qwen2", 0)


def _file_bytes(directory) -> int:
    return sum(path.stat().st_size for path in directory.glob("*.safetensors"))


def run_nodes(directory, nodes, ranks_per_node, model, env_extra, node_env=None, while_running=None, args=()):
    """One job of `nodes` launches of `ranks_per_node` workers loading `model` ({node} replaced by node<i>,
    ms.set_seed(SEED) first); returns (the NodesJob, per-rank results, per-rank failures)."""
    out = directory / "out"
    env = {k: v for k, v in os.environ.items() if k not in ("MS_LOADPATCH", "MS_LOADPATCH_REPORT")}
    env["MS_LOADPATCH_COOPERATIVE_CHUNK_MB"] = str(CHUNK_MB)
    env.update(env_extra or {})
    worker_args = ["--out", out, "--model", model, "--import", "--seed", SEED, *args]
    job = NodesJob(directory, WORKER, worker_args, nodes, ranks_per_node, env, node_env)
    try:
        if while_running is not None:
            while_running(out)
        job.wait(JOB_SECONDS)
    except TimeoutError as exc:
        pytest.fail(f"{exc}\n{job.logs()}")
    finally:
        job.kill()
    results, failures = {}, {}
    for rank in range(nodes * ranks_per_node):
        for name, into in ((f"rank{rank}.json", results), (f"rank{rank}-failure.json", failures)):
            if (out / name).exists():
                into[rank] = json.loads((out / name).read_text())
    return job, results, failures


def _assert_loaded(job, results, ranks, references):
    """Every launch and rank ended well; each rank's parameters and random state those of the unpatched load of
    its checkpoint (`references`: one per rank, or one for all)."""
    assert not job.failed_launches() and sorted(results) == list(range(ranks)), (
        f"failed launches {job.failed_launches()}, reports from ranks {sorted(results)}\n{job.logs()}"
    )
    for rank in range(ranks):
        reference = references[rank] if isinstance(references, list) else references
        report = results[rank]["report"]
        assert report is not None, f"rank {rank}: the load was not accelerated"
        assert results[rank]["threads_after_load"] == [], results[rank]["threads_after_load"]
        assert_same_arrays(
            npz_arrays(reference),
            npz_arrays(Path(job.directory) / "out" / f"rank{rank}-loaded.npz"),
            f"rank {rank} loaded",
        )
        assert results[rank]["random_state"] == json.loads(reference.with_suffix(".json").read_text()), (
            f"rank {rank}: the random state after the load differs from the unpatched load's"
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
        job, results, _ = run_nodes(tmp_path, nodes, ranks_per_node, tmp_path / "{node}", COOPERATE)
        served = storage.served()[0]
    ranks = nodes * ranks_per_node
    _assert_loaded(job, results, ranks, reference)
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


@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_nodes_on_one_disk_share_the_reading(checkpoint, tmp_path, dtype):
    """Without FUSE: two "nodes" reading the same local files still split the
    reading and hand each other the bytes, every rank bit-identical to the
    unpatched load, also when it casts (fp32 file, bf16 model)."""
    model, reference = checkpoint
    if dtype is not None:
        reference = _unpatched(model, dtype)
    for node in range(2):
        os.symlink(model, tmp_path / f"node{node}")
    args = ["--dtype", dtype] if dtype else []
    job, results, _ = run_nodes(tmp_path, 2, 1, tmp_path / "{node}", COOPERATE, args=args)
    _assert_loaded(job, results, 2, reference)
    _assert_shared(results, 2, 2, model)


def test_nodes_loading_other_checkpoints_each_read_alone(checkpoint, tmp_path_factory, tmp_path):
    """Node 1 loads another checkpoint of the same shapes: the ranks' meetings
    are keyed by their files, so neither meets the other; both nodes read
    alone once the wait ends (the report says why), each rank gets its own
    checkpoint's values."""
    model, reference = checkpoint
    other, other_reference = _checkpoint(tmp_path_factory.mktemp("other") / "qwen2", 1)
    os.symlink(model, tmp_path / "node0")
    os.symlink(other, tmp_path / "node1")
    job, results, _ = run_nodes(tmp_path, 2, 1, tmp_path / "{node}", COOPERATE)
    _assert_loaded(job, results, 2, [reference, other_reference])
    for rank in range(2):
        report = results[rank]["report"]
        # rank 0 may end first, and with it the store its process served: rank 1's meeting then fails
        assert report["cooperative"] == f"alone: 1 of 2 ranks reached this load within {WAIT} s ({WAIT_VAR})" or (
            report["cooperative"].startswith("alone: the meeting in the job's store failed (TCP ")
        ), report["cooperative"]
        assert report["bytes_received"] is None


def test_a_rank_that_never_enters_the_agreement(checkpoint, tmp_path):
    """Node 1 runs unpatched (MS_LOADPATCH=0) and never reaches the
    meeting: node 0 waits MS_LOADPATCH_COOPERATIVE_WAIT, then reads alone;
    both ranks load the checkpoint's values."""
    model, reference = checkpoint
    for node in range(2):
        os.symlink(model, tmp_path / f"node{node}")
    job, results, _ = run_nodes(tmp_path, 2, 1, tmp_path / "{node}", COOPERATE, {1: {"MS_LOADPATCH": "0"}})
    assert not job.failed_launches() and sorted(results) == [0, 1], job.logs()
    assert results[1]["report"] is None and not results[1]["enabled"]
    assert results[0]["report"]["cooperative"] == f"alone: 1 of 2 ranks reached this load within {WAIT} s ({WAIT_VAR})"
    for rank in range(2):
        assert_same_arrays(
            npz_arrays(reference), npz_arrays(tmp_path / "out" / f"rank{rank}-loaded.npz"), f"rank {rank}"
        )


def _assert_failed_cleanly(job, failures, rank, *texts):
    assert rank in failures, f"rank {rank} wrote no failure report\n{job.logs()}"
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
        job, _, failures = run_nodes(tmp_path, 2, 1, tmp_path / "{node}", COOPERATE)
    for rank in range(2):
        _assert_failed_cleanly(job, failures, rank, "model-0000")
        assert failures[rank]["error_type"] == "CheckpointError", failures[rank]


@needs_fuse
def test_a_rank_killed_mid_load(checkpoint, tmp_path):
    """Rank 1 is killed while the checkpoint crosses the job: rank 0's load
    ends (the collective's timeout) with an error naming rank 1, its
    process as it was, and no model; where the collective never times out,
    mindspore's cluster ends rank 0, naming worker 1. The job ends."""
    model, _ = checkpoint
    settings = slow_storage.StorageSettings(latency_ms=2.0, total_mb_s=8.0)

    def kill_rank_1_once_reading(out):
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if storage.served()[0] > _file_bytes(model) // 4 and (out / "rank1.pid").exists():
                os.kill(int((out / "rank1.pid").read_text()), signal.SIGKILL)
                return
            time.sleep(0.05)
        pytest.fail("the job never got far enough to kill rank 1")

    # mindspore's cluster ends a job whose node stops beating after MS_NODE_TIMEOUT; the collective's own
    # error reached rank 0 60-110 s after the kill here: raised past that, so that rank 0 meets it where it comes
    env = {**COOPERATE, "MS_NODE_TIMEOUT": "120"}
    with slow_storage.SlowStorage(model, settings, mounts=2) as storage:
        for node in range(2):
            os.symlink(storage.mountpoints[node], tmp_path / f"node{node}")
        job, results, failures = run_nodes(
            tmp_path, 2, 1, tmp_path / "{node}", env, while_running=kill_rank_1_once_reading
        )
    assert 0 not in results, "rank 0 returned a model although rank 1 died mid-load"
    if 0 in failures:
        _assert_failed_cleanly(job, failures, 0, "with rank(s) 1")
    else:  # mccl's Broadcast from a dead root does not always time out: then mindspore's cluster ends rank 0
        scheduler = (tmp_path / "logs0" / "scheduler.log").read_text(errors="replace")
        assert "worker 1 is the first one timed out" in scheduler, job.logs()


def _signal_rank_once_reading(storage, model, rank, signum, then=None):
    """A `while_running` hook: `signum` to `rank` once the storage served a quarter of the checkpoint;
    `then(pid)` after it, if given."""

    def act(out):
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if storage.served()[0] > _file_bytes(model) // 4 and (out / f"rank{rank}.pid").exists():
                pid = int((out / f"rank{rank}.pid").read_text())
                os.kill(pid, signum)
                if then is not None:
                    then(pid)
                return
            time.sleep(0.05)
        pytest.fail(f"the job never got far enough to signal rank {rank}")

    return act


def _assert_follower_read_the_rest(results, rank, why):
    report = results[rank]["report"]
    assert (
        report["cooperative"].startswith("with the job: 2 nodes") and f"; then alone: {why}" in (report["cooperative"])
    ), report["cooperative"]
    assert report["bytes_from_storage"] > 0, report


# 2 nodes of 2 ranks: ranks 0 and 1 on node 0, 2 and 3 on node 1; the leaders are 0 and 2.
_SLOW = dict(latency_ms=2.0, total_mb_s=8.0)


@needs_fuse
def test_a_follower_that_dies_mid_load(checkpoint, tmp_path):
    """Rank 3, node 1's follower, dies mid-load (SIGUSR1: its process ends with code 0, so msrun does not end
    its node's other rank as it does after a kill): its leader drops it and goes on; the other three ranks
    load the unpatched model, node 0's follower reading nothing from storage."""
    model, reference = checkpoint
    with slow_storage.SlowStorage(model, slow_storage.StorageSettings(**_SLOW), mounts=2) as storage:
        for node in range(2):
            os.symlink(storage.mountpoints[node], tmp_path / f"node{node}")
        end_rank_3 = _signal_rank_once_reading(storage, model, 3, signal.SIGUSR1)
        env = {**COOPERATE, "MS_NODE_TIMEOUT": "120"}  # the job outlives the dead rank's heartbeat
        job, results, _ = run_nodes(tmp_path, 2, 2, tmp_path / "{node}", env, while_running=end_rank_3)
    assert sorted(results) == [0, 1, 2], f"reports from ranks {sorted(results)}\n{job.logs()}"
    for rank in (0, 1, 2):
        assert_same_arrays(
            npz_arrays(reference), npz_arrays(tmp_path / "out" / f"rank{rank}-loaded.npz"), f"rank {rank}"
        )
        assert results[rank]["report"]["cooperative"].startswith("with the job: 2 nodes"), results[rank]
        assert "then alone" not in results[rank]["report"]["cooperative"], results[rank]
    assert results[1]["report"]["bytes_from_storage"] == 0


@needs_fuse
def test_a_slow_follower_is_left_behind_and_reads_the_rest(checkpoint, tmp_path):
    """Rank 3 is stopped (SIGSTOP) longer than its leader waits for a follower, then continued: the leader
    went on without it, and rank 3 reads what it lacks from storage; all four ranks load the unpatched model."""
    model, reference = checkpoint

    def continue_later(pid):
        time.sleep(14)  # past the leader's wait for a follower
        os.kill(pid, signal.SIGCONT)

    with slow_storage.SlowStorage(model, slow_storage.StorageSettings(**_SLOW), mounts=2) as storage:
        for node in range(2):
            os.symlink(storage.mountpoints[node], tmp_path / f"node{node}")
        stop = _signal_rank_once_reading(storage, model, 3, signal.SIGSTOP, then=continue_later)
        # 1 MB chunks: many more rounds than staging slots, so the leader needs rank 3's slots again
        env = {**COOPERATE, "MS_LOADPATCH_COOPERATIVE_CHUNK_MB": "1"}
        job, results, _ = run_nodes(tmp_path, 2, 2, tmp_path / "{node}", env, while_running=stop)
    _assert_loaded(job, results, 4, reference)
    _assert_follower_read_the_rest(results, 3, "the node's leader went on without it (it fell behind)")
    assert results[1]["report"]["bytes_from_storage"] == 0


@needs_fuse
def test_a_leader_that_dies_mid_load(checkpoint, tmp_path):
    """Rank 2, node 1's leader, dies mid-load (SIGUSR1, as above): its follower (rank 3) reads what it lacks
    from storage and loads the unpatched model; rank 0, the other leader, ends with an error naming rank 2
    (then msrun ends its node, rank 1 with it, wherever rank 1 is). No rank returns a wrong model; none
    waits for ever."""
    model, reference = checkpoint
    with slow_storage.SlowStorage(model, slow_storage.StorageSettings(**_SLOW), mounts=2) as storage:
        for node in range(2):
            os.symlink(storage.mountpoints[node], tmp_path / f"node{node}")
        end_rank_2 = _signal_rank_once_reading(storage, model, 2, signal.SIGUSR1)
        env = {**COOPERATE, "MS_NODE_TIMEOUT": "120"}
        job, results, failures = run_nodes(tmp_path, 2, 2, tmp_path / "{node}", env, while_running=end_rank_2)
    assert 0 not in results, "rank 0 returned a model although the other leader died mid-load"
    _assert_failed_cleanly(job, failures, 0, "with rank(s) 2")
    for rank in results:
        assert_same_arrays(
            npz_arrays(reference), npz_arrays(tmp_path / "out" / f"rank{rank}-loaded.npz"), f"rank {rank}"
        )
    assert 3 in results, f"node 1's follower did not go on alone\n{job.logs()}"
    _assert_follower_read_the_rest(results, 3, "the node's leader (process")


@needs_fuse
def test_a_rank_whose_load_fails_mid_load(checkpoint, tmp_path):
    """Node 1's config names a RoPE type mindone does not know (same
    files): rank 1's build raises while the checkpoint crosses the job
    (slow storage); rank 0's load ends with an error naming rank 1 instead
    of waiting or returning a model; both processes as they were."""
    model, _ = checkpoint
    other = tmp_path / "other-config"
    other.mkdir()
    config = json.loads((model / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "no-such-rope", "factor": 2.0}
    (other / "config.json").write_text(json.dumps(config))
    settings = slow_storage.StorageSettings(latency_ms=2.0, total_mb_s=2.0)  # the schedule outlasts the build
    with slow_storage.SlowStorage(model, settings, mounts=2) as storage:
        os.symlink(storage.mountpoints[0], tmp_path / "node0")
        for name in os.listdir(storage.mountpoints[1]):
            if name != "config.json":
                os.symlink(os.path.join(storage.mountpoints[1], name), other / name)
        os.symlink(other, tmp_path / "node1")
        # 1 MB messages: a chunk read in flight ends within the load's grace for its reader threads
        job, results, failures = run_nodes(
            tmp_path, 2, 1, tmp_path / "{node}", {**COOPERATE, "MS_LOADPATCH_COOPERATIVE_CHUNK_MB": "1"}
        )
    assert not results, "a rank returned a model although rank 1's load failed"
    _assert_failed_cleanly(job, failures, 1, "no-such-rope")
    _assert_failed_cleanly(job, failures, 0, "rank(s) 1 of the job abandoned the load")


ASYMMETRIC_WORKER = os.path.join(HERE, "_asymmetric_worker.py")
# Scripts whose ranks load different things: (nodes, ranks per node, what each rank loads, in order)
ASYMMETRIC = {
    "one node, rank 0 alone loads": (1, 2, {0: ["a"]}),
    "one node, rank 1 loads twice": (1, 2, {0: ["a"], 1: ["a", "a"]}),
    "two nodes, rank 0 alone loads": (2, 1, {0: ["a"]}),
    "two nodes, rank 1 loads twice": (2, 1, {0: ["a"], 1: ["a", "a"]}),
    "two nodes, other models per rank": (2, 1, {0: ["a"], 1: ["b"]}),
    "two nodes of two, only node 1 loads": (2, 2, {2: ["a"], 3: ["a"]}),
}


@pytest.fixture(scope="module")
def two_checkpoints(checkpoint, tmp_path_factory):
    other, _ = _checkpoint(tmp_path_factory.mktemp("asymmetric") / "qwen2", 1)
    return {"a": checkpoint[0], "b": other}


def _run_asymmetric(directory, nodes, ranks_per_node, plan, patched):
    out = directory / "out"
    env = {k: v for k, v in os.environ.items() if k not in ("MS_LOADPATCH", "MS_LOADPATCH_REPORT")}
    args = ["--out", out, "--plan", ";".join(f"{rank}={','.join(map(str, m))}" for rank, m in plan.items())]
    job = NodesJob(
        directory, ASYMMETRIC_WORKER, args + (["--patched"] if patched else []), nodes, ranks_per_node, env,
        node_ids=nodes > 1,
    )  # fmt: skip
    try:
        job.wait(JOB_SECONDS)
    except TimeoutError as exc:
        pytest.fail(f"{exc}\n{job.logs()}")
    finally:
        job.kill()
    ranks = nodes * ranks_per_node
    assert not job.failed_launches() and all((out / f"rank{r}.json").exists() for r in range(ranks)), job.logs()
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)]


@pytest.mark.parametrize("case", list(ASYMMETRIC))
def test_ranks_that_load_different_things_end_as_unpatched(two_checkpoints, tmp_path, case):
    """Each rank loads what the script says (one rank only, one twice, other models, one node of two), then
    the script's own AllReduce: every rank's result and models are the unpatched job's, the plugin made no
    collective or group for a load that read alone (none at all, not even the store, on one node), and the
    job takes at most 1.5x + 10 s of the unpatched one's time."""
    nodes, ranks_per_node, loads = ASYMMETRIC[case]
    plan = {rank: [two_checkpoints[name] for name in names] for rank, names in loads.items()}
    (tmp_path / "unpatched").mkdir()
    (tmp_path / "patched").mkdir()
    unpatched = _run_asymmetric(tmp_path / "unpatched", nodes, ranks_per_node, plan, patched=False)
    patched = _run_asymmetric(tmp_path / "patched", nodes, ranks_per_node, plan, patched=True)
    for before, after in zip(unpatched, patched):
        rank = after["rank"]
        assert before["allreduce"] == before["expected"], before
        assert after["allreduce"] == after["expected"], f"rank {rank}: the script's AllReduce gave {after}"
        assert after["digests"] == before["digests"], f"rank {rank} loaded other weights than unpatched"
        made = after["plugin_made"]
        if not any(r.startswith("with the job") for r in after["reports"]):
            assert made["collectives"] == 0 and made["groups"] == 0, f"rank {rank}: {made}, {after['reports']}"
        if nodes == 1:
            assert made["stores"] == 0, f"rank {rank} reached for the job's store on one node: {made}"
            assert all(r.startswith("alone: one node") for r in after["reports"]), after["reports"]
    slowest = max(r["seconds"] for r in patched)
    bound = 1.5 * max(r["seconds"] for r in unpatched) + 10
    assert slowest <= bound, f"the patched job took {slowest:.1f} s, more than {bound:.1f} s"
