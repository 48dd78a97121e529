"""Renamed copies of training episodes (dreamjax.experience.rename) on real twc episodes: one mapping over every text
of an episode, receptacles and longer names kept whole, lists sorted again, and the copies' examples in the SFT data
with no neighbour from their own episode."""

from pathlib import Path

import numpy as np
import pytest

from dreamjax.data.collect import CollectConfig, collect
from dreamjax.data.records import StepRecord, TrajectoryRecord, read_trajectories
from dreamjax.envs.base import Task
from dreamjax.experience.annotate import Annotation
from dreamjax.experience.format import ExpFormatConfig
from dreamjax.experience.rename import NamePool, episode_names, names_pattern, rename_text, renamed, renamed_copies
from dreamjax.experience.sft_data import ExampleBuilder, annotations_for, build_sft_data, corpus
from dreamjax.loop.model import ModelSource, build_tiny_checkpoint, load_model
from dreamjax.models import tiny
from dreamjax.replay.encoder import BackbonePooledEncoder
from dreamjax.replay.retriever import Retriever

TWC = "numLocations=1,numItemsToPutAway=2,includeDoors=0"


@pytest.fixture(scope="module")
def twc_records(tmp_path_factory) -> list[TrajectoryRecord]:
  """Real one-room twc episodes: the expert and random play on 24 games (a few seconds)."""
  pytest.importorskip("textworld_express")
  out = tmp_path_factory.mktemp("twc")
  collect(CollectConfig(env_kwargs=("step_limit=8",), games=("twc",), game_params=TWC,
                        policies=("expert:24", "random:12"), num_workers=0, rows_per_worker=8, out_dir=str(out),
                        progress=False, build_tfds=False))
  return read_trajectories(out / "trajectories.jsonl")


def _texts(r: TrajectoryRecord, a: Annotation) -> list[str]:
  return [r.instruction, a.tutorial, *a.reasons, *(x for s in r.steps for x in (s.state, s.action, s.next_state))]


def test_one_mapping_renames_every_text_of_the_episode(twc_records):
  notes = annotations_for(twc_records)
  pool = NamePool.of(twc_records)
  rng = np.random.default_rng(0)
  for r in twc_records:
    items, receptacles = episode_names(r)
    assert items and not items & receptacles
    copy, note, mapping = renamed(r, notes[r.episode_id], pool, rng)
    assert (copy.episode_id, copy.task, copy.num_steps) == (r.episode_id, r.task, r.num_steps)
    new = set(mapping.values())
    assert set(mapping) == items and len(new) == len(items) and not new & pool.taken  # no real item's name
    assert all(len(b.split()) == len(a.split()) for a, b in mapping.items())
    assert episode_names(copy) == (new, receptacles)  # the receptacles kept their names
    # Mapping the new names back gives every text again: nothing else changed.
    undo = {b: a for a, b in mapping.items()}
    pattern = names_pattern(new | receptacles)
    assert [rename_text(t, undo, pattern) for t in _texts(copy, note)] == _texts(r, notes[r.episode_id])
    for s, c in zip(r.steps, copy.steps):
      assert (c.reward, c.done, c.success, c.invalid, c.source) == (s.reward, s.done, s.success, s.invalid, s.source)
      assert list(c.admissible) == sorted(c.admissible)  # twc's lists are sorted, so the copy's are too
      assert sorted(rename_text(x, undo, pattern) for x in c.admissible) == sorted(s.admissible)


def _step(state: str, action: str, next_state: str, admissible: tuple[str, ...]) -> StepRecord:
  return StepRecord(state, action, next_state, 0.0, False, False, False, admissible, "expert")


