"""Stress: N threads x M rounds of mixed from_pretrained loads in one process.

Each thread picks its loads from a fixed list with its own seeded RNG:
mindone.transformers and mindone.diffusers models, dense and many-cell
(Mixtral, 64 expert cells), single-file and sharded (with mindone's tqdm
progress bars on), and broken checkpoints (a truncated safetensors file) that
must fail. Halfway through, another thread calls ms_loadpatch.disable() and,
a little later, ms_loadpatch.enable() while loads run.

Around the toggle the loads run one at a time: a load started while the
plugin is off is mindone's own, and mindone 0.5.0 on mindspore 2.10 is not
thread-safe (concurrent unpatched loads crash the process with SIGSEGV, or
leave diffusers' parameters lazy through no_init_parameters' class-wide flag:
see --unpatched). The window opens 0.2 s before disable() is called, so loads
already started (the ones disable() must wait for) run concurrently, and
closes after enable() once its serialised loads are done.

Every model that loads is compared, bit for bit, with a snapshot of an
unpatched load of the same checkpoint made once at start
(ms_loadpatch.testing.snapshot / compare); a broken checkpoint must raise an
exception of the type the unpatched load raises, never return a model.

A watchdog ends the run as a stall when no load completes for --watchdog
seconds (or one operation, a load or a disable()/enable(), runs that long):
it prints every thread's stack and exits with status 3. At the end: nothing
of the plugin left installed (building.leftovers()), CONSTRUCTION_LOCK free,
the plugin enabled with every target patched, no thread left behind.

The checkpoints (tiny random models) are generated into a temporary
directory at start, with the plugin disabled; nothing is downloaded.

    python benchmarks/stress_loads.py                                  # 4 threads x 25 rounds
    python benchmarks/stress_loads.py --threads 4 --rounds 125 --seed 7
    python benchmarks/stress_loads.py --loads qwen2,bad --no-toggle

The last line of output is the summary:

    SUMMARY rounds=100 threads=4 loads=bad:14,mixtral:15,... expected_failures=27 unexpected_errors=0
    mismatches=0 stalls=0 leftovers=0 toggles=1 seconds=123.4   (one line)

Exit status: 0 when there was no mismatch, no stall, no unexpected error and
nothing left behind; 1 otherwise; 3 on a stall; 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import faulthandler
import os
import random
import shutil
import sys
import tempfile
import threading
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(1, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

# Test-sized models have tens of cells: fast construction engages from the
# first one (as in the test suite), so every load exercises it.
os.environ.setdefault("MS_LOADPATCH_FAST_CONSTRUCTION_FROM", "0")

import ms_loadpatch  # noqa: E402  (before mindone, as a user's script would)

STALL_EXIT = 3


# -- the checkpoints


@dataclasses.dataclass
class Kind:
    """One entry of the load list: how to generate its checkpoint, how to load it."""

    name: str
    library: str  # "transformers" or "diffusers"
    directory: str  # under the run's temporary directory
    load_kwargs: dict = dataclasses.field(default_factory=dict)
    broken_from: str | None = None  # a bad checkpoint: a truncated copy of this kind's directory


def _kinds(ms):
    return {
        k.name: k
        for k in [
            Kind("qwen2", "transformers", "qwen2"),
            Kind("qwen2-sharded", "transformers", "qwen2-sharded", {"mindspore_dtype": ms.bfloat16}),
            Kind("mixtral", "transformers", "mixtral"),
            Kind("vae", "diffusers", "vae", {"mindspore_dtype": ms.float16}),
            Kind("unet", "diffusers", "unet-sharded"),
            Kind("bad", "transformers", "bad-qwen2", broken_from="qwen2"),
            Kind("bad-vae", "diffusers", "bad-vae", broken_from="vae"),
        ]
    }


KIND_NAMES = ["qwen2", "qwen2-sharded", "mixtral", "vae", "unet", "bad", "bad-vae"]


def _classes():
    import mindone.diffusers as md
    import mindone.transformers as mt

    # the tests' tiny configs (tests/_helpers.py), Mixtral with more experts
    from _helpers import tiny_qwen2_config, tiny_transformers, tiny_unet, tiny_vae

    def qwen2():
        return mt.Qwen2ForCausalLM(tiny_qwen2_config())

    def mixtral():
        config = tiny_transformers("mixtral")["mixtral"][1]()
        config.num_local_experts = 32
        return mt.MixtralForCausalLM(config)

    def vae():
        return md.AutoencoderKL(**tiny_vae())

    def unet():
        return md.UNet2DConditionModel(**tiny_unet())

    # directory -> (build the model, save_pretrained kwargs); class to load each directory with
    builds = {
        "qwen2": (qwen2, {}),
        "qwen2-sharded": (qwen2, {"max_shard_size": "40KB"}),
        "mixtral": (mixtral, {}),
        "vae": (vae, {}),
        "unet-sharded": (unet, {"max_shard_size": "12KB"}),
    }
    classes = {
        "qwen2": mt.Qwen2ForCausalLM,
        "qwen2-sharded": mt.Qwen2ForCausalLM,
        "mixtral": mt.MixtralForCausalLM,
        "vae": md.AutoencoderKL,
        "unet-sharded": md.UNet2DConditionModel,
        "bad-qwen2": mt.Qwen2ForCausalLM,
        "bad-vae": md.AutoencoderKL,
    }
    return builds, classes


def _truncate_weights(directory):
    """Cut the (single) safetensors file of `directory` in half."""
    names = [n for n in os.listdir(directory) if n.endswith(".safetensors")]
    assert len(names) == 1, names
    path = os.path.join(directory, names[0])
    with open(path, "rb") as f:
        blob = f.read()
    with open(path, "wb") as f:
        f.write(blob[: len(blob) // 2])
    return path


def prepare(root, kinds, log):
    """Generate the checkpoints `kinds` need under `root` and the reference of
    each kind from an unpatched load: kind name -> ("model", snapshot) or
    ("error", exception type). Returns (load functions, references)."""
    from ms_loadpatch.testing import snapshot

    builds, classes = _classes()
    all_kinds = _kinds(__import__("mindspore"))
    wanted = [all_kinds[name] for name in dict.fromkeys(kinds)]
    directories = {all_kinds[k.broken_from].directory if k.broken_from else k.directory for k in wanted}
    loads, references = {}, {}
    with ms_loadpatch.disabled():
        for directory in sorted(directories):
            start = time.perf_counter()
            build, save_kwargs = builds[directory]
            model = build()
            model.save_pretrained(os.path.join(root, directory), **save_kwargs)
            del model
            log(f"generated {directory} in {time.perf_counter() - start:.1f}s")
        for kind in sorted(wanted, key=lambda k: k.name):
            path = os.path.join(root, kind.directory)
            if kind.broken_from:
                shutil.copytree(os.path.join(root, all_kinds[kind.broken_from].directory), path)
                _truncate_weights(path)

            def load(cls=classes[kind.directory], path=path, kwargs=kind.load_kwargs):
                return cls.from_pretrained(path, **kwargs)

            loads[kind.name] = load
            start = time.perf_counter()
            try:
                model = load()
            except Exception as exc:  # noqa: BLE001 - a broken checkpoint's reference is its error
                if not kind.broken_from:
                    raise
                references[kind.name] = ("error", type(exc))
            else:
                if kind.broken_from:
                    raise RuntimeError(f"{kind.name}: the unpatched load of a truncated checkpoint returned a model")
                references[kind.name] = ("model", snapshot(model))
                del model
            log(f"reference {kind.name} ({references[kind.name][0]}) in {time.perf_counter() - start:.1f}s")
    return loads, references


# -- the run


class Run:
    """What the threads report, under one lock."""

    def __init__(self, threads, rounds, watchdog):
        self.lock = threading.Lock()
        self.threads = threads
        self.total = threads * rounds
        self.watchdog_seconds = watchdog
        self.completed = 0
        self.loads = collections.Counter()  # kind -> loads done
        self.expected_failures = collections.Counter()  # "kind:ExceptionType" -> count
        self.started_disabled = 0  # loads that started while the plugin was disabled
        self.accelerated = collections.Counter()  # kind -> loads that took the plugin's path
        self.mismatches = []  # (thread, round, kind, problems)
        self.unexpected = []  # (where, text)
        self.toggles = 0
        self.window_open = False  # loads start serialised (around a disable()/enable())
        self.closing = False  # the window closes once its loads are done; loads wait to start meanwhile
        self.serial = threading.Lock()
        self.serial_in_flight = 0
        self.serialized = 0
        self.toggle_seconds = []  # how long each disable() took
        self.in_flight = {}  # thread name -> (what, since)
        self.last_progress = time.monotonic()
        self.progressed = threading.Condition(self.lock)
        self.workers_done = False

    def begin(self, what):
        with self.lock:
            self.in_flight[threading.current_thread().name] = (what, time.monotonic())

    def end(self, round_done=False):
        with self.lock:
            self.in_flight.pop(threading.current_thread().name, None)
            if round_done:
                self.completed += 1
            self.last_progress = time.monotonic()
            self.progressed.notify_all()

    def wait_for_completed(self, count, stop):
        with self.lock:
            self.progressed.wait_for(lambda: self.completed >= count or stop.is_set() or self.workers_done)


def one_load(run, kind, load, reference, where):
    from ms_loadpatch.testing import compare, snapshot

    expected, value = reference
    try:
        model = load()
    except Exception as exc:  # noqa: BLE001 - sorted below
        if expected == "error" and isinstance(exc, value):
            with run.lock:
                run.expected_failures[f"{kind}:{type(exc).__name__}"] += 1
            return
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        if expected == "error":
            text = f"raised {type(exc).__name__}, the unpatched load raises {value.__name__}:\n{text}"
        with run.lock:
            run.unexpected.append((where, text))
        return
    if expected == "error":
        with run.lock:
            run.unexpected.append((where, f"returned a {type(model).__name__}: the checkpoint is truncated"))
        return
    problems = compare(value, snapshot(model))
    if problems:
        with run.lock:
            run.mismatches.append((where, problems))


_counted = threading.local()


def _count_accelerated(wrapped, instance, args, kwargs):
    """Around ms_loadpatch.strategy.load.Load.running: an accelerated load in this thread."""
    _counted.loads = getattr(_counted, "loads", 0) + 1
    return wrapped(*args, **kwargs)


def worker(run, index, rounds, seed, kinds, loads, references, start_line):
    rng = random.Random(f"{seed}:{index}")
    try:
        start_line.wait()
        for r in range(rounds):
            kind = rng.choice(kinds)
            where = f"thread {index} round {r} {kind}"
            run.begin(f"load {kind} (round {r})")
            accelerated_before = getattr(_counted, "loads", 0)
            with run.lock:
                run.progressed.wait_for(lambda: not run.closing)
                run.started_disabled += not ms_loadpatch.is_enabled()
                serialise = run.window_open
                run.serialized += serialise
                run.serial_in_flight += serialise
            try:
                with run.serial if serialise else contextlib.nullcontext():
                    one_load(run, kind, loads[kind], references[kind], where)
            finally:
                if serialise:
                    with run.lock:
                        run.serial_in_flight -= 1
                with run.lock:
                    run.loads[kind] += 1
                    if getattr(_counted, "loads", 0) > accelerated_before:
                        run.accelerated[kind] += 1
                run.end(round_done=True)
    except BaseException as exc:  # noqa: BLE001 - reported, and the other threads go on
        with run.lock:
            run.unexpected.append(
                (f"thread {index}", "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
            )


def toggler(run, toggles, stop):
    """disable() once a share of the loads is done, enable() after some more."""
    try:
        for t in range(toggles):
            at = run.total * (t + 1) // (toggles + 1)
            run.wait_for_completed(at, stop)
            if stop.is_set() or run.workers_done:
                return
            with run.lock:
                run.window_open = True
            # a load that saw the window closed is inside from_pretrained by now: disable() waits for it
            time.sleep(0.2)
            run.begin("ms_loadpatch.disable()")
            start = time.perf_counter()
            try:
                ms_loadpatch.disable()
            finally:
                run.end()
            with run.lock:
                run.toggle_seconds.append(time.perf_counter() - start)
            # loads meanwhile run unpatched; enable again after a few of them
            run.wait_for_completed(at + max(run.threads, run.total // (10 * toggles)), stop)
            run.begin("ms_loadpatch.enable()")
            try:
                ok = ms_loadpatch.enable()
            finally:
                run.end()
            run.begin("closing the serialised window")
            try:
                with run.lock:  # once the loads started in the window are done; none starts meanwhile
                    run.closing = True
                    run.progressed.wait_for(lambda: not run.serial_in_flight)
                    run.window_open = run.closing = False
                    run.progressed.notify_all()
            finally:
                run.end()
            with run.lock:
                run.toggles += 1
                if not ok:
                    run.unexpected.append(("toggler", "ms_loadpatch.enable() returned False"))
    except BaseException as exc:  # noqa: BLE001
        with run.lock:
            run.unexpected.append(("toggler", "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))))
    finally:
        if not ms_loadpatch.is_enabled():  # a failure between the two: leave the plugin as found
            ms_loadpatch.enable()
        with run.lock:
            run.closing = False
            run.progressed.notify_all()


def dump_stacks(out):
    """Every thread's stack, with thread names (and faulthandler's view, C-level safe)."""
    names = {t.ident: (t.name, t.daemon) for t in threading.enumerate()}
    out.write("\n=== stacks of all threads ===\n")
    for ident, frame in sys._current_frames().items():
        name, daemon = names.get(ident, ("?", None))
        out.write(f"\n--- thread {name!r} (ident {ident}{', daemon' if daemon else ''}) ---\n")
        out.write("".join(traceback.format_stack(frame)))
    out.write("\n=== faulthandler ===\n")
    out.flush()
    faulthandler.dump_traceback(file=out, all_threads=True)
    out.flush()


def watchdog(run, stop, summary):
    """A stall: no load completed for the watchdog's seconds while loads remain,
    or one operation running that long. Dumps the stacks and ends the process."""
    limit = run.watchdog_seconds
    while not stop.wait(1.0):
        now = time.monotonic()
        with run.lock:
            idle = now - run.last_progress
            stuck = [(name, what, now - since) for name, (what, since) in run.in_flight.items() if now - since > limit]
            waiting = not run.workers_done
        if (waiting and idle > limit) or stuck:
            out = sys.stderr
            out.write(f"\nSTALL: no load completed for {idle:.0f}s (limit {limit:.0f}s)\n")
            with run.lock:
                for name, (what, since) in sorted(run.in_flight.items()):
                    out.write(f"  {name}: {what}, for {now - since:.0f}s\n")
            dump_stacks(out)
            print(summary(stalls=1), flush=True)
            sys.stdout.flush()
            os._exit(STALL_EXIT)


# -- after the run


def thread_origin(thread):
    cls = type(thread)
    if cls.__module__ != "threading":
        return cls.__module__
    target = getattr(thread, "_target", None)
    return getattr(target, "__module__", None) or "?"


def leftover_state(before_threads, before_states):
    """What the run left behind, as readable lines; and notes (not failures)."""
    import mindspore as ms
    import wrapt

    from ms_loadpatch import core
    from ms_loadpatch.strategy import building
    from ms_loadpatch.strategy.building.lazy import CONSTRUCTION_LOCK
    from ms_loadpatch.strategy.load import Load

    found, notes = [], []
    found += [f"building.leftovers(): {item}" for item in building.leftovers()]
    if CONSTRUCTION_LOCK.acquire(blocking=False):
        CONSTRUCTION_LOCK.release()
        free = []  # also from another thread: the lock is re-entrant for its owner
        probe = threading.Thread(
            target=lambda: free.append(
                CONSTRUCTION_LOCK.acquire(blocking=False) and (CONSTRUCTION_LOCK.release() or True)
            ),
            name="stress-lock-probe",
        )
        probe.start()
        probe.join(10)
        if free != [True]:
            found.append("CONSTRUCTION_LOCK is held by the main thread")
    else:
        found.append("CONSTRUCTION_LOCK cannot be acquired from the main thread")
    if getattr(ms.Parameter, "init_param", True) is not True:
        found.append(f"Parameter.init_param left {getattr(ms.Parameter, 'init_param', None)!r}")
    if Load.current() is not None:
        found.append("a load is still current in the main thread")
    if not ms_loadpatch.is_enabled():
        found.append("the plugin is not enabled after the run")
    after_states = {key: entry.state for key, entry in core._PATCHER._states.items()}
    if after_states != before_states:
        changed = {
            k: (before_states.get(k), after_states.get(k))
            for k in before_states.keys() | after_states.keys()
            if before_states.get(k) != after_states.get(k)
        }
        found.append(f"target states changed: {changed}")
    for key, (_, handle) in core._PATCHER._handles.items():
        target = next(t for t in core.TARGETS if t.key == key)
        _, _, installed = wrapt.resolve_path(sys.modules[target.module], target.path)
        if installed is not handle:
            found.append(f"{key}: {installed!r} is installed instead of the plugin's handle")

    def extra():
        return [t for t in threading.enumerate() if t.ident not in before_threads and t.is_alive()]

    new = extra()
    if new:
        notes.append(
            "threads alive right after the run that were not before: "
            + ", ".join(f"{t.name} ({thread_origin(t)}{', daemon' if t.daemon else ''})" for t in new)
        )
        deadline = time.monotonic() + 5
        while new and time.monotonic() < deadline:
            time.sleep(0.1)
            new = extra()
    for t in new:
        helper = t.daemon and thread_origin(t).split(".")[0] in ("mindspore", "tqdm")
        line = f"thread {t.name!r} ({thread_origin(t)}{', daemon' if t.daemon else ''}) still alive after 5s"
        (notes if helper else found).append(line)
    return found, notes


# -- main


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=4, help="loading threads (default 4)")
    parser.add_argument("--rounds", type=int, default=25, help="loads per thread (default 25)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the threads' choices (default 0)")
    parser.add_argument(
        "--watchdog",
        type=float,
        default=120.0,
        help="seconds without a completed load that count as a stall (default 120)",
    )
    parser.add_argument(
        "--loads",
        default=",".join(KIND_NAMES),
        help=f"comma-separated kinds to pick from (default and choices: {','.join(KIND_NAMES)})",
    )
    parser.add_argument("--no-toggle", action="store_true", help="no disable()/enable() during the run")
    parser.add_argument(
        "--toggles", type=int, default=1, help="disable()/enable() pairs spread over the run (default 1: in the middle)"
    )
    parser.add_argument(
        "--unpatched",
        action="store_true",
        help="the whole run with the plugin disabled, loads not serialised: mindone's own loads "
        "concurrently (expect a crash or mismatches: mindone is not thread-safe)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the generated checkpoints' directory")
    args = parser.parse_args(argv)
    args.kinds = [k.strip() for k in args.loads.split(",") if k.strip()]
    unknown = sorted(set(args.kinds) - set(KIND_NAMES))
    if unknown or not args.kinds:
        parser.error(f"unknown load kinds {unknown}; choose from {','.join(KIND_NAMES)}")
    if args.threads < 1 or args.rounds < 1:
        parser.error("--threads and --rounds must be at least 1")
    if args.no_toggle or args.unpatched:
        args.toggles = 0
    return args


def main(argv=None):
    args = parse_args(argv)
    faulthandler.enable(all_threads=True)  # a crash in native code still shows every thread's stack
    log = lambda text: print(f"[stress] {text}", flush=True)  # noqa: E731
    if not ms_loadpatch.enable():
        log("ms_loadpatch refuses these versions: nothing to stress")
        return 1

    from ms_loadpatch.testing import cpu_kernel_fallbacks

    root = tempfile.mkdtemp(prefix="ms_loadpatch-stress-")
    run = Run(args.threads, args.rounds, args.watchdog)
    started = time.perf_counter()

    def summary(stalls=0, leftovers=0, seconds=None):
        with run.lock:
            loads = ",".join(f"{k}:{n}" for k, n in sorted(run.loads.items())) or "none"
            failures = sum(run.expected_failures.values())
            return (
                f"SUMMARY rounds={run.completed} threads={args.threads} loads={loads} "
                f"expected_failures={failures} unexpected_errors={len(run.unexpected)} "
                f"mismatches={len(run.mismatches)} stalls={stalls} leftovers={leftovers} "
                f"accelerated={sum(run.accelerated.values())} toggles={run.toggles} "
                f"started_disabled={run.started_disabled} serialized={run.serialized} "
                f"seconds={time.perf_counter() - started if seconds is None else seconds:.1f}"
            )

    try:
        # one process-wide routing of the kernels the CPU wheel lacks, for the whole run
        with cpu_kernel_fallbacks():
            import mindone.diffusers.utils.logging as df_logging
            import transformers.utils.logging as tf_logging

            tf_logging.enable_progress_bar()  # mindone.transformers' "Loading checkpoint shards" bar
            df_logging.enable_progress_bar()

            setup = time.perf_counter()
            loads, references = prepare(root, args.kinds, log)
            log(
                f"setup {time.perf_counter() - setup:.1f}s; {args.threads} threads x {args.rounds} rounds of "
                f"{','.join(args.kinds)}, seed {args.seed}, {args.toggles} toggle(s), watchdog {args.watchdog:.0f}s"
            )

            import wrapt

            from ms_loadpatch import core
            from ms_loadpatch.strategy.load import Load

            before_threads = {t.ident for t in threading.enumerate()}
            before_states = {key: entry.state for key, entry in core._PATCHER._states.items()}
            log("threads before the run: " + ", ".join(sorted(t.name for t in threading.enumerate())))

            counting = wrapt.scoped_function_wrapper(Load, "running", _count_accelerated)
            counting.__enter__()
            if args.unpatched:
                ms_loadpatch.disable()
            started = time.perf_counter()
            run.last_progress = time.monotonic()  # the watchdog counts from here, not from the setup
            stop = threading.Event()
            start_line = threading.Barrier(args.threads)
            dog = threading.Thread(target=watchdog, args=(run, stop, summary), name="stress-watchdog", daemon=True)
            dog.start()
            pool = [
                threading.Thread(
                    target=worker,
                    name=f"stress-{i}",
                    args=(run, i, args.rounds, args.seed, args.kinds, loads, references, start_line),
                )
                for i in range(args.threads)
            ]
            if args.toggles:
                pool.append(threading.Thread(target=toggler, args=(run, args.toggles, stop), name="stress-toggler"))
            for thread in pool:
                thread.start()
            try:
                for thread in pool[: args.threads]:
                    while thread.is_alive():
                        thread.join(1.0)
                with run.lock:
                    run.workers_done = True
                    run.progressed.notify_all()
                for thread in pool[args.threads :]:
                    while thread.is_alive():
                        thread.join(1.0)
            finally:
                stop.set()
                dog.join(10)
                counting.__exit__(None, None, None)
            seconds = time.perf_counter() - started
            if args.unpatched:
                ms_loadpatch.enable()

            found, notes = leftover_state(before_threads, before_states)
    finally:
        if args.keep:
            log(f"checkpoints kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)

    for where, problems in run.mismatches:
        print(f"MISMATCH {where}:\n  " + "\n  ".join(problems[:20]), flush=True)
    for where, text in run.unexpected:
        print(f"UNEXPECTED {where}:\n{text}", flush=True)
    for line in found:
        print(f"LEFTOVER {line}", flush=True)
    for line in notes:
        print(f"NOTE {line}", flush=True)
    if run.expected_failures:
        log("expected failures: " + ", ".join(f"{k} x{n}" for k, n in sorted(run.expected_failures.items())))
    log(
        "accelerated loads: "
        + (", ".join(f"{k} {run.accelerated[k]}/{n}" for k, n in sorted(run.loads.items())) or "none")
    )
    if run.toggle_seconds:
        log("disable() took " + ", ".join(f"{s:.2f}s" for s in run.toggle_seconds))
    print(summary(leftovers=len(found), seconds=seconds), flush=True)
    ok = not run.mismatches and not run.unexpected and not found and run.completed == run.total
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
