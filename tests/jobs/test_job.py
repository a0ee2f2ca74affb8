"""The parts of multi-node reading that can be tested in one process: the
agreement and the choice every rank computes alike from what the ranks said
(strategy/job.py), the meeting's protocol over a store with the TCPStore's
operations (strategy/meeting.py), the leaders' byte packing
(strategy/leaders.py), the node's staging between processes
(strategy/node_staging.py), the plan (strategy/shares.py). The jobs
themselves run in tests/jobs/test_multinode.py."""

import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ms_loadpatch.strategy import job, leaders, meeting, node_staging, shares


def _said(node, cached=False, settings=None, pid=100):
    return {"node": node, "pid": pid, "cached": cached, "settings": settings or [job.PROTOCOL, 4, "auto"]}


def test_ranks_that_met_cooperate_and_the_lowest_rank_of_each_node_leads():
    agreement = job.conclude([_said("a"), _said("b"), _said("a"), _said("b"), _said("c")])
    assert agreement.cooperate and agreement.reason == "3 nodes"
    assert agreement.leaders == [0, 1, 4]
    assert agreement.node_of_rank == [0, 1, 0, 1, 2]
    assert agreement.followers(0) == [2] and agreement.followers(2) == []


def test_other_settings_on_one_rank_make_every_rank_read_alone():
    agreement = job.conclude([_said("a"), _said("b", settings=[job.PROTOCOL, 8, "auto"])])
    assert not agreement.cooperate and "other MS_LOADPATCH_COOPERATIVE settings" in agreement.reason


def test_ranks_of_one_node_read_alone():
    agreement = job.conclude([_said("a"), _said("a")])
    assert not agreement.cooperate and agreement.reason == "one node: its ranks share the page cache"


@pytest.mark.parametrize(
    "mode,rates,channel,cooperates,reason",
    [
        ("auto", [0, 0], 100, False, "the storage's rate could not be timed"),
        ("auto", [1000, 900], 100, False, "storage 900 MB/s per node with 2 leaders reading, channel 100 MB/s"),
        ("auto", [90, 200], 50, False, "storage 90 MB/s per node"),  # 0.90x predicted: inside the margin
        ("auto", [50, 0], 100, True, "2 nodes, storage 50 MB/s per node with 2 leaders reading"),
        ("on", [1000, 1000], 100, True, "2 nodes, MS_LOADPATCH_COOPERATIVE=on (channel 100 MB/s"),
    ],
)
def test_the_choice_follows_the_model(monkeypatch, mode, rates, channel, cooperates, reason):
    monkeypatch.setenv(job.ENV_VAR, mode)
    agreement = job.choose(job.conclude([_said("a"), _said("b")]), rates, channel, None)
    assert agreement.cooperate == cooperates and agreement.reason.startswith(reason), agreement.reason


def test_auto_reads_alone_across_more_nodes_than_it_cooperates_with(monkeypatch):
    monkeypatch.setenv(job.ENV_VAR, "auto")
    agreement = job.choose(job.conclude([_said("a"), _said("b"), _said("c")]), [10, 10, 10], 1000, None)
    assert not agreement.cooperate and "cooperates across 2 nodes at most" in agreement.reason
    monkeypatch.setenv(job.ENV_VAR, "on")
    assert job.choose(job.conclude([_said("a"), _said("b"), _said("c")]), [], 1000, None).cooperate


def test_the_model_on_paper():
    """Together over alone: the storage's share per node or the channel, whichever is slower."""
    assert job.predicted_ratio(2, 50, 100) == pytest.approx(0.5)
    assert job.predicted_ratio(2, 100, 100) == pytest.approx(0.5)
    assert job.predicted_ratio(4, 100, 100) == pytest.approx(0.75)
    assert job.predicted_ratio(2, 1000, 100) == pytest.approx(5.0)


@pytest.mark.parametrize("mode,cooperates", [("auto", False), ("on", True)])
def test_a_checkpoint_cached_on_every_node(monkeypatch, mode, cooperates):
    """auto reads alone without timing anything; on cooperates all the same."""
    monkeypatch.setenv(job.ENV_VAR, mode)
    agreement = job.choose(job.conclude([_said("a", cached=True), _said("b", cached=True)]), [], 100, None)
    assert agreement.cooperate == cooperates
    if not cooperates:
        assert agreement.reason == "the checkpoint is in every node's page cache"


