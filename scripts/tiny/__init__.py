"""Training and evaluation of the bundled tiny-shapes model: for scripts and tests, never installed.

The worker needs none of this: it loads the folders under workers/assets like any Hugging Face checkpoint.
Modules: shapes (the synthetic task), tokenizer and model (the folders' tokenizer and configs), data (training
rows), targets and losses, loop (batches and the optimiser loop), train (the whole run), evaluate, card (the
model cards).
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TARGET_DIR = ROOT / "workers" / "assets" / "tiny-shapes"
DRAFT_DIR = ROOT / "workers" / "assets" / "tiny-shapes-draft"
DEMO_DIR = ROOT / "vlmq" / "demo_assets"
# training draws from TRAIN_SEED up; held-out evaluation, the demo assets and the tests each have their own seed
TRAIN_SEED, EVAL_SEED, DEMO_SEED, TEST_SEED = 1000, 7, 8, 9
