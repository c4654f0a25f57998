"""Accuracy of a tiny-shapes folder on every held-out split its model card quotes, in one run.

    python scripts/eval_tiny.py                       # the bundled workers/assets/tiny-shapes
    python scripts/eval_tiny.py /tmp/run/t --scale 0.1

Splits, none used in training (scripts/train_tiny.py trains from seed 1000 up): the training script's own
evaluation (seed 7), the tests' 200 (seed 9), 600 questions without captions (seed 21) and 300 captions (seed 22).
Prints one JSON object: per split, exact match and [right, total] by question kind and by image size.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tiny import EVAL_SEED, TARGET_DIR, TEST_SEED
from tiny.evaluate import evaluate_folder

SPLITS = {
    "eval": dict(seed=EVAL_SEED, n=200),
    "tests": dict(seed=TEST_SEED, n=200),
    "questions": dict(seed=21, n=600, caption_prob=0.0),
    "captions": dict(seed=22, n=300, caption_prob=1.0),
}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", nargs="?", type=Path, default=TARGET_DIR)
    p.add_argument("--scale", type=float, default=1.0, help="fraction of each split to run (smoke tests)")
    args = p.parse_args(argv)
    report = {}
    for name, split in SPLITS.items():
        n = max(1, round(split["n"] * args.scale))
        result = evaluate_folder(args.folder, None, **{**split, "n": n})
        report[name] = {key: result[key] for key in ("seed", "n", "exact_match", "by_question", "by_size")}
    print(json.dumps(report, indent=1), flush=True)
    return report


if __name__ == "__main__":
    main()
