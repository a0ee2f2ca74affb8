"""Once-per-process probe verdicts, kept one way for every probe: each
module that probes holds a ProbeCache, whose results are computed once per
key under the cache's lock (a row of locks.LOCK_ORDER). Tests put in a
cache holding the verdict they simulate, or forget() to probe again."""

from __future__ import annotations

import threading

_UNSET = object()


class ProbeCache:
    def __init__(self, results: dict | None = None):
        self._results = dict(results or {})
        self._lock = threading.Lock()

    def get(self, key, compute, own_thread: bool = False, exclusive: bool = True):
        """The result for `key`, `compute()` run the first time (with
        `own_thread`, in a thread of its own that the caller waits for).
        Not `exclusive`: computed outside the lock, which is held only to
        keep the first result (for a probe asked from import hooks, which
        must not wait on a lock while holding an import lock)."""
        found = self._results.get(key, _UNSET)
        if found is not _UNSET:
            return found
        if not exclusive:
            value = compute()
            with self._lock:
                return self._results.setdefault(key, value)
        with self._lock:
            found = self._results.get(key, _UNSET)
            if found is _UNSET:
                found = self._results[key] = in_own_thread(compute) if own_thread else compute()
            return found

    def update(self, results: dict) -> None:
        """Results a probe of several keys found at once (called from its compute, under the lock)."""
        self._results.update(results)

    def __contains__(self, key) -> bool:
        return key in self._results

    def __getitem__(self, key):
        """A result known already (KeyError when not probed yet)."""
        return self._results[key]

    def as_dict(self) -> dict:
        return dict(self._results)

    def forget(self) -> None:
        """Probe again at the next use (tests)."""
        with self._lock:
            self._results.clear()


def in_own_thread(compute):
    """compute() in a new thread, waited for: asked from inside a load's
    building thread, it meets none of the patches held for that thread.
    Its exception is raised here."""
    outcome = []

    def run():
        try:
            outcome.append((True, compute()))
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
            outcome.append((False, exc))

    thread = threading.Thread(target=run, name="ms_loadpatch-probe")
    thread.start()
    try:
        thread.join()
    except BaseException:  # an interrupt while waiting: the probe ends before this does
        thread.join()
        raise
    ok, value = outcome[0]
    if not ok:
        raise value
    return value
