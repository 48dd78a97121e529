"""The RL math and update: advantages (`advantages`), losses (`losses`), objectives chosen by name (`objectives`),
token batches (`batch`), log-prob scoring (`logprobs`), optimisers (`optim`), train state (`train_state`), the jitted,
sharded, donated update step (`update`) and per-phase PRNG keys (`keys`). Nothing is re-exported: import the
modules."""
