"""Train the bundled tiny shapes VLM (Qwen2-VL) and its text-only draft (Qwen2) on CPU.

    python scripts/train_tiny.py                       # full run -> workers/assets/tiny-shapes{,-draft}
    python scripts/train_tiny.py --steps 0             # random-initialised folders (loading tests)
    python scripts/train_tiny.py --steps 5 --draft-steps 5 --max-side 112 --out /tmp/x --draft-out /tmp/y

Data are generated on the fly from scripts/tiny/shapes.py (training seeds start at TRAIN_SEED; held-out
evaluation uses EVAL_SEED, demo assets DEMO_SEED, and the tests TEST_SEED, never mixed). One image yields
several rows (caption + questions); the vision tower runs once per image and its features are shared by the
rows. Images are bucketed by token count, so padding stays small. The code lives in scripts/tiny/ (targets and
losses, the loop, evaluation, the model cards); the defaults reproduce the shipped weights' recipe.
"""

import sys

from tiny.train import main

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:], description=__doc__))
