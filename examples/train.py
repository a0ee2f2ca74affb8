"""An ordinary training script: it knows nothing about ms_loadpatch.

    python train.py                           # unpatched
    python train_with_import.py               # the same, plugin on by one import
    ./train_with_env.sh                       # the same, plugin on from outside

With no --model it trains a tiny Qwen2 generated locally.
"""

import argparse
import sys
import time

import numpy as np


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", help="checkpoint directory (default: a generated tiny Qwen2)")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)

    import mindspore as ms
    from mindspore import nn

    from _tiny_model import cpu_fallbacks, tiny_model
    from mindone.transformers import AutoModelForCausalLM

    path = args.model or tiny_model()
    with cpu_fallbacks():
        start = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(path)
        print(f"loaded {type(model).__name__} from {path} in {time.perf_counter() - start:.3f} s")

        # Only reports on the plugin; never imports it.
        plugin = sys.modules.get("ms_loadpatch")
        if plugin is not None and plugin.is_enabled():
            report = plugin.last_report()
            print("ms_loadpatch: on;", report.summary() if report else "this load was not accelerated")
        else:
            print("ms_loadpatch: off")

        optimizer = nn.SGD(model.trainable_params(), learning_rate=0.1)
        rng = np.random.default_rng(0)
        tokens = ms.Tensor(rng.integers(0, model.config.vocab_size, (2, 8)), ms.int32)

        def loss_fn(input_ids):
            return model(input_ids=input_ids, labels=input_ids).loss

        grad_fn = ms.value_and_grad(loss_fn, None, optimizer.parameters)
        model.set_train(True)
        for step in range(args.steps):
            loss, grads = grad_fn(tokens)
            optimizer(grads)
            print(f"step {step}: loss {float(loss):.4f}")


if __name__ == "__main__":
    main()
