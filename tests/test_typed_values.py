"""experiments/typed_values.py: what a policy typed against what the goal quoted, from `dreamjax eval`'s episodes."""

import json

import pytest

from dreamjax.data.records import StepRecord, TrajectoryRecord
from dreamjax.envs.base import Task
from experiments import typed_values as script


def record(task_id: str, instruction: str, actions: list[str]) -> TrajectoryRecord:
  steps = tuple(StepRecord(state=f"Goal: {instruction}", action=a, next_state="", reward=0.0, done=False,
                           success=False, invalid=False, admissible=(), source="policy") for a in actions)
  return TrajectoryRecord(episode_id=f"policy:{task_id}", env="miniwob", task=Task.make("miniwob", task_id),
                          instruction=instruction, policy="policy", seed=0, steps=steps, success=False,
                          num_steps=len(steps), score=None)


def test_fills_are_scored_against_the_quoted_value_they_match_best():
  records = [
      # Both fields of login-user: the username right, the password with 1 of 3 characters in place.
      record("login-user/eval/0", 'Enter the username "kenda" and the password "x9H" into the text fields.',
             ["fill('16', 'kenda')", "fill('19', 'x42')", "click('20')"]),
      # Case is ignored (enter-text-2 types the other case); a short fill counts the missing characters as wrong.
      record("enter-text-2/eval/0", 'Type "MYRON" in all lower case letters.', ["fill('14', 'myron')"]),
      record("enter-text-2/eval/1", 'Type "TULA" in all lower case letters.', ["fill('14', 'tu')"]),
      # The value's characters in another order: none in place, all held.
      record("enter-password/eval/0", 'Enter the password "aGikC" into both text fields.', ["fill('16', 'GikCa')"]),
      # No quoted value, nothing to score.
      record("click-option/eval/0", "Select 42 and click Submit.", ["click('21')"]),
  ]
  result = script.typed_values(records)
  # Typed characters the value holds: login-user 5 + 1 ('x') of 8; enter-text-2 5 + 2 of 7.
  assert result == {"enter-text-2": {"fills": 2, "exact": 1, "char_accuracy": pytest.approx(7 / 9),
                                     "chars_in_value": pytest.approx(7 / 7)},
                    "login-user": {"fills": 2, "exact": 1, "char_accuracy": pytest.approx(6 / 8),
                                   "chars_in_value": pytest.approx(6 / 8)},
                    "enter-password": {"fills": 1, "exact": 0, "char_accuracy": 0.0, "chars_in_value": 1.0}}


def test_the_script_prints_and_writes_per_file_and_names_a_bad_line(tmp_path, capsys):
  path = tmp_path / "episodes.jsonl"
  path.write_text(json.dumps(record("enter-password/eval/0", 'Enter the password "w4" into both text fields.',
                                    ["fill('16', 'w4')", "fill('19', 'wG')"]).to_json()) + "\n")
  out = tmp_path / "typed.json"
  assert script.main([str(path), "--out", str(out)]) == 0
  assert json.loads(out.read_text())[str(path)]["enter-password"] == {"fills": 2, "exact": 1, "char_accuracy": 0.75,
                                                                       "chars_in_value": 0.75}
  assert "enter-password: 1 of 2 fills exact, characters right 0.750, typed characters the value holds 0.750" in \
      capsys.readouterr().out
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"format": "dreamjax.trajectory.v1"}\n')
  with pytest.raises(SystemExit, match="bad.jsonl:1"):
    script.main([str(bad)])
