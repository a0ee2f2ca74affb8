"""train.py with the plugin on: one import, before or after mindone.

    python train_with_import.py [--model PATH] [--steps N]
"""

import ms_loadpatch  # noqa: F401  (this line is the whole change)

from train import main

if __name__ == "__main__":
    main()