def test_longer_names_and_receptacles_are_kept_whole():
  # "toilet" is a receptacle inside the item "toilet paper"; the item "wastepaper" is inside the receptacle
  # "wastepaper basket".
  s0 = "You see: toilet, wastepaper basket (closed), toilet paper, wastepaper"
  s1 = "You see: toilet, wastepaper basket (closed), wastepaper\nInventory: toilet paper"
  adm = ("open wastepaper basket", "take toilet paper", "take wastepaper")
  r = TrajectoryRecord("e0", "textworld_express", Task.make("textworld_express", "t0"), "Tidy up.", "expert", 0,
                       (_step(s0, "take toilet paper", s1, adm),
                        _step(s1, "put toilet paper in toilet", s0, ("put toilet paper in toilet", "take wastepaper"))),
                       False, 2, None)
  note = Annotation("e0", "", ("Take the toilet paper off the floor.", "Put the toilet paper in the toilet."))
  assert episode_names(r) == ({"toilet paper", "wastepaper"}, {"toilet", "wastepaper basket"})
  pool = NamePool(heads=("cup", "shoe"), modifiers=("red", "blue"), taken=frozenset({"toilet paper", "wastepaper"}))
  copy, new_note, _ = renamed(r, note, pool, np.random.default_rng(3))
  items, receptacles = episode_names(copy)
  assert receptacles == {"toilet", "wastepaper basket"} and len(items) == 2
  paper = next(i for i in items if len(i.split()) == 2)  # two words, like "toilet paper"
  (waste,) = items - {paper}
  assert copy.steps[0].state == f"You see: toilet, wastepaper basket (closed), {paper}, {waste}"
  assert copy.steps[1].action == f"put {paper} in toilet"
  assert copy.steps[0].admissible == tuple(sorted(("open wastepaper basket", f"take {paper}", f"take {waste}")))
  assert new_note.reasons == (f"Take the {paper} off the floor.", f"Put the {paper} in the toilet.")
  # The same seed draws the same names; a pool that cannot name the items apart is refused.
  assert renamed(r, note, pool, np.random.default_rng(3))[:2] == (copy, new_note)
  with pytest.raises(ValueError, match="no new name for"):
    renamed(r, note, NamePool(heads=("cup",), modifiers=(), taken=frozenset()), np.random.default_rng(0))


def test_sft_data_adds_the_copies_with_no_neighbour_from_their_own_episode(twc_records, tmp_path: Path):
  fmt = ExpFormatConfig(k=1, max_history=1, state_changes=True, list_edits=True, action_edits=True,
                        instructions=False)
  source = ModelSource(tiny=tiny("qwen2", vocab_size=512, max_position_embeddings=2048))
  build_tiny_checkpoint(source, corpus(twc_records, annotations_for(twc_records), fmt), tmp_path, seed=0)
  _, _, tok = load_model(tmp_path)
  builder = ExampleBuilder(tok, fmt, 2048)
  plain = build_sft_data(twc_records, builder, None, held_out_fraction=0.25, seed=0)
  retriever = Retriever(BackbonePooledEncoder.from_folder(tmp_path))
  data = build_sft_data(twc_records, builder, retriever, held_out_fraction=0.25, seed=0, renamed_copies=2)
  n = len(plain.train)
  assert len(data.train) == 3 * n and data.stats["train_renamed_copies"] == 2
  assert [e.transition for e in data.held_out] == [e.transition for e in plain.held_out]  # held out: real names
  originals, first, second = data.train[:n], data.train[n:2 * n], data.train[2 * n:]
  for a, b, c in zip(originals, first, second):
    assert a.transition.episode_id == b.transition.episode_id == c.transition.episode_id
    if a.transition.action.startswith(("take ", "put ")):
      assert len({a.transition.action, b.transition.action, c.transition.action}) == 3  # drawn anew per copy
    for ex in (b, c):
      assert all(d.episode_id != ex.transition.episode_id for d in ex.retrieved)  # never the real-name original
  # The coin game names one item, "coin": nothing to draw a new name from.
  coin = [TrajectoryRecord("c", "textworld_express", Task.make("textworld_express", "c"), "", "expert", 0,
                           (_step("You see a coin.", "take coin", "You take the coin.", ("take coin",)),), True, 1,
                           None)]
  with pytest.raises(ValueError, match="no new name"):
    renamed_copies(coin, annotations_for(coin), 1, seed=0)
