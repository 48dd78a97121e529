"""dreamjax.loop.plots: each figure writes a well-formed SVG and a PNG for the inputs the loops hand it, including
their edge cases, and writing it twice gives the same bytes."""

import math
import xml.etree.ElementTree as ET

import pytest

from dreamjax.loop.plots import data_efficiency, fidelity_plot, learning_curve, metric_curves, success_bars

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _eval(i, rate, sampled=None):
  row = {"iteration": i, "real_transitions": 100 * i, "synthetic_transitions": 500 * i, "success_rate": rate,
         "ci_low": max(0.0, rate - 0.1), "ci_high": min(1.0, rate + 0.1)}
  if sampled is not None:
    row["sampled"] = {"success_rate": sampled, "ci_low": max(0.0, sampled - 0.2), "ci_high": min(1.0, sampled + 0.2)}
  return row


def _svg_text(path):
  """Parses the SVG and returns all its text (labels are kept as text)."""
  root = ET.parse(path).getroot()
  assert root.tag == "{http://www.w3.org/2000/svg}svg"
  return " ".join(t for el in root.iter() for t in (el.text,) if t)


def _check(draw, tmp_path, name):
  """Draws to .svg twice and to .png; returns the SVG's text after checking both formats and the repeat."""
  first = draw(tmp_path / f"{name}.svg")
  assert first == tmp_path / f"{name}.svg"
  again = draw(tmp_path / f"{name}_again.svg")
  assert first.read_bytes() == again.read_bytes()
  png = draw(tmp_path / f"{name}.png").read_bytes()
  assert png.startswith(PNG_MAGIC) and png == draw(tmp_path / f"{name}_again.png").read_bytes()
  return _svg_text(first)


@pytest.mark.parametrize("case", ["typical", "one_eval", "sampled", "synthetic", "empty"])
def test_learning_curve(tmp_path, case):
  evals = {"typical": [_eval(0, 0.1), _eval(2, 0.4), _eval(4, 0.55)], "one_eval": [_eval(0, 0.0)],
           "sampled": [_eval(0, 0.2, 0.1), _eval(3, 0.5, 1.0)], "synthetic": [_eval(1, 1.0), _eval(2, 0.9)],
           "empty": []}[case]
  train = [] if case in ("one_eval", "empty") else [(1, 50, 0.2), (2, 120, 0.3), (3, 200, 0.45)]
  transitions = "synthetic_transitions" if case == "synthetic" else "real_transitions"
  text = _check(lambda p: learning_curve(evals, p, train=train, title="GRPO on twx", transitions=transitions),
                tmp_path, case)
  assert "GRPO on twx" in text and "iteration" in text and transitions.replace("_", " ") in text
  assert ("held-out, sampled" in text) == (case == "sampled")
  assert ("training rollouts" in text) == bool(train)


def test_learning_curve_sampled_needs_every_row(tmp_path):
  text = _svg_text(learning_curve([_eval(0, 0.2, 0.1), _eval(1, 0.3)], tmp_path / "lc.svg"))
  assert "held-out, greedy" in text and "held-out, sampled" not in text


def test_metric_curves(tmp_path):
  rows = [{"step": s, "loss": 1.0 / s, "kl": math.nan if s % 2 else 0.01 * s, "nan_only": math.nan,
           "phase": "train", **({"eval": 0.5} if s == 3 else {})} for s in range(1, 6)]
  rows.append({"step": 6, "loss": math.inf, "time_s": 1.0})
  keys = ("loss", "kl", "absent", "phase", "nan_only", "eval", "a", "b", "c", "time_s")
  text = _check(lambda p: metric_curves(rows, keys, p, title="curves"), tmp_path, "metrics")
  for key in ("curves", "loss", "kl", "nan_only", "eval", "time_s"):
    assert key in text
  for key in ("absent", "phase"):  # never a number: no panel
    assert key not in text


@pytest.mark.parametrize("rows", [[], [{"step": 1}]])
def test_metric_curves_nothing_to_draw(tmp_path, rows):
  assert "loss" not in _check(lambda p: metric_curves(rows, ("loss",), p), tmp_path, "empty")


