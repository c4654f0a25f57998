"""scripts/eval_tiny.py: every split the model card's accuracy figures come from, in one run."""

from __future__ import annotations

import json

import eval_tiny


def test_eval_script_reports_every_split_the_card_quotes(capsys):
    """The card's figures (seed 7, the tests' seed 9, questions-only seed 21, captions-only seed 22) come from one
    run of it; here a small slice of each split on the bundled weights."""
    report = eval_tiny.main(["--scale", "0.02"])
    assert set(report) == {"eval", "tests", "questions", "captions"}
    assert [report[k]["seed"] for k in ("eval", "tests", "questions", "captions")] == [7, 9, 21, 22]
    assert set(report["captions"]["by_question"]) == {"caption"}
    assert "caption" not in report["questions"]["by_question"]
    assert report["questions"]["n"] == 12 and report["captions"]["exact_match"] >= 0.5
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(report))
