"""tools/accelerator_check.py on CPU at tiny sizes: every section but DreamGym runs (parity on one quick test) and
lands in one report; a failing section is reported and the others still run; the decode roofline's byte count."""

import json

import jax
import numpy as np

from dreamjax.models import init_params
from tools import accelerator_check as check

QUICK_TEST = "tests/test_sampler.py::test_left_pad_aligns_prompts_right_and_gives_missing_rows_a_dummy"


def test_decode_bytes_count_weights_once_and_each_rows_cache():
  cfg = check.arch_config("tiny", "bfloat16", "bfloat16")  # untied: the embedding table is gathered, not read
  params = init_params(cfg, jax.random.key(0))
  weights, kv = check.decode_bytes(cfg, params, batch=3, context=10.0)
  total = sum(x.size * 2 for x in jax.tree.leaves(params))
  assert weights == total - cfg.vocab_size * cfg.hidden_size * 2
  assert kv == 3 * 10.0 * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 2
  tied = cfg.replace(tie_word_embeddings=True)
  tied_params = init_params(tied, jax.random.key(0))
  assert check.decode_bytes(tied, tied_params, 1, 1.0)[0] == sum(x.size * 2 for x in jax.tree.leaves(tied_params))


def test_small_check_writes_one_report(tmp_path):
  out = tmp_path / "check"
  report = check.main(["--small", "--sections", "device,parity,ceilings,decode,grpo", "--parity-tests", QUICK_TEST,
                       "--decode-batches", "2", "--out", str(out)])
  assert report["errors"] == {}
  assert report["device"]["platform"] == "cpu" and report["device"]["count"] >= 1
  parity = report["parity"]
  assert (parity["passed"], parity["failed"], parity["returncode"]) == (1, 0, 0), parity
  ceilings = report["ceilings"]
  assert ceilings["bandwidth_bytes_s"] > 0 and ceilings["bf16_matmul_flop_s"] > 0
  (row,) = report["decode"]["rows"]
  assert row["arch"] == "tiny" and row["batch"] == 2 and row["decode_tok_s"] > 0
  assert np.isclose(row["roofline_tok_s"], 2 * ceilings["bandwidth_bytes_s"] / (row["weight_bytes"] + row["kv_bytes"]))
  grpo = report["grpo"]
  assert grpo["median"]["update_s"] > 0 and grpo["update_flops"] > 0 and 0 < grpo["mfu_measured_pct"]
  assert grpo["compilations"] == {"sampler": 1, "step": 1}  # the timed iterations compiled nothing new
  assert json.loads((out / "report.json").read_text())["grpo"]["update_flops"] == grpo["update_flops"]
  md = (out / "report.md").read_text()
  for heading in ("## Numerics tests", "## Ceilings", "## bf16 greedy decode", "## bf16 GRPO iteration"):
    assert heading in md


def test_a_failing_section_is_reported_and_the_rest_still_run(tmp_path):
  report = check.main(["--small", "--sections", "device,grpo,ceilings", "--grpo-arch", "no-such-model",
                       "--out", str(tmp_path)])
  assert "no-such-model" in report["errors"]["grpo"]
  assert "grpo" not in report and report["ceilings"]["bf16_matmul_flop_s"] > 0
  assert "## Sections that failed" in (tmp_path / "report.md").read_text()
