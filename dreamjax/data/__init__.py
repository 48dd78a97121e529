"""Offline trajectories: records and their JSONL files, the TFDS dataset, and the collector.

Nothing is imported here: the TFDS module pulls in tensorflow_datasets (seconds), which readers of JSONL records
and env workers should not pay for. Import the submodules directly.
"""
