"""The paired gain of one policy over another on the same held-out tasks (dreamjax.loop.evaluate.paired_gain) and
the script that reads two eval.json files (experiments/paired_gain.py)."""

import json
import math

import pytest

from dreamjax.loop.evaluate import paired_gain
from experiments import paired_gain as script


def outcomes(pattern: str, prefix: str = "t") -> list:
  return [[f"{prefix}/eval/{i}", c == "1", 2] for i, c in enumerate(pattern)]


def test_equal_outcomes_gain_nothing_and_a_sweep_gains_everything():
  same = paired_gain(outcomes("0110"), outcomes("0110"))
  assert (same["gain"], same["ci_low"], same["ci_high"], same["won"], same["lost"]) == (0.0, 0.0, 0.0, 0, 0)
  sweep = paired_gain(outcomes("0000"), outcomes("1111"))
  assert (sweep["gain"], sweep["ci_low"], sweep["ci_high"], sweep["won"]) == (1.0, 1.0, 1.0, 4)


def test_the_interval_is_that_of_the_per_task_differences():
  # 100 tasks: 30 won, 10 lost, 60 unchanged: differences of mean 0.2 and variance 0.4 - 0.04 = 0.36, so the mean's
  # standard error is 0.06 and the bootstrap's 95% interval about 0.2 +- 1.96 * 0.06.
  before = outcomes("0" * 30 + "1" * 10 + "01" * 30)
  after = outcomes("1" * 30 + "0" * 10 + "01" * 30)
  r = paired_gain(before, after, resamples=20_000)
  assert r["gain"] == pytest.approx(0.2) and (r["won"], r["lost"], r["tasks"]) == (30, 10, 100)
  half = 1.96 * math.sqrt(0.36 / 100)
  assert r["ci_low"] == pytest.approx(0.2 - half, abs=0.02) and r["ci_high"] == pytest.approx(0.2 + half, abs=0.02)
  # Two independent Wilson intervals would be far wider: the pairing is the point.
  assert r["ci_high"] - r["ci_low"] < 0.3
  assert paired_gain(before, after, resamples=20_000) == r  # seeded


def test_tasks_are_paired_by_id_and_the_unpaired_are_counted():
  before = outcomes("0101")
  after = list(reversed(outcomes("1111")[:3]))  # another order, one task missing (an env failure left out)
  r = paired_gain(before, after)
  assert (r["tasks"], r["won"], r["lost"], r["unpaired"]) == (3, 2, 0, 1)
  assert r["gain"] == pytest.approx(2 / 3)
  with pytest.raises(ValueError, match="share no task"):
    paired_gain(outcomes("01", "a"), outcomes("01", "b"))


def test_the_script_compares_greedy_and_sampled_and_names_a_bad_file(tmp_path, capsys):
  def write(name, greedy, sampled):
    def side(pattern):
      return {"success_rate": pattern.count("1") / len(pattern), "outcomes": outcomes(pattern, "click-link"),
              "per_game": {"click-link": {"successes": pattern.count("1")}}}
    ev = side(greedy) | {"sampled": side(sampled)}
    (tmp_path / name).write_text(json.dumps(ev))
    return str(tmp_path / name)

  out = tmp_path / "gain.json"
  assert script.main([write("a.json", "0011", "0001"), write("b.json", "0111", "0000"), "--out", str(out)]) == 0
  result = json.loads(out.read_text())
  assert result["greedy"]["gain"] == 0.25 and result["greedy"]["after_per_game"] == {"click-link": 3}
  assert result["sampled"]["gain"] == -0.25 and result["sampled"]["lost"] == 1
  assert "greedy: 0.500 -> 0.750, gain +0.250" in capsys.readouterr().out
  (tmp_path / "bad.json").write_text("{}")
  with pytest.raises(SystemExit, match="bad.json: no 'outcomes' field"):
    script.main([str(tmp_path / "bad.json"), str(out)])
