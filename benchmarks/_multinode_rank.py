"""One rank of a bench_multinode.py job: every rank ready (an AllReduce),
then the timed part: from_pretrained and a touch of every weight. Writes
OUT/rank<R>.json (seconds, the load's report, peak RSS)."""

import argparse
import json
import os
import resource
import time


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True, help="{node} is replaced by MS_LOADPATCH_NODE_ID")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    import mindspore as ms
    import numpy as np
    from mindspore import ops
    from mindspore.communication import get_rank, init

    import ms_loadpatch
    from ms_loadpatch.testing import cpu_kernel_fallbacks

    ms.set_context(mode=ms.PYNATIVE_MODE)
    init()
    rank = get_rank()
    from mindone.transformers import AutoModelForCausalLM

    path = args.model.replace("{node}", os.environ.get("MS_LOADPATCH_NODE_ID", ""))
    ops.AllReduce()(ms.Tensor(np.ones(1, np.float32))).asnumpy()  # the loads start together
    with cpu_kernel_fallbacks():  # as the other benchmarks: kernels the CPU wheel lacks, alike for every mode
        started = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(path)
        for param in model.get_parameters():  # a weight not yet in memory is a promise, not a load
            param.asnumpy().reshape(-1)[:1].copy()
        seconds = time.perf_counter() - started
    report = ms_loadpatch.last_report()
    fields = ("cooperative", "bytes_from_storage", "bytes_received", "staging_bytes", "total", "phases")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(
            {
                "rank": rank,
                "seconds": seconds,
                "report": {k: getattr(report, k) for k in fields} if report else None,
                "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            },
            f,
        )


if __name__ == "__main__":
    main()
