"""Write constraints.txt: the versions this environment resolved, for a reproducible install.

`.ci/run` calls it after a green run in its fresh virtual environment, so the file says what the last green CI
resolved; commit it with the change that ran. A user pins an install with it::

    pip install torch==2.13.0 && pip install -c constraints.txt -e ".[worker,demo]"

Usage: ``python scripts/freeze_constraints.py [OUT]`` (default: constraints.txt at the repository root), run with
the interpreter of the environment to freeze.
"""
from __future__ import annotations

import subprocess
import sys
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# torch is the user's own build (CPU, or the CUDA build that matches their driver), installed before vlmq; its
# CUDA runtime wheels come with it. Pinning them would refuse every other build.
LEFT_OUT = ("torch", "nvidia-", "vlmq", "pip", "setuptools", "wheel")


def frozen() -> list[str]:
    """``name==version`` for every installed distribution but the left-out ones, sorted by name."""
    out = subprocess.run([sys.executable, "-m", "pip", "freeze", "--exclude-editable", "--all"], check=True,
                         capture_output=True, text=True).stdout
    pins = [line.strip() for line in out.splitlines() if "==" in line]
    return sorted((p for p in pins if not p.lower().startswith(LEFT_OUT)), key=str.lower)


def main(argv: list[str]) -> int:
    out = Path(argv[0]) if argv else ROOT / "constraints.txt"
    header = [f"# What the last green CI run resolved ({date.today().isoformat()}, Python "
              f"{sys.version.split()[0]}); written by scripts/freeze_constraints.py, not by hand.",
              "# pip install torch==2.13.0 && pip install -c constraints.txt -e \".[worker,demo]\"  (torch: your "
              "build, not pinned here)"]
    pins = frozen()
    out.write_text("\n".join(header + pins) + "\n")
    print(f"wrote {out} ({len(pins)} pins)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
