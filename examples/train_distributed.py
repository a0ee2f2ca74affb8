"""A data-parallel training script for msrun: every rank loads the same
checkpoint with from_pretrained and trains under mindone's ZeRO helper. It
knows nothing about ms_loadpatch; train_distributed.sh turns it on from outside.

    msrun --worker_num=2 --local_worker_num=2 --join=True train_distributed.py [--model PATH]

With no --model every rank trains a tiny Qwen2 generated locally (rank 0
writes it; the others wait for it).
"""

import argparse
import os
import sys
import time

import numpy as np


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", help="checkpoint directory (default: a generated tiny Qwen2)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--zero-stage", type=int, default=None,
                        help="mindone ZeRO stage (default 2; 0 on CPU, whose backend has no ReduceScatter)")
    args = parser.parse_args(argv)

    import mindspore as ms
    from mindspore.communication import get_group_size, get_rank, init

    ms.set_context(mode=ms.PYNATIVE_MODE)
    init()
    rank, ranks = get_rank(), get_group_size()
    ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True)
    on_cpu = ms.get_context("device_target") == "CPU"
    zero_stage = args.zero_stage if args.zero_stage is not None else (0 if on_cpu else 2)

    from _tiny_model import cpu_fallbacks, tiny_model
    from mindone.transformers import AutoModelForCausalLM

    path = args.model or _tiny_model_on_every_rank(tiny_model, rank)
    with cpu_fallbacks():
        start = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(path)
        print(f"rank {rank}/{ranks}: loaded {type(model).__name__} in {time.perf_counter() - start:.3f} s")
        plugin = sys.modules.get("ms_loadpatch")  # only reports on the plugin; never imports it
        if plugin is not None and plugin.is_enabled():
            report = plugin.last_report()
            print(f"rank {rank}: ms_loadpatch on;", report.summary() if report else "this load was not accelerated")
        else:
            print(f"rank {rank}: ms_loadpatch off")

        train_step = zero_train_step(model, zero_stage)
        rng = np.random.default_rng(rank)  # each rank its own batch
        for step in range(args.steps):
            tokens = ms.Tensor(rng.integers(0, model.config.vocab_size, (2, 8)), ms.int32)
            print(f"rank {rank} step {step}: loss {train_step(tokens):.4f} (ZeRO stage {zero_stage})")


def zero_train_step(model, zero_stage):
    """One training step of a causal LM as a function of a token batch (its
    loss as a float): SGD through mindone's ZeRO helper at `zero_stage`."""
    from mindspore import nn
    from mindspore.communication import GlobalComm

    from mindone.trainers.zero import prepare_train_network

    class WithLoss(nn.Cell):
        def __init__(self, network):
            super().__init__(auto_prefix=False)
            self.network = network

        def construct(self, input_ids):
            return self.network(input_ids=input_ids, labels=input_ids).loss

    network = WithLoss(model)
    optimizer = nn.SGD(network.trainable_params(), learning_rate=0.1)
    wrapped = prepare_train_network(network, optimizer, zero_stage=zero_stage,
                                    optimizer_parallel_group=GlobalComm.WORLD_COMM_GROUP)
    model.set_train(True)

    def step(tokens):
        loss = wrapped(tokens)
        loss = loss[0] if isinstance(loss, tuple) else loss
        return float(loss.asnumpy())

    return step


def _tiny_model_on_every_rank(tiny_model, rank):
    """Rank 0 writes the tiny checkpoint; the others wait for its config."""
    import tempfile

    directory = os.path.join(tempfile.gettempdir(), "ms_loadpatch_example_qwen2")
    if rank == 0:
        return tiny_model(directory)
    deadline = time.monotonic() + 300
    while not os.path.isfile(os.path.join(directory, "config.json")):  # tiny_model renames a complete folder
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0 did not write {directory} within 300 s")
        time.sleep(0.2)
    return directory


if __name__ == "__main__":
    main()
