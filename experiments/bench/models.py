"""The benchmark models' shapes (HF Qwen2 config fields), shared by the benchmarks and tools/accelerator_check.py: the
standard model of the benchmarks (a Qwen2 with hidden 512 and 8 layers) and a small one for smoke runs."""

STANDARD = dict(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
                num_key_value_heads=2)
SMALL = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)
# What the benchmarks' HF folders also set (experiments/bench/sampler.py `ensure_model`).
COMMON = dict(model_type="qwen2", max_position_embeddings=2048, tie_word_embeddings=False)
