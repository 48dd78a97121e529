"""phi encoders: the Flax MiniLM against sentence-transformers (torch), shape bucketing, loader errors, and the
backbone-pooled encoder against an unpadded per-text reference."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dreamjax.models import Transformer, init_params, tiny
from dreamjax.replay import minilm
from dreamjax.replay.encoder import (BackbonePooledEncoder, Encoder, MiniLMEncoder, buckets, make_encoder,
                                     transition_text)
from dreamjax.text import train_bpe_tokenizer

LONG = " ".join(f"You see a drawer {i}, a cabinet {i} and a countertop." for i in range(60))  # > 256 tokens
SENTENCES = [
    "You are in the kitchen.",
    "go to fridge 1",
    "",
    "x",
    "The Quick BROWN fox jumps over the lazy dog; it's 12:30 p.m. (UTC+2) -- OK?",
    "Ünïcödé àccents, 漢字 and emoji 🚀 mixed in one sentence.",
    "[3] button: Add to cart\n[7] link: Back to search\n[9] text: Price $12.99",
    "open the drawer " * 40,  # ~ 160 tokens: the 256 bucket without truncation
    LONG,
    transition_text("You are in a bedroom. On the desk 1, you see a laptop 1.", "take laptop 1 from desk 1"),
    "   leading and trailing spaces   ",
]


@pytest.fixture(scope="module")
def encoder():
  return MiniLMEncoder(batch_size=4)


def test_matches_sentence_transformers(encoder):
  from sentence_transformers import SentenceTransformer

  reference = SentenceTransformer(str(minilm.default_folder()), device="cpu")
  expected = reference.encode(SENTENCES, convert_to_numpy=True, batch_size=3)
  got = encoder.encode(SENTENCES)
  assert got.dtype == np.float32 and got.shape == (len(SENTENCES), 384)
  err = np.abs(got - expected).max()
  print(f"max abs error vs sentence-transformers: {err:.2e}")
  assert err <= 1e-5
  # Truncation to max_seq_length: the long text is cut to 256 tokens on both sides.
  assert reference.tokenize([LONG])["input_ids"].shape[1] == 256 == encoder.cfg.max_seq_length
  assert len(minilm.tokenize(encoder.tokenizer, encoder.cfg, [LONG])[0]) == 256


def test_rows_are_unit_norm_and_independent_of_batching(encoder):
  together = encoder.encode(SENTENCES)
  alone = np.concatenate([encoder.encode([s]) for s in SENTENCES[:5]])
  np.testing.assert_allclose(np.linalg.norm(together, axis=1), 1.0, atol=1e-6)
  np.testing.assert_allclose(alone, together[:5], atol=2e-6)
  assert encoder.encode([]).shape == (0, 384)
  assert isinstance(encoder, Encoder)


def test_bucketing_bounds_compilations(encoder):
  encoder.encode(["one", "two words", "three small words", "a b c d e"])  # batch 4, length 16
  before = encoder.compilations()
  encoder.encode(["other", "texts here", "same", "buckets!", "fifth", "sixth"])  # chunks of 4 and 2, both padded to 4
  encoder.encode(["again other texts", "of the same", "short length"])
  after = encoder.compilations()
  # Batch buckets are (4,) for batch_size 4 (MIN_BATCH caps at the batch size): no new program for short texts.
  assert buckets(4, 8) == (4,) and after == before
  grid = len(buckets(4, 8)) * len(buckets(256, 16))
  encoder.encode(SENTENCES)
  assert encoder.compilations() <= grid


def test_transition_text_puts_the_action_first():
  text = transition_text("  a long state  ", " open door ")
  assert text == "action: open door\nstate: a long state"


def _copy_folder(tmp_path):
  folder = tmp_path / "minilm"
  shutil.copytree(minilm.default_folder(), folder)
  return folder


def test_loader_names_the_bad_file_and_field(tmp_path):
  folder = _copy_folder(tmp_path)
  (folder / "config.json").write_text('{"model_type": "bert",\n "hidden_size": }')
  with pytest.raises(ValueError, match=r"config.json: invalid JSON at line 2"):
    minilm.load(folder)
  config = json.loads((minilm.default_folder() / "config.json").read_text())
  del config["num_hidden_layers"]
  (folder / "config.json").write_text(json.dumps(config))
  with pytest.raises(ValueError, match=r"config.json: missing field 'num_hidden_layers'"):
    minilm.load(folder)
  config["num_hidden_layers"] = 7  # more layers than the checkpoint holds
  (folder / "config.json").write_text(json.dumps(config))
  with pytest.raises(ValueError, match=r"model.safetensors: tensor 'encoder.layer.6.attention.self.query.weight'"):
    minilm.load(folder)
  config["num_hidden_layers"] = 6
  (folder / "config.json").write_text(json.dumps(config))
  (folder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_cls_token": True}))
  with pytest.raises(ValueError, match=r"pooling mode 'cls_token' is not implemented"):
    minilm.load(folder)
  with pytest.raises(FileNotFoundError, match="does not exist"):
    minilm.load(tmp_path / "nowhere")


def test_make_encoder_rejects_unknown_names():
  with pytest.raises(ValueError, match="unknown encoder 'bert'"):
    make_encoder("bert")


@pytest.fixture(scope="module")
def backbone(tmp_path_factory):
  texts = [transition_text(f"room {i} has a key {i % 3}", f"take key {i % 3}") for i in range(50)]
  tok = train_bpe_tokenizer(texts, tmp_path_factory.mktemp("tok"), vocab_size=300)
  cfg = tiny("qwen2", vocab_size=tok.vocab_size)
  params = init_params(cfg, jax.random.key(0))
  return cfg, params, tok


def test_return_hidden_is_additive(backbone):
  cfg, params, _ = backbone
  tokens = jnp.arange(12).reshape(2, 6) % cfg.vocab_size
  positions = jnp.broadcast_to(jnp.arange(6), (2, 6))
  valid = jnp.ones((2, 6), bool)
  apply = jax.jit(Transformer(cfg).apply, static_argnames="return_hidden")
  plain = apply({"params": params}, tokens, positions, valid)
  with_hidden = apply({"params": params}, tokens, positions, valid, return_hidden=True)
  assert plain.hidden is None
  np.testing.assert_array_equal(np.asarray(plain.logits), np.asarray(with_hidden.logits))
  # The hidden states are what the LM head reads: projecting them reproduces the logits.
  head = params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]
  np.testing.assert_allclose(np.asarray(with_hidden.hidden @ head), np.asarray(plain.logits), atol=1e-5)


def test_backbone_encoder_matches_unpadded_reference(backbone):
  cfg, params, tok = backbone
  enc = make_encoder("backbone", cfg=cfg, params=params, tokenizer=tok, batch_size=4, max_len=32)
  assert isinstance(enc, BackbonePooledEncoder) and enc.dim == cfg.hidden_size
  texts = ["take key 1", "room 3 has a key 0 and a much longer description " * 3, "a", "go north", "open door"]
  got = enc.encode(texts)
  apply = jax.jit(Transformer(cfg).apply, static_argnames="return_hidden")
  for text, row in zip(texts[:3], got):  # unpadded, one text at a time; the longest is truncated to max_len
    ids = ([tok.bos_id] if tok.bos_id is not None else []) + tok.encode(text)
    ids = np.asarray(ids[:32])[None]
    hidden = apply({"params": params}, ids, np.arange(ids.shape[1])[None], np.ones(ids.shape, bool),
                   return_hidden=True).hidden
    mean = np.asarray(hidden, np.float64)[0].mean(0)
    np.testing.assert_allclose(row, mean / np.linalg.norm(mean), atol=1e-5)
