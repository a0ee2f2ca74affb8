"""The parts of multi-node reading that every rank computes alike from what
the ranks said (strategy/job.py, strategy/cooperative.py): the agreement,
the decision, the plan. The jobs themselves run in tests/jobs/test_multinode.py."""

import numpy as np
import pytest

from ms_loadpatch.strategy import job, shares
from ms_loadpatch.strategy.probe_cache import ProbeCache


@pytest.fixture
def node_of(monkeypatch):
    """`node_of(node, digest, state, storage_mb_s)`: a rank's statement as made on `node`."""

    def make(node, digest="files", state=job.READY, cached=False):
        monkeypatch.setenv(job.NODE_ENV_VAR, node)
        return job.Statement(state, digest, cached).values()

    return make


def test_ranks_that_agree_cooperate_and_the_lowest_rank_of_each_node_reads(node_of):
    table = np.array([node_of("a"), node_of("b"), node_of("a"), node_of("b"), node_of("c")])
    agreement = job.conclude(table)
    assert agreement.cooperate and agreement.reason == "3 nodes"
    assert agreement.readers == [0, 1, 4]
    assert agreement.node_of_rank == [0, 1, 0, 1, 2]


@pytest.mark.parametrize(
    "other,reason",
    [
        (dict(digest="other files"), "rank 1 loads other files than rank 0"),
        (dict(state=job.NOT_ACCELERATED), "rank 1 does not take part: its load is not accelerated"),
        (dict(state=job.UNREADABLE), "rank 1 does not take part: it could not read its checkpoint's headers"),
        (dict(state=job.NOTHING), "rank 1 does not take part: it has no local safetensors files to share"),
    ],
)
def test_one_rank_that_differs_makes_every_rank_read_alone(node_of, other, reason):
    agreement = job.conclude(np.array([node_of("a"), node_of("b", **other), node_of("c")]))
    assert not agreement.cooperate and agreement.reason.startswith(reason), agreement.reason


def test_other_settings_on_one_rank_make_every_rank_read_alone(node_of, monkeypatch):
    first = node_of("a")
    monkeypatch.setenv(job.CHUNK_ENV_VAR, "8")
    agreement = job.conclude(np.array([first, node_of("b")]))
    assert not agreement.cooperate and "other MS_LOADPATCH_COOPERATIVE settings" in agreement.reason


def test_ranks_of_one_node_read_alone(node_of):
    agreement = job.conclude(np.array([node_of("a"), node_of("a")]))
    assert not agreement.cooperate and agreement.reason == "one node: its ranks share the page cache"


@pytest.fixture
def probe(monkeypatch):
    """The collective's probe as found: `probe(largest, bytes_per_s)`."""

    def set_probe(largest, bytes_per_s, problem=None):
        monkeypatch.setattr(
            job, "_probes", ProbeCache({"collective": job.CollectiveProbe(largest, bytes_per_s, problem)})
        )

    return set_probe


class _TimedRates:
    """The job's collective as settle uses it to gather the ranks' first-read rates: each rank's `rates`."""

    def __init__(self, rates):
        self.rates = rates

    def gather(self, values):
        return np.array([[rate] for rate in self.rates])


@pytest.mark.parametrize(
    "mode,rates,collective,cooperates,reason",
    [
        ("auto", [0, 0], 100e6, False, "the storage's rate could not be timed"),
        ("auto", [1000, 900], 100e6, False, "storage reads 900 MB/s per node, faster than the collective 100 MB/s"),
        ("auto", [90, 200], 100e6, False, "storage reads 90 MB/s per node"),  # inside the margin
        ("auto", [50, 0], 100e6, True, "2 nodes, storage 50 MB/s per node, collective 100 MB/s"),
        ("on", [1000, 1000], 100e6, True, "2 nodes, MS_LOADPATCH_COOPERATIVE=on (collective 100 MB/s)"),
    ],
)
def test_the_choice_follows_the_rates(node_of, probe, monkeypatch, mode, rates, collective, cooperates, reason):
    monkeypatch.setenv(job.ENV_VAR, mode)
    probe(16 << 20, collective)
    agreement = job.conclude(np.array([node_of("a"), node_of("b")]))
    agreement = job.settle(_TimedRates(rates), agreement, lambda: rates[0])
    assert agreement.cooperate == cooperates and agreement.reason.startswith(reason), agreement.reason


@pytest.mark.parametrize("mode,cooperates", [("auto", False), ("on", True)])
def test_a_checkpoint_cached_on_every_node(node_of, probe, monkeypatch, mode, cooperates):
    """auto reads alone without timing anything; on cooperates all the same."""
    monkeypatch.setenv(job.ENV_VAR, mode)
    probe(16 << 20, 100e6)
    agreement = job.conclude(np.array([node_of("a", cached=True), node_of("b", cached=True)]))
    agreement = job.settle(None, agreement, lambda: pytest.fail("nothing is timed"))
    assert agreement.cooperate == cooperates
    if not cooperates:
        assert agreement.reason == "the checkpoint is in every node's page cache"


def test_a_failed_probe_makes_every_rank_read_alone(node_of, probe, monkeypatch):
    monkeypatch.setenv(job.ENV_VAR, "on")
    probe(0, 0.0, "a broadcast of 1 MB failed: Launch kernel failed")
    agreement = job.settle(None, job.conclude(np.array([node_of("a"), node_of("b")])), lambda: 0)
    assert not agreement.cooperate
    assert agreement.reason == "the collective's probe failed: a broadcast of 1 MB failed: Launch kernel failed"


class _Layout:
    def __init__(self, data_len):
        self.data_len = data_len


@pytest.mark.parametrize("nodes", [2, 3])
def test_the_plan_covers_every_byte_once_balanced_by_bytes(nodes):
    layouts = [_Layout(n) for n in (10_000_003, 0, 4_096, 7_777_777)]
    chunks = shares.plan_chunks(layouts, nodes, 1 << 20)
    assert chunks == shares.plan_chunks(layouts, nodes, 1 << 20)  # the same on every rank
    for index, layout in enumerate(layouts):
        spans = [(c.begin, c.end) for c in chunks if c.file == index]
        covered = [b for begin, end in spans for b in (begin, end)]
        assert spans == sorted(spans) and (not spans or (covered[0], covered[-1]) == (0, layout.data_len))
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
        assert all(end - begin <= 1 << 20 for begin, end in spans)
    per_node = [sum(c.end - c.begin for c in chunks if c.node == n) for n in range(nodes)]
    assert max(per_node) - min(per_node) <= 1 << 20, per_node


def test_outside_a_job_nothing_cooperates(monkeypatch):
    """No initialised communication: no agreement, no collective (this test process never calls init())."""
    import mindspore.communication  # noqa: F401 - imported, as a job's script would, but not initialised

    assert job.job_size() is None
    monkeypatch.setenv(job.ENV_VAR, "on")
    assert job.job_size() is None