def test_a_failed_channel_probe_makes_every_leader_read_alone(monkeypatch):
    monkeypatch.setenv(job.ENV_VAR, "on")
    agreement = job.choose(job.conclude([_said("a"), _said("b")]), [], 0, "a round of 4096 KB failed: X")
    assert not agreement.cooperate
    assert agreement.reason == "the leaders' channel failed its probe: a round of 4096 KB failed: X"


def test_one_node_as_the_launcher_says(monkeypatch):
    """msrun's --local_worker_num (or MS_LOADPATCH_LOCAL_RANKS) covering the job: one node, nothing to meet;
    MS_LOADPATCH_NODE_ID (nodes sharing a host) or a job's total: only the meeting can tell."""
    monkeypatch.delenv(job.NODE_ENV_VAR, raising=False)
    monkeypatch.setenv("MS_LOADPATCH_LOCAL_RANKS", "8")
    assert job.one_node(8).startswith("one node (MS_LOADPATCH_LOCAL_RANKS says 8 of 8 ranks run here)")
    assert job.one_node(16) is None
    monkeypatch.setenv(job.NODE_ENV_VAR, "node0")
    assert job.one_node(8) is None


class _Store:
    """mindspore's TCPStore as a meeting uses it (set, get, an atomic add), shared by threads standing in
    for ranks."""

    def __init__(self):
        self.values, self.lock = {}, threading.Lock()

    def set(self, key, value):
        with self.lock:
            self.values[key] = value

    def get(self, key):
        with self.lock:
            return self.values[key]

    def add(self, key, amount):
        with self.lock:
            self.values[key] = self.values.get(key, 0) + amount
            return self.values[key]


