"""Applying and removing the patch table with wrapt.

State lives in one `_Patcher`; the public functions in `ms_loadpatch` are
thin aliases. Like OpenTelemetry's BaseInstrumentor: check dependencies
before patching, idempotent enable/disable, one flag for the state.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import sys
import threading
import typing

import wrapt

from . import api_verdict, calls, fingerprints, lazy_import, techniques, versions
from .api_verdict import unmet_requirement
from .targets import FROM_PRETRAINED, TARGETS, Target

logger = logging.getLogger("ms_loadpatch")

PATCHED = "patched"
PENDING = "pending"
SKIPPED = "skipped"
NOT_NEEDED = "not needed"  # a row for a mindspore feature this mindspore does not have


class TargetState(typing.NamedTuple):
    state: str
    reason: str
    refused: bool = False  # skipped because the version gate refused the installed versions
    blocked_by: str | None = None  # a skipped row's blocker (api_verdict.Unmet.blocker)


def _resolve_wrapper(spec: str):
    """The wrapper a row names: "module:function", or "module:Kind.method" for
    a method of a load kind declared with calls.handles (calls.on_load)."""
    module_name, _, path = spec.partition(":")
    owner, obj = None, importlib.import_module(module_name)
    for part in path.split("."):
        owner, obj = obj, getattr(obj, part)
    if isinstance(owner, type) and hasattr(obj, "call_form"):
        return calls.on_load(owner, path.rsplit(".", 1)[1])
    return obj


class _Patcher:
    def __init__(self, targets: tuple[Target, ...]):
        self._targets = targets
        self._lock = threading.RLock()
        self._enabled = False
        # target key -> (the module patched, the installed wrapper): the module itself, since
        # sys.modules may have dropped it by disable() (pytester's in-process runs do)
        self._handles: dict[str, tuple] = {}
        self._states: dict[str, TargetState] = {}
        self._hooked_modules: set[str] = set()
        self._gate: versions.GateResult | None = None
        self._warned_refusal = False
        # accelerated loads in flight, by thread: disable() waits for other threads' loads
        self._loads: dict[int, int] = {}
        self._idle = threading.Condition(self._lock)
        self._disabling = False
        self._enabling = 0  # enable() calls preparing modules outside the lock

    # -- public operations

    def enable(self) -> bool:
        # Probing and importing happen before the lock: it is taken inside
        # builds and import hooks, and must not wait for either (docs/architecture.md#locks).
        gate = versions.check()
        if self._enabled or not gate.ok:
            return self._enable(gate, {})
        self._enabling += 1
        try:
            modules = list(dict.fromkeys(t.module for t in self._targets))
            for module_name in modules:  # a module imported from now on is prepared by its hook
                if module_name not in self._hooked_modules:
                    self._hooked_modules.add(module_name)
                    wrapt.register_post_import_hook(self._on_import, module_name)
            prepared = {}
            while True:
                for module_name in modules:
                    module = sys.modules.get(module_name)
                    if module is not None and module_name not in prepared:
                        prepared[module_name] = self._prepare_module(module)
                with self._lock:
                    if not self._enabled and any(m in sys.modules and m not in prepared for m in modules):
                        continue  # imported meanwhile: prepared outside the lock, then again
                    return self._enable(gate, prepared)
        finally:
            self._enabling -= 1

    def _enable(self, gate, prepared: dict) -> bool:
        with self._lock:
            if self._enabled:
                return True
            self._gate = gate
            if not self._gate.ok:
                for target in self._targets:
                    self._states[target.key] = TargetState(SKIPPED, f"refused: {self._gate.refusal}", refused=True)
                if not self._warned_refusal:
                    logger.warning("ms_loadpatch is not applied: %s", self._gate.refusal)
                    self._warned_refusal = True
                return False
            self._enabled = True
            for module_name in dict.fromkeys(t.module for t in self._targets):
                module = sys.modules.get(module_name)
                if module is not None:
                    self._apply_module(module, prepared[module_name])
                else:
                    for target in self._targets_of(module_name):
                        self._states[target.key] = TargetState(PENDING, "applied when the module is imported")
            # after wrapt's finder is in place, so ours is first: mindone.transformers and
            # .models, when imported from now on, are lazy packages
            lazy_import.install()
            return True

    def disable(self) -> None:
        with self._lock:
            # A load in flight in another thread calls the patched internals
            # until it returns: unpatching under it would leave it half
            # accelerated. Loads starting meanwhile run unaccelerated.
            me = threading.get_ident()
            self._disabling = True
            try:
                self._idle.wait_for(lambda: not (self._loads.keys() - {me}))
            finally:
                self._disabling = False
            for target in reversed(self._targets):
                module, handle = self._handles.pop(target.key, (None, None))
                if handle is not None:
                    if wrapt.unwrap_object(module, target.path, handle, missing_ok=True) is None:
                        logger.warning("%s was replaced by someone else; left as it is", target.key)
                self._states[target.key] = TargetState(SKIPPED, "disabled")
            lazy_import.uninstall()  # a package already lazy stays so: it gives the same objects
            self._enabled = False

    def is_enabled(self) -> bool:
        return self._enabled

    @contextlib.contextmanager
    def accelerated_load(self):
        """Held by an accelerated load for its whole duration: yields True if
        it may run accelerated (enabled, and no disable() waiting), and then
        keeps disable() in other threads from unpatching until it ends."""
        me = threading.get_ident()
        with self._lock:
            allowed = self._enabled and not self._disabling
            if allowed:
                self._loads[me] = self._loads.get(me, 0) + 1
        try:
            yield allowed
        finally:
            if allowed:
                with self._lock:
                    self._loads[me] -= 1
                    if not self._loads[me]:
                        del self._loads[me]
                    self._idle.notify_all()

    def is_handle(self, obj) -> bool:
        return any(obj is handle for _, handle in self._handles.values())

    def status(self) -> dict:
        with self._lock:  # a snapshot; the probes run after it is released
            gate, enabled = self._gate, self._enabled
            targets = [
                {
                    "target": t.key,
                    "library": t.library,
                    "public": t.public,
                    "state": s.state,
                    "reason": s.reason,
                    "refused": s.refused,
                    "blocked_by": s.blocked_by,
                }
                for t in self._targets
                for s in [self._states.get(t.key, TargetState(SKIPPED, "not enabled"))]
            ]
        gate = gate or versions.check()
        return {
            "enabled": enabled,
            "versions": dict(gate.versions),
            "supported": {name: str(spec) for name, spec in versions.SUPPORTED.items()},
            "tested": {name: list(tested) for name, tested in versions.TESTED.items()},
            "python": versions.python_status(),
            "refusal": gate.refusal,
            "untested": list(gate.untested),
            "development": list(gate.development),
            "libraries": {library: _library_verdict(library, enabled, gate, targets) for library in versions.LIBRARIES},
            "techniques": techniques.status_rows() if gate.ok else [],
            "last_build": techniques.last_build(),
            "targets": targets,
            "lazy_import": lazy_import.status(),
            "multi_node": _multi_node_status(),
        }

    # -- machinery

    def _targets_of(self, module_name: str):
        return [t for t in self._targets if t.module == module_name]

    def _on_import(self, module) -> None:
        if not (self._enabled or self._enabling):
            return
        prepared = self._prepare_module(module)  # the probes and imports, before the lock
        with self._lock:
            if self._enabled:
                self._apply_module(module, prepared)

    def _prepare_module(self, module) -> dict:
        """target key -> (api_verdict.Unmet or None, wrapper or the exception
        resolving it raised) for `module`'s targets: what probes or imports,
        done without holding the lock."""
        prepared = {}
        for target in self._targets_of(module.__name__):
            unmet = unmet_requirement(target.requires, target.library, target.feature)
            try:
                wrapper = _resolve_wrapper(target.wrapper) if unmet is None else None
            except Exception as exc:
                wrapper = exc
            prepared[target.key] = (unmet, wrapper)
        return prepared

    def _apply_module(self, module, prepared: dict) -> None:
        for target in self._targets_of(module.__name__):
            if target.key in self._handles:
                continue
            unmet, wrapper = prepared[target.key]
            if unmet is not None:
                self._states[target.key] = TargetState(
                    SKIPPED if unmet.needed else NOT_NEEDED, unmet.reason, blocked_by=unmet.blocker
                )
                continue
            try:
                if isinstance(wrapper, Exception):
                    raise wrapper
                self._strip_own_wrapper(module, target)
                if target.kind == "proxy":
                    handle = wrapt.wrap_object(module, target.path, wrapper)
                else:
                    # enabled: a copy bound elsewhere by name keeps the wrapper after
                    # disable(); wrapt then calls the original straight through
                    handle = wrapt.wrap_object(
                        module, target.path, wrapt.FunctionWrapper, (wrapper,), {"enabled": self.is_enabled}
                    )
                self._handles[target.key] = (module, handle)
            except Exception as exc:  # a missing attribute must not break the user's import
                self._states[target.key] = TargetState(SKIPPED, f"cannot patch: {exc}")
                logger.warning("ms_loadpatch: %s not patched: %s", target.key, exc)
                continue
            self._states[target.key] = TargetState(PATCHED, "")

    def _strip_own_wrapper(self, module, target: Target) -> None:
        """A name bound by `from x import f` after x.f was patched holds our
        wrapper; rebind it to the original so each binding has exactly one
        wrapper and disable() restores the original object everywhere."""
        parent, attribute, current = wrapt.resolve_path(module, target.path)
        if self.is_handle(current):
            wrapt.apply_patch(parent, attribute, current.__wrapped__)


def _library_verdict(library: str, enabled: bool, gate: versions.GateResult, targets: list) -> dict:
    """Will `from_pretrained` of a mindone.<library> model be accelerated in
    this process: `accelerated` True / False, or None while its module is not
    imported yet (the probes run when it is); `reason` and `advice` say why
    not and what to do."""
    own = [row for row in targets if row["library"] == library]
    verdict = {"accelerated": False, "reason": "", "advice": ""}
    missing = [name for name in ("mindspore", "mindone") if gate.versions.get(name) is None]
    skipped = [row for row in own if row["state"] == SKIPPED]
    if missing:
        verdict["reason"] = f"{' and '.join(missing)} not installed"
        verdict["advice"] = (
            "install the tested versions with: pip install 'ms-loadpatch[mindone]' "
            f"(mindspore {versions.tested_versions('mindspore')}; "
            f"mindone {versions.tested_versions('mindone')})"
        )
    elif not gate.ok:
        verdict["reason"] = gate.refusal
        verdict["advice"] = (
            f"install a tested version (mindspore {versions.tested_versions('mindspore')}; "
            f"mindone {versions.tested_versions('mindone')}), or set "
            f"{versions.ALLOW_UNTESTED_ENV_VAR}=1 to try this one at your own risk"
        )
    elif not enabled:
        verdict["reason"] = "ms_loadpatch is not enabled in this process"
        verdict["advice"] = "import ms_loadpatch, set MS_LOADPATCH=1, or run under `ms-loadpatch run --`"
    elif skipped:
        verdict["reason"] = f"{skipped[0]['target']} skipped: {skipped[0]['reason']}"
        if skipped[0]["blocked_by"] == api_verdict.VERSION:
            verdict["advice"] = (
                f"loads run mindone's own path; a tested mindone ({versions.tested_versions('mindone')}) gets "
                f"the fast path, or set {versions.ALLOW_UNTESTED_ENV_VAR}=1 to try this one at your own risk"
            )
        else:
            verdict["advice"] = (
                f"loads run mindone's own path; a tested mindspore "
                f"({versions.tested_versions('mindspore')}) gets the fast path"
            )
    elif gate.development and fingerprints.library_problem(library):
        verdict["reason"] = f"{gate.development[0]}; {fingerprints.library_problem(library)}"
        verdict["advice"] = (
            f"loads run mindone's own path; mindone {versions.tested_versions('mindone')} gets the fast path"
        )
    elif any(row["state"] == PENDING for row in own if row["target"] == FROM_PRETRAINED[library]):
        # other modules' entry points (from_unet, adapters, ...) are patched when they are imported
        verdict["accelerated"] = None
        verdict["reason"] = f"mindone.{library} is not imported yet: patched, and probed, when it is"
    else:
        verdict["accelerated"] = True
    return verdict


_PATCHER = _Patcher(TARGETS)


def enable() -> bool:
    """Patch every supported target (now, or when its module is imported).

    Returns False, with one logged warning, when the installed versions are refused."""
    return _PATCHER.enable()


def disable() -> None:
    """Restore every original object. Harmless when not enabled. Waits for
    accelerated loads running in other threads to finish first."""
    _PATCHER.disable()


def is_enabled() -> bool:
    return _PATCHER.is_enabled()


def accelerated_load():
    """Context manager for a glue entry point: yields whether this load may
    run accelerated; disable() in another thread waits until it ends."""
    return _PATCHER.accelerated_load()


def _multi_node_status() -> dict | None:
    """MS_LOADPATCH_COOPERATIVE, the job's store and the leaders' channels (strategy/cooperative.py), once
    mindspore is imported."""
    if "mindspore" not in sys.modules:
        return None
    from .strategy import cooperative

    return cooperative.status()


def status() -> dict:
    """Versions seen (and tested), the gate's verdict, per library whether its
    loads are accelerated and why not, and every target with its state and reason."""
    return _PATCHER.status()


@contextlib.contextmanager
def enabled():
    """Scoped enable: the previous state is restored on exit."""
    was_enabled = is_enabled()
    enable()
    try:
        yield
    finally:
        if not was_enabled:
            disable()


@contextlib.contextmanager
def disabled():
    """Scoped disable, e.g. for an unpatched reference load."""
    was_enabled = is_enabled()
    disable()
    try:
        yield
    finally:
        if was_enabled:
            enable()
