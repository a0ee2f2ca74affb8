"""One rank of an msrun job started by tests/jobs/test_multirank.py.

Loads a checkpoint with mindone's from_pretrained (the plugin on or off is
the launcher's business: MS_LOADPATCH, `ms-loadpatch run`, or `--import`),
then optionally trains a few steps under mindone's ZeRO at the given stages.
Writes what it saw to OUT/rank<R>.json and the parameters to
OUT/rank<R>-<what>.npz; errors go to OUT/rank<R>.error and exit 1.

    msrun --worker_num=2 --local_worker_num=2 ... _msrun_worker.py --out DIR --model PATH [--zero 2 3]

`{rank}` in --model is replaced by the rank (a per-rank checkpoint).
"""

import argparse
import json
import os
import signal
import sys
import threading
import traceback

sys.path.append(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))


class _ReduceScatterOnCpu:
    """mindspore's CPU backend has no ReduceScatter kernel (ZeRO stages 2-3
    use it for gradients): AllReduce, then this rank's block along dim 0,
    the same sums. Both jobs compared use it."""

    def __init__(self, op="sum", group=None):
        from mindspore import ops
        from mindspore.communication import GlobalComm, get_group_size, get_rank

        group = group or GlobalComm.WORLD_COMM_GROUP
        self.allreduce = ops.AllReduce(op=op, group=group)
        self.size, self.rank = get_group_size(group), get_rank(group)

    def __call__(self, x):
        block = x.shape[0] // self.size
        return self.allreduce(x)[self.rank * block : (self.rank + 1) * block]


def _train(model_dir, stage, steps, rank, group_size):
    import mindspore as ms
    import numpy as np
    from mindone.transformers import AutoModelForCausalLM
    from train_distributed import zero_train_step  # examples/: the example's own training step

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    full_shapes = {name: tuple(p.shape) for name, p in model.parameters_and_names()}
    train_step = zero_train_step(model, stage)
    rng = np.random.default_rng(100 + rank)  # each rank its own fixed batch, as data parallelism has
    losses = []
    for _ in range(steps):
        losses.append(train_step(ms.Tensor(rng.integers(0, model.config.vocab_size, (2, 8)), ms.int32)))
    return losses, _parameters(model, group_size, full_shapes)


def _parameters(model, group_size, full_shapes):
    """Every parameter whole, as float32 numpy (ZeRO-3 leaves a slice along
    dim 0 on each rank; AllGather puts it back together in rank order)."""
    import mindspore as ms
    from mindspore import ops

    allgather = ops.AllGather() if group_size > 1 else None
    out = {}
    for name, param in model.parameters_and_names():
        value = ms.Tensor(param.asnumpy()).astype(ms.float32)
        if tuple(param.shape) != full_shapes[name]:
            value = allgather(value)
        out[name] = value.asnumpy()
    return out


def _write_failure(out, rank, exc, before):
    """What the failed load left: its error, the process state check of
    tests/_process_state.py, and reader threads still alive."""
    from _process_state import assert_state_restored

    try:
        assert_state_restored(before)
        restored = "yes"
    except AssertionError as problem:
        restored = f"no: {problem}"
    threads = [t.name for t in threading.enumerate() if t.name.startswith("ms_loadpatch") and t.is_alive()]
    with open(os.path.join(out, f"rank{rank}-failure.json"), "w") as f:
        json.dump(
            {"error_type": type(exc).__name__, "error": str(exc), "state_restored": restored, "threads_left": threads},
            f,
        )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--import", dest="import_plugin", action="store_true", help="import ms_loadpatch here")
    parser.add_argument("--zero", type=int, nargs="*", default=[])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--seed", type=int, default=None, help="ms.set_seed before the load; its random state after")
    parser.add_argument("--dtype", default=None, help="the load's dtype (a mindspore dtype's name)")
    args = parser.parse_args()
    # SIGUSR1 ends this rank at once with exit code 0: a rank that dies without msrun ending its node's others
    signal.signal(signal.SIGUSR1, lambda *_: os._exit(0))

    if args.import_plugin:
        import ms_loadpatch  # noqa: F401 - the activation under test

    import mindspore as ms
    import numpy as np
    from mindspore.communication import get_group_size, get_rank, init

    ms.set_context(mode=ms.PYNATIVE_MODE)
    init()
    rank, group_size = get_rank(), get_group_size()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"rank{rank}.pid"), "w") as f:  # for a test that kills a rank
        f.write(str(os.getpid()))
    try:
        plugin_loaded_before = "ms_loadpatch" in sys.modules
        from ms_loadpatch.testing import cpu_kernel_fallbacks

        if not plugin_loaded_before:
            import ms_loadpatch

            ms_loadpatch.disable()  # imported for the CPU stand-ins only: this job loads unpatched
        from _process_state import process_state, random_state_digest  # this file's folder is on sys.path
        from mindone.transformers import AutoModelForCausalLM

        import ms_loadpatch

        model_dir = args.model.replace("{rank}", str(rank)).replace(
            "{node}", os.environ.get("MS_LOADPATCH_NODE_ID", "")
        )
        result = {"rank": rank}
        with cpu_kernel_fallbacks():
            kwargs = {"dtype": getattr(ms, args.dtype)} if args.dtype else {}
            if args.seed is not None:
                ms.set_seed(args.seed)
            before = process_state()
            try:
                model = AutoModelForCausalLM.from_pretrained(model_dir, **kwargs)
            except Exception as exc:
                _write_failure(args.out, rank, exc, before)
                raise
            report = ms_loadpatch.last_report() if ms_loadpatch.is_enabled() else None
            result["enabled"] = ms_loadpatch.is_enabled()
            result["random_state"] = random_state_digest()
            result["report"] = report.as_dict() if report else None
            result["threads_after_load"] = [
                t.name for t in threading.enumerate() if t.name.startswith("ms_loadpatch") and t.is_alive()
            ]
            np.savez(
                os.path.join(args.out, f"rank{rank}-loaded.npz"),
                **{name: p.float().asnumpy() for name, p in model.parameters_and_names()},
            )
            del model
            if args.zero:
                ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True)
                if ms.get_context("device_target") == "CPU":
                    ms.ops.ReduceScatter = _ReduceScatterOnCpu
                os.chdir(args.out)  # ZeroHelper writes its params_info folder here
                result["zero"] = {}
                for stage in args.zero:
                    try:
                        losses, params = _train(model_dir, stage, args.steps, rank, group_size)
                    except RuntimeError as exc:  # what this backend cannot run, recorded for comparison
                        result["zero"][str(stage)] = {"error": str(exc).strip().splitlines()[0]}
                        continue
                    result["zero"][str(stage)] = {"losses": losses}
                    np.savez(os.path.join(args.out, f"rank{rank}-zero{stage}.npz"), **params)
        with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
    except BaseException:
        with open(os.path.join(args.out, f"rank{rank}.error"), "w") as f:
            f.write(traceback.format_exc())
        raise


if __name__ == "__main__":
    main()
