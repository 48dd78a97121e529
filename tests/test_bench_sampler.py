"""Smoke test of the sampler benchmark script: it runs end to end on a tiny model and writes both contenders' numbers,
and the speculative table."""

import json

from experiments.bench import sampler as bench


def test_bench_sampler_small(tmp_path):
  out = tmp_path / "out"
  # --threads 0: the test must not pin the pytest process's CPU affinity; --no-prefill saves one compilation.
  bench.main(["--small", "--runs", "1", "--batches", "2", "--threads", "0", "--no-prefill", "--draft-tokens", "3",
              "--model-dir", str(tmp_path / "model"), "--out", str(out)])
  result = json.loads((out / "results.json").read_text())
  assert {r["case"] for r in result["rows"]} == {"greedy, batch 2", "top_p, batch 2"}
  for row in result["rows"]:
    assert row["dreamjax_tok_s"] > 0 and row["transformers_tok_s"] > 0 and row["ratio"] > 0
  assert result["rows"][0]["greedy_token_agreement"] > 0.5  # same weights: greedy paths should (mostly) agree
  assert "| greedy, batch 2 |" in (out / "table.md").read_text()
  spec = result["speculative"]
  assert spec["config"]["draft_tokens"] == 3
  assert [r["case"] for r in spec["rows"]] == [f"{m}, batch 2, {k} prompt" for m in ("greedy", "top_p")
                                               for k in ("repetitive", "random")]
  for row in spec["rows"]:
    assert row["plain_tok_s"] > 0 and row["speculative_tok_s"] > 0 and 1 <= row["tokens_per_forward"] <= 4
    assert row.get("greedy_tokens_identical", True)  # speculation never changes a greedy token
  assert "| greedy, batch 2, repetitive prompt |" in (out / "table.md").read_text()