def _meet_in_threads(store, arrivals, size, wait, key="files"):
    """`arrivals`: rank -> seconds after which it reaches the meeting (absent: never). Each rank's outcome."""
    outcomes = {}

    def rank_meets(rank, after):
        time.sleep(after)
        outcomes[rank] = meeting.meet(store, key, {"rank": rank}, rank, size, wait)

    threads = [threading.Thread(target=rank_meets, args=item) for item in arrivals.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return outcomes


@pytest.fixture
def fresh_meetings(monkeypatch):
    monkeypatch.setattr(meeting, "_meetings", _PerThreadCounts())


class _PerThreadCounts(dict):
    """Meetings held per thread (each thread stands in for a process)."""

    def _key(self, key):
        return (threading.get_ident(), key)

    def get(self, key, default=None):
        return super().get(self._key(key), default)

    def __setitem__(self, key, value):
        super().__setitem__(self._key(key), value)


def test_a_meeting_of_every_rank(fresh_meetings):
    outcomes = _meet_in_threads(_Store(), {0: 0.0, 1: 0.3, 2: 0.1}, 3, wait=5)
    for rank in range(3):
        statements, held = outcomes[rank]
        assert [s["rank"] for s in statements] == [0, 1, 2] and held == 0


def test_a_rank_that_never_comes_fails_the_meeting_for_all(fresh_meetings):
    outcomes = _meet_in_threads(_Store(), {0: 0.0, 2: 0.1}, 3, wait=0.5)
    assert outcomes[0] == outcomes[2] == "2 of 3 ranks reached this load within 0.5 s (MS_LOADPATCH_COOPERATIVE_WAIT)"


def test_a_rank_that_comes_after_the_wait_fails_too(fresh_meetings):
    """The first rank's wait ends and closes the meeting: the late rank's count says so, whatever its clock."""
    store = _Store()
    outcomes = _meet_in_threads(store, {0: 0.0, 1: 1.0}, 2, wait=0.3)
    assert isinstance(outcomes[0], str) and isinstance(outcomes[1], str), outcomes


def test_a_second_load_meets_the_others_second_load(fresh_meetings):
    """Meetings are counted per key: a rank's second load of the same files meets the others' second, and a
    load of other files never pairs with them."""
    store = _Store()
    first = _meet_in_threads(store, {0: 0.0, 1: 0.0}, 2, wait=5)
    other = _meet_in_threads(store, {0: 0.0}, 2, wait=0.3, key="other files")
    assert all(isinstance(found, tuple) and found[1] == 0 for found in first.values())
    assert isinstance(other[0], str)


class _LastArrivalUnseen(_Store):
    """A store in which rank 1 arrives while rank 0 waits, but every look rank 0 takes at the count before
    its wait ends still shows only itself: the race of a wait that ends as the last rank arrives."""

    def add(self, key, amount):
        if amount == 0 and "rank1" not in str(self.values):
            self.set(key.rsplit("/", 1)[0] + "/rank1", json.dumps({"rank": 1}).encode())
            super().add(key, 1)
        value = super().add(key, amount)
        return min(value, 1) if amount == 0 else value


def test_a_rank_whose_wait_ends_after_the_last_arrival_joins_the_meeting(fresh_meetings):
    """Decided by the count, not the clock: rank 1 counted itself in before rank 0 closed the meeting, so
    rank 0 meets it (and rank 1, which saw the full count, met it too)."""
    outcome = meeting.meet(_LastArrivalUnseen(), "files", {"rank": 0}, 0, 2, wait=0.05)
    assert isinstance(outcome, tuple) and [s["rank"] for s in outcome[0]] == [0, 1], outcome


@settings(max_examples=60, deadline=None)
@given(st.binary(min_size=0, max_size=200))
def test_bytes_cross_the_leaders_channel_exactly(data):
    """Three bytes to a float, summed with other leaders' zeros: every byte pattern comes back, including
    those whose raw float would be -0.0, a NaN or a subnormal."""
    raw = np.frombuffer(data, dtype=np.uint8)
    words = leaders.words_for(raw.size) + 1
    message = np.zeros((3, words), dtype=np.float32)
    leaders.pack(raw, message[1, : leaders.words_for(raw.size)] if raw.size else message[1, :0])
    summed = message.sum(axis=0, dtype=np.float32)
    got = np.empty(raw.size, dtype=np.uint8)
    leaders.unpack(summed[: leaders.words_for(raw.size)], got)
    assert got.tobytes() == data


def test_node_staging_hands_rounds_to_a_follower(tmp_path):
    path = str(tmp_path / "staging")
    writer = node_staging.StagingWriter(path, [os.getpid()], slot_bytes=16)
    reader = node_staging.StagingReader.open(path, 0, os.getpid(), 16, wait=1)
    assert reader is not None
    writer.verdict(True, "2 nodes")
    assert reader.verdict() == (True, "2 nodes")
    for number in range(6):  # more rounds than slots: each written once the follower consumed the slot
        writer.publish(number, [memoryview(bytes([number]) * 10)])
        assert reader.wait_round(number) is None
        got = bytearray(10)
        reader.read(number, 0, got)
        assert bytes(got) == bytes([number]) * 10 and reader.consumed(number)
    writer.end(True)
    writer.close()
    reader.leave()
    assert not os.path.exists(path)


def test_a_leader_goes_on_without_a_dead_or_stalled_follower_and_the_follower_learns_it(tmp_path, monkeypatch):
    """A follower whose process ended is dropped at once, one that consumes nothing for FOLLOWER_WAIT when
    its slot is needed again after that; a dropped follower is told (it then reads from storage)."""
    monkeypatch.setattr(node_staging, "FOLLOWER_WAIT", 0.3)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    path = str(tmp_path / "staging")
    writer = node_staging.StagingWriter(path, [dead.pid, os.getpid()], slot_bytes=8)
    reader = node_staging.StagingReader.open(path, 1, os.getpid(), 8, wait=1)
    writer.publish(0, [memoryview(b"x" * 8)])
    assert reader.consumed(0)
    for number in range(1, node_staging.SLOTS + 1):
        writer.publish(number, [memoryview(b"y" * 8)])
    assert writer.dropped == [0]  # the dead one, at the first slot written again
    writer.publish(node_staging.SLOTS + 1, [memoryview(b"z" * 8)])  # round 1's slot, never consumed
    assert writer.dropped == [0, 1]
    assert reader.wait_round(1) is None and not reader.consumed(1)  # its slot may have been written again
    assert reader.wait_round(node_staging.SLOTS + 2) == "the node's leader went on without it (it fell behind)"
    writer.close()
    reader.leave()


def test_a_follower_stops_waiting_for_a_leader_that_ended(tmp_path):
    leader = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        path = str(tmp_path / "staging")
        writer = node_staging.StagingWriter(path, [os.getpid()], slot_bytes=8)
        reader = node_staging.StagingReader.open(path, 0, os.getpid(), 8, wait=1)
        reader.leader_pid = leader.pid  # the leader's process as the follower knows it
    finally:
        leader.kill()
        leader.wait()
    assert reader.wait_round(0) == f"the node's leader (process {leader.pid}) ended"
    writer.close()
    reader.leave()


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
    rounds = shares.plan_rounds(layouts, nodes, 1 << 20)
    key = lambda c: (c.file, c.begin)  # noqa: E731
    assert sorted((c for chunks in rounds for c in chunks), key=key) == sorted(chunks, key=lambda c: (c.file, c.begin))
    assert all(len({c.node for c in chunks}) == len(chunks) for chunks in rounds)  # one per node at most


def test_outside_a_job_nothing_cooperates(monkeypatch):
    """No initialised communication: no agreement, no collective (this test process never calls init())."""
    import mindspore.communication  # noqa: F401 - imported, as a job's script would, but not initialised

    assert job.job_size() is None
    monkeypatch.setenv(job.ENV_VAR, "on")
    assert job.job_size() is None


def test_a_follower_takes_every_file_whole_whatever_the_rounds_order(tmp_path):
    """A follower fed round by round through the node's staging (a thread standing in for its leader) hands
    the load every file's tensors as saved, with a plan of 3 nodes in which some file's first chunk in round
    order is not its first bytes."""
    from safetensors.numpy import load_file, save_file

    from ms_loadpatch.strategy import cooperative, reports

    rng = np.random.default_rng(0)
    files = []
    for index, sizes in enumerate([(17_600, 12), (74_607,), (111_000, 75)]):  # data of 70,448, 298,428, 444,300 bytes
        path = str(tmp_path / f"model-{index}.safetensors")
        save_file({f"t{i}": rng.standard_normal(n).astype(np.float32) for i, n in enumerate(sizes)}, path)
        files.append(path)
    layouts, _ = shares.read_layouts(files)
    chunk = 1 << 16
    rounds = shares.plan_rounds(layouts, 3, chunk)
    first = {}
    for chunks in rounds:
        for c in chunks:
            first.setdefault(c.file, c.begin)
    assert any(begin != 0 for begin in first.values()), "the plan this test needs"
    staging = str(tmp_path / "staging")
    writer = node_staging.StagingWriter(staging, [os.getpid()], 3 * chunk)
    reader = node_staging.StagingReader.open(staging, 0, os.getpid(), 3 * chunk, wait=1)
    writer.verdict(True, "3 nodes")
    assert reader.verdict() == (True, "3 nodes")

    def lead():
        for number, chunks in enumerate(rounds):
            pieces = []
            for c in chunks:
                with open(layouts[c.file].path, "rb") as f:
                    f.seek(layouts[c.file].header.data_start + c.begin)
                    pieces.append(memoryview(f.read(c.end - c.begin)))
            writer.publish(number, pieces)
        writer.end(True)

    leader = threading.Thread(target=lead)
    leader.start()
    report = reports.LoadReport("Model", "transformers")
    report.cooperative = "with the job"
    cooperative._SESSION.acquire()  # the schedule releases it when it ends
    read = cooperative.FollowerRead(layouts, rounds, reader, report)
    read.start()
    try:
        for path in files:
            arrays, _, _ = read.take(path)
            expected = load_file(path)
            assert sorted(arrays) == sorted(expected)
            assert all(np.array_equal(arrays[name], expected[name]) for name in expected), path
    finally:
        read.exit(lambda: False)
        leader.join(10)
        writer.close()
    assert report.bytes_received == sum(layout.data_len for layout in layouts) and report.bytes_from_storage == 0
