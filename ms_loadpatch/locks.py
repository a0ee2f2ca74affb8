"""The one order ms_loadpatch's locks are taken in: a thread takes a lock
only while holding locks that come before it in LOCK_ORDER (a re-entrant
lock may be taken again). `tests/faults/test_locks.py` records every nested
acquisition during real loads, status calls and probes and checks them
against this table; docs/architecture.md#locks explains each place.

Rows are (module, attribute path) from the package root: a module-level
lock, or one held by a module-level object. Locks made per load (the
read-ahead queue's, the progress line's) are taken alone, under nothing of
this package's, and are not listed.
"""

from __future__ import annotations

LOCK_ORDER = (
    # one cooperative schedule of a multi-node job at a time, from a load's start to its schedule's end
    ("strategy.cooperative", "_SESSION"),
    # held across a build and across a whole build-then-fill call (re-entrant)
    ("strategy.building.lazy", "CONSTRUCTION_LOCK"),
    # the construction probes, asked for while a build holds the lock above
    ("strategy.building", "_probe_results._lock"),
    # what follows is taken under nothing else of the package's but the above
    ("core", "_PATCHER._lock"),
    ("api_verdict", "_verdicts._lock"),
    ("strategy.building.gc_pause", "_lock"),
    ("strategy.building.draws", "_verdicts._lock"),
    ("strategy.building.batched_draws", "_checks._lock"),
    ("strategy.building.deferred_writes", "_verdicts._lock"),
    ("strategy.building.swaps", "_shared_lock"),
    ("strategy.cellpasses", "_verdicts._lock"),
    ("strategy.castread", "_pairs._lock"),
    ("lazy_import", "_lock"),
    ("eager_import_scan", "_eager_bound_lock"),
    ("fingerprints", "_checks._lock"),
    ("strategy.reports", "_handler_lock"),
    # the job's store and the leaders' channels, made once per process under the cooperative schedule's lock
    ("strategy.meeting", "_stores._lock"),
    ("strategy.leaders", "_channels._lock"),
)
