"""One rank of a job whose ranks load different things (tests/jobs/test_multinode.py).

Each rank loads what `--plan` gives it (`RANK=MODEL,MODEL;...`, `{node}` in a
model replaced by the node; a rank not named loads nothing), then every rank
runs the script's own collective: an AllReduce of rank + 1. Writes
OUT/rank<R>.json: the AllReduce's result, a digest of each model's
parameters, each load's report line, the job's seconds, and how many
collectives, groups and stores the plugin made during the loads.

    msrun ... _asymmetric_worker.py --out DIR --plan "0=/m/a;1=/m/a,/m/a" [--patched]
"""

import argparse
import hashlib
import json
import os
import sys
import time


class _Counted:
    """Counts what the loads make of mindspore's communication (the script makes none while loading)."""

    def __init__(self):
        import mindspore.communication as communication
        import mindspore.mint.distributed as distributed
        from mindspore import ops

        self.counts = {"collectives": 0, "groups": 0, "stores": 0}
        self._undo = []
        for name in ("AllReduce", "AllGather", "Broadcast", "ReduceScatter"):
            self._wrap(ops, name, "collectives")
        self._wrap(communication, "create_group", "groups")
        self._wrap(distributed, "TCPStore", "stores")

    def _wrap(self, module, name, kind):
        original = getattr(module, name)

        def counted(*args, **kwargs):
            self.counts[kind] += 1
            return original(*args, **kwargs)

        setattr(module, name, counted)
        self._undo.append((module, name, original))

    def restore(self):
        for module, name, original in self._undo:
            setattr(module, name, original)


def _digest(model) -> str:
    digest = hashlib.sha256()
    for name, param in model.parameters_and_names():
        digest.update(name.encode() + param.float().asnumpy().tobytes())
    return digest.hexdigest()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--plan", required=True)
    parser.add_argument("--patched", action="store_true")
    args = parser.parse_args()
    started = time.monotonic()
    if args.patched:
        import ms_loadpatch  # noqa: F401 - the activation under test

    import mindspore as ms
    from mindspore import ops
    from mindspore.communication import get_group_size, get_rank, init

    ms.set_context(mode=ms.PYNATIVE_MODE)
    init()
    rank, size = get_rank(), get_group_size()
    plan = dict(part.split("=", 1) for part in args.plan.split(";") if part)
    node = os.environ.get("MS_LOADPATCH_NODE_ID", "")
    models = [m.replace("{node}", node) for m in plan.get(str(rank), "").split(",") if m]

    import ms_loadpatch

    if not args.patched:
        ms_loadpatch.disable()
    from mindone.transformers import AutoModelForCausalLM

    from ms_loadpatch.testing import cpu_kernel_fallbacks

    result = {"rank": rank, "digests": [], "reports": []}
    counted = _Counted()
    try:
        with cpu_kernel_fallbacks():
            for model_dir in models:
                model = AutoModelForCausalLM.from_pretrained(model_dir)
                result["digests"].append(_digest(model))
                report = ms_loadpatch.last_report() if args.patched else None
                result["reports"].append(report.cooperative if report is not None else None)
                del model
    finally:
        counted.restore()
    result["plugin_made"] = counted.counts
    summed = ops.AllReduce()(ms.Tensor([float(rank + 1)] * 4, ms.float32))
    result["allreduce"] = summed.asnumpy().tolist()
    result["expected"] = [float(size * (size + 1) // 2)] * 4
    result["seconds"] = time.monotonic() - started
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    sys.exit(main())
