"""Multi-rank jobs: 2-worker msrun jobs on this machine (loopback, bounded
time; each job ends by itself). Every worker reports what it loaded
(tests/_msrun_worker.py); the tests compare the reports.

- the plugin reaches every rank: MS_LOADPATCH=1, `ms-loadpatch run -- msrun`,
  `import ms_loadpatch` in the script;
- each rank reads with its share of the node's threads (strategy/ranks.py);
- under mindone's ZeRO (stages 2 and 3) the patched job trains exactly as the
  unpatched one: same losses, same parameters after the steps, every rank;
- a rank given a corrupt file fails with the error naming it, the job ends.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys

import pytest
from _helpers import TESTS_DIR, assert_same_arrays, installed_pth, npz_arrays

from ms_loadpatch.strategy.ranks import NodeShare, available_cores
from ms_loadpatch.strategy.threaded_read import read_threads

HERE = TESTS_DIR
WORKER = os.path.join(HERE, "_msrun_worker.py")
RANKS = 2
JOB_SECONDS = 300
ZERO_STAGES = ["2", "3"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _msrun() -> list[str]:
    """msrun of this interpreter's environment (its workers run `python`
    from PATH, so that comes first on PATH too)."""
    return [sys.executable, "-m", "mindspore.parallel.cluster.run"]


def run_job(directory, worker_args, env_extra=None, launcher=()):
    """One msrun job of RANKS workers; its outputs in directory/out. Returns
    (the finished msrun process, per-rank results, per-rank failures)."""
    out, logs = directory / "out", directory / "logs"
    env = {k: v for k, v in os.environ.items() if k not in ("MS_LOADPATCH", "MS_LOADPATCH_REPORT")}
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env.update(env_extra or {})
    command = [
        *launcher,
        *_msrun(),
        f"--worker_num={RANKS}",
        f"--local_worker_num={RANKS}",
        "--master_addr=127.0.0.1",
        f"--master_port={_free_port()}",
        "--join=True",
        "--cluster_time_out=120",
        f"--log_dir={logs}",
        WORKER,
        "--out",
        str(out),
        *worker_args,
    ]
    proc = subprocess.Popen(
        command,
        env=env,
        cwd=directory,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=JOB_SECONDS)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGINT)  # msrun's own handler kills its workers
        try:
            proc.communicate(timeout=30)
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"msrun job did not end within {JOB_SECONDS} s: {command}")
    proc.output = output
    results, failures = {}, {}
    for rank in range(RANKS):
        path = out / f"rank{rank}.json"
        if path.exists():
            results[rank] = json.loads(path.read_text())
        path = out / f"rank{rank}-failure.json"
        if path.exists():
            failures[rank] = json.loads(path.read_text())
    return proc, results, failures


def _worker_logs(directory) -> str:
    parts = []
    for path in sorted((directory / "logs").glob("worker_*.log")):
        parts.append(f"--- {path.name}\n" + path.read_text(errors="replace")[-3000:])
    for path in sorted((directory / "out").glob("*.error")):
        parts.append(f"--- {path.name}\n" + path.read_text(errors="replace")[-3000:])
    return "\n".join(parts)


def _assert_ok(directory, proc, results):
    assert proc.returncode == 0 and len(results) == RANKS, (
        f"msrun exit {proc.returncode}, reports from ranks {sorted(results)}\n{proc.output[-3000:]}\n"
        + _worker_logs(directory)
    )


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """A tiny Qwen2 checkpoint, two shards (so reads go through the read-ahead)."""
    code = (
        "import sys, mindspore as ms\n"
        "from transformers import Qwen2Config\n"
        "from ms_loadpatch.testing import cpu_kernel_fallbacks\n"
        "import ms_loadpatch; ms_loadpatch.disable()\n"
        "from mindone.transformers import Qwen2ForCausalLM\n"
        "ms.set_seed(0)\n"
        "with cpu_kernel_fallbacks():\n"
        "    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=128, hidden_size=32, num_hidden_layers=2,\n"
        "        num_attention_heads=4, num_key_value_heads=2, intermediate_size=64))\n"
        "    model.save_pretrained(sys.argv[1], max_shard_size='20KB')\n"
    )
    directory = tmp_path_factory.mktemp("multirank") / "qwen2"
    proc = subprocess.run([sys.executable, "-c", code, str(directory)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(list(directory.glob("*.safetensors"))) > 1
    return directory


@pytest.fixture(scope="module")
def zero_jobs(tiny_checkpoint, tmp_path_factory):
    """The same ZeRO job twice: unpatched (MS_LOADPATCH=0), and patched by
    `import ms_loadpatch` in the worker script."""
    jobs = {}
    for name, args, env in [("unpatched", [], {"MS_LOADPATCH": "0"}), ("patched", ["--import"], {})]:
        directory = tmp_path_factory.mktemp(f"zero-{name}")
        proc, results, _ = run_job(directory, ["--model", str(tiny_checkpoint), "--zero", *ZERO_STAGES, *args], env)
        _assert_ok(directory, proc, results)
        jobs[name] = (directory, results)
    return jobs


def _expected_share():
    return NodeShare(local_ranks=RANKS, rank=None, cores=available_cores(), source="test")


def _assert_accelerated_in_every_rank(directory, results, reference_dir):
    for rank in range(RANKS):
        result = results[rank]
        assert result["enabled"], f"rank {rank}: plugin not enabled"
        report = result["report"]
        assert report is not None, f"rank {rank}: the load was not accelerated"
        assert report["rank"] == rank and report["local_ranks"] == RANKS, report
        assert report["read_threads"] == read_threads(_expected_share()), report
        assert result["threads_after_load"] == [], result["threads_after_load"]
        assert_same_arrays(
            npz_arrays(reference_dir / "out" / f"rank{rank}-loaded.npz"),
            npz_arrays(directory / "out" / f"rank{rank}-loaded.npz"),
            f"rank {rank} loaded",
        )


def test_import_in_the_script_accelerates_every_rank(zero_jobs):
    reference_dir, unpatched = zero_jobs["unpatched"]
    directory, results = zero_jobs["patched"]
    assert not any(unpatched[rank]["enabled"] for rank in range(RANKS)), "MS_LOADPATCH=0 job was patched"
    assert all(unpatched[rank]["report"] is None for rank in range(RANKS))
    _assert_accelerated_in_every_rank(directory, results, reference_dir)


@pytest.mark.parametrize("activation", ["env", "run"])
def test_activation_from_outside_reaches_every_rank(activation, tiny_checkpoint, zero_jobs, tmp_path):
    if activation == "env" and not installed_pth():
        pytest.skip("MS_LOADPATCH=1 alone needs the .pth hook a wheel install places (CI installs one)")
    env, launcher = (
        ({"MS_LOADPATCH": "1"}, ())
        if activation == "env"
        else ({}, (sys.executable, "-m", "ms_loadpatch", "run", "--"))
    )
    proc, results, _ = run_job(tmp_path, ["--model", str(tiny_checkpoint)], env, launcher)
    _assert_ok(tmp_path, proc, results)
    _assert_accelerated_in_every_rank(tmp_path, results, zero_jobs["unpatched"][0])


@pytest.mark.parametrize("stage", ZERO_STAGES)
def test_zero_training_identical_to_unpatched(zero_jobs, stage):
    """Losses of every step and every parameter after the steps (ZeRO-3's
    slices gathered back), rank by rank. Where this backend cannot run a
    stage, both jobs must fail it the same way; stage 2 must run."""
    (reference_dir, unpatched), (directory, patched) = zero_jobs["unpatched"], zero_jobs["patched"]
    for rank in range(RANKS):
        expected, actual = unpatched[rank]["zero"][stage], patched[rank]["zero"][stage]
        assert actual == expected, f"rank {rank}, ZeRO stage {stage}: {actual} != {expected}"
        if "error" in expected:
            assert stage != "2", f"ZeRO stage 2 did not run on rank {rank}: {expected['error']}"
            continue
        assert len(expected["losses"]) >= 2
        assert_same_arrays(
            npz_arrays(reference_dir / "out" / f"rank{rank}-zero{stage}.npz"),
            npz_arrays(directory / "out" / f"rank{rank}-zero{stage}.npz"),
            f"rank {rank} after ZeRO-{stage} steps",
        )


def test_one_rank_with_a_corrupt_shard(tiny_checkpoint, tmp_path):
    """Rank 1 reads a truncated shard: it fails with the error naming that
    file and leaves its process as it was; msrun ends the job (no hang)."""
    good, bad = tmp_path / "model-0", tmp_path / "model-1"
    shutil.copytree(tiny_checkpoint, good)
    shutil.copytree(tiny_checkpoint, bad)
    victim = sorted(bad.glob("*.safetensors"))[-1]
    victim.write_bytes(victim.read_bytes()[:-100])
    job = tmp_path / "job"
    job.mkdir()
    proc, results, failures = run_job(job, ["--model", str(tmp_path / "model-{rank}"), "--import"])
    assert proc.returncode != 0, "msrun reported success although rank 1 failed"
    assert 1 in failures, f"rank 1 wrote no failure report\n{proc.output[-3000:]}"
    failure = failures[1]
    assert str(victim) in failure["error"], failure
    assert failure["state_restored"] == "yes", failure["state_restored"]
    assert failure["threads_left"] == [], failure["threads_left"]
    assert 0 not in failures, failures.get(0)
    if 0 in results:  # rank 0 may have finished before msrun stopped the job
        assert results[0]["report"] is not None and results[0]["threads_after_load"] == []


def test_example_train_distributed(tmp_path):
    """examples/train_distributed.sh: 2 ranks, the plugin on from outside,
    each rank's load accelerated with its share of the node, training runs."""
    example = os.path.join(os.path.dirname(HERE), "examples", "train_distributed.sh")
    env = {k: v for k, v in os.environ.items() if k not in ("MS_LOADPATCH", "MS_LOADPATCH_REPORT")}
    env.update(PYTHON=sys.executable, MASTER_PORT=str(_free_port()), LOG_DIR=str(tmp_path / "logs"))
    proc = subprocess.run(
        ["bash", example, "--steps", "2"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=JOB_SECONDS,
        start_new_session=True,
    )
    logs = "".join(p.read_text(errors="replace") for p in sorted((tmp_path / "logs").glob("worker_*.log")))
    assert proc.returncode == 0, f"{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}\n{logs[-4000:]}"
    for rank in range(RANKS):
        assert f"rank {rank}: ms_loadpatch on; transformers Qwen2ForCausalLM" in logs, logs[-4000:]
        assert f"(rank {rank}, {RANKS} rank(s) on this node)" in logs, logs[-4000:]
        assert f"rank {rank} step 1: loss" in logs, logs[-4000:]
