"""strategy/ranks.py: how many ranks of a job share this node, read from the
launcher's environment, and the reader's thread counts divided among them."""

import os
import subprocess
import sys

import pytest

from ms_loadpatch import activation
from ms_loadpatch.strategy import ranks
from ms_loadpatch.strategy.threaded_read import background_read_threads, read_threads

LAUNCHER_VARS = (
    "MS_LOADPATCH_LOCAL_RANKS",
    "MS_ROLE",
    "MS_WORKER_NUM",
    "LOCAL_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
    "MPI_LOCALNRANKS",
    "RANK_SIZE",
    "RANK_ID",
    "OMPI_COMM_WORLD_RANK",
    "RANK",
)


@pytest.fixture
def clean_env(monkeypatch):
    monkeypatch.setattr(activation, "_warned", set())
    for name in LAUNCHER_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(ranks, "available_cores", lambda: 8)
    return monkeypatch


def test_alone_on_the_node(clean_env):
    share = ranks.node_share()
    assert (share.local_ranks, share.rank, share.cores) == (1, None, 8)
    assert read_threads() == 8 and background_read_threads() == 7


@pytest.mark.parametrize(
    "env, local, source",
    [
        (
            {"MS_LOADPATCH_LOCAL_RANKS": "4", "MS_ROLE": "MS_WORKER", "MS_WORKER_NUM": "16"},
            4,
            "MS_LOADPATCH_LOCAL_RANKS",
        ),
        ({"MS_ROLE": "MS_WORKER", "MS_WORKER_NUM": "2"}, 2, "MS_WORKER_NUM"),
        ({"LOCAL_WORLD_SIZE": "4", "RANK_SIZE": "16"}, 4, "LOCAL_WORLD_SIZE"),
        ({"OMPI_COMM_WORLD_LOCAL_SIZE": "3"}, 3, "OMPI_COMM_WORLD_LOCAL_SIZE"),
        ({"RANK_SIZE": "8"}, 8, "RANK_SIZE"),
        ({"MS_WORKER_NUM": "4"}, 1, "not in a distributed job"),  # the scheduler's env without MS_ROLE=MS_WORKER
    ],
)
def test_local_ranks_from_the_launcher(clean_env, env, local, source):
    for name, value in env.items():
        clean_env.setenv(name, value)
    share = ranks.node_share()
    assert (share.local_ranks, share.source) == (local, source)


@pytest.mark.parametrize("local, threads, background", [(1, 8, 7), (2, 4, 3), (4, 2, 1), (8, 1, 1), (16, 1, 1)])
def test_threads_divided_among_local_ranks(clean_env, local, threads, background):
    """Twice the cores (at most 8) per node for a read, cores - 1 beside
    model building: divided by the ranks, at least one each."""
    clean_env.setenv("MS_LOADPATCH_LOCAL_RANKS", str(local))
    assert read_threads() == threads
    assert background_read_threads() == background


def test_rank_id(clean_env):
    clean_env.setenv("RANK_ID", "3")
    assert ranks.node_share().rank == 3


@pytest.mark.parametrize("value", ["0", "-2", "two", "1.5"])
def test_bad_explicit_count_is_ignored_with_a_warning(clean_env, caplog, value):
    clean_env.setenv("MS_LOADPATCH_LOCAL_RANKS", value)
    clean_env.setenv("LOCAL_WORLD_SIZE", "2")
    with caplog.at_level("WARNING", logger="ms_loadpatch"):
        share = ranks.node_share()
    assert (share.local_ranks, share.source) == (2, "LOCAL_WORLD_SIZE")
    assert "MS_LOADPATCH_LOCAL_RANKS" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="ms_loadpatch"):
        ranks.node_share()
    assert "MS_LOADPATCH_LOCAL_RANKS" not in caplog.text, "warned again at the next load"


@pytest.mark.parametrize("flag", [["--local_worker_num=3"], ["--local_worker_num", "3"]])
def test_msrun_local_worker_num_read_from_the_launching_msrun(tmp_path, flag):
    """msrun exports only the job's total (MS_WORKER_NUM); the node's count is
    its --local_worker_num, read from the parent's command line. A fake
    `msrun` script is the parent here, with a total of 6 ranks."""
    fake = tmp_path / "msrun"
    fake.write_text(
        "import os, subprocess, sys\n"
        "env = dict(os.environ, MS_ROLE='MS_WORKER', MS_WORKER_NUM='6')\n"
        "code = 'from ms_loadpatch.strategy.ranks import node_share; s = node_share(); print(s.local_ranks, s.source)'\n"
        "sys.exit(subprocess.run([sys.executable, '-c', code], env=env).returncode)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    proc = subprocess.run(
        [sys.executable, str(fake), "--worker_num=6", *flag], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split(None, 1) == ["3", "msrun --local_worker_num\n"]


def test_report_names_the_share(clean_env):
    from ms_loadpatch.strategy.reports import LoadReport

    report = LoadReport("Model", "transformers")
    report.local_ranks, report.rank, report.read_threads = 2, 1, 4
    assert "(rank 1, 2 rank(s) on this node)" in report.summary()
    assert "up to 4 thread(s)" in report.summary()