def test_metric_curves_x_key(tmp_path):
  rows = [{"iteration": i, "success": i / 4} for i in range(4)]
  assert "iteration" in _svg_text(metric_curves(rows, ("success",), tmp_path / "m.svg", x_key="iteration"))


@pytest.mark.parametrize("n", [0, 1, 4])
def test_success_bars(tmp_path, n):
  methods = ["GRPO", "PPO", "DreamGym", "DreamGym-S2R"][:n]
  rows = [{"method": m, "success_rate": 0.2 * i, "ci_low": max(0.0, 0.2 * i - 0.1), "ci_high": 0.2 * i + 0.1,
           "real_transitions": 1000 * i} for i, m in enumerate(methods)]
  text = _check(lambda p: success_bars(rows, p), tmp_path, f"bars{n}")
  assert "held-out success" in text
  for i, m in enumerate(methods):
    assert m in text and f"{1000 * i} online real" in text


@pytest.mark.parametrize("case", ["typical", "dreamgym_only", "empty"])
def test_data_efficiency(tmp_path, case):
  curves = {"GRPO (real env)": [_eval(0, 0.3), _eval(4, 0.5), _eval(8, 0.6)],
            "DreamGym GRPO": [_eval(0, 0.3) | {"real_transitions": 0}, _eval(8, 0.55) | {"real_transitions": 0}],
            "DreamGym-S2R GRPO": [_eval(0, 0.55), _eval(1, 0.65)], "no evaluations": []}
  curves = {"typical": curves, "dreamgym_only": {"DreamGym GRPO": curves["DreamGym GRPO"]}, "empty": {}}[case]
  text = _check(lambda p: data_efficiency(curves, p, title="twc"), tmp_path, case)
  assert "online real transitions spent" in text and "twc" in text
  assert ("GRPO (real env)" in text) == (case == "typical") and "no evaluations" not in text
  assert ("DreamGym GRPO, no online real" in text) == (case != "empty")


def test_data_efficiency_draws_a_method_without_online_transitions_as_a_level(tmp_path, monkeypatch):
  """DreamGym's evaluations all sit at 0 online real transitions: its last one is drawn at 0 and as a dashed line
  at that success, not as a line up the y axis through every evaluation."""
  from matplotlib.figure import Figure

  drawn = {}
  real_savefig = Figure.savefig

  def keep(fig, *args, **kw):
    drawn["ax"] = fig.axes[0]
    return real_savefig(fig, *args, **kw)

  monkeypatch.setattr(Figure, "savefig", keep)
  data_efficiency({"DreamGym GRPO": [{"real_transitions": 0, "success_rate": r, "ci_low": r - 0.1, "ci_high": r + 0.1}
                                     for r in (0.3, 0.55)]}, tmp_path / "d.svg")
  lines = drawn["ax"].get_lines()
  level = [ln for ln in lines if ln.get_linestyle() == "--"]
  assert len(level) == 1 and set(level[0].get_ydata()) == {0.55}
  points = [ln for ln in lines if ln.get_linestyle() != "--" and len(ln.get_xdata()) and ln.get_marker() == "o"]
  assert [list(ln.get_xdata()) for ln in points] == [[0]] and list(points[0].get_ydata()) == [0.55]


def test_fidelity_plot(tmp_path):
  one_step = {"full": {"exact_match": 0.8, "token_f1": 0.9, "parse_failure": math.nan},
              "copy baseline": {"exact_match": 0.3, "token_f1": 0.6, "parse_failure": 0.0}}
  open_loop = {"full": [0.9, 0.7, None], "copy baseline": [0.3, 0.1, 0.0]}
  keys = [("exact_match", "EM"), ("token_f1", "F1"), ("parse_failure", "parse fail")]
  text = _check(lambda p: fidelity_plot(one_step, open_loop, keys, p), tmp_path, "fidelity")
  for label in ("full", "copy baseline", "EM", "F1", "parse fail", "steps since the real first state"):
    assert label in text
