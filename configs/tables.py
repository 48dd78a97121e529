"""`dreamjax tables`: the paper's Table 1 and Table 2 layouts from several `dreamjax reproduce` runs (one per
environment and backbone), as table1.md, table2.md and tables.json.

Run:   dreamjax tables --config configs/tables.py                (the full-size runs of configs/reproduce_*.py)
       dreamjax tables --config configs/tables.py --set results=runs/reproduce/twx,runs/reproduce/qwen_twx
Tiny:  dreamjax tables --config configs/tables.py:tiny           (the :tiny runs)
"""

from dreamjax.commands.tables import TablesConfig

ENVS = ("twx", "alfworld", "miniwob")


def config() -> TablesConfig:
  return TablesConfig(results=tuple(f"runs/reproduce/{e}" for e in ENVS), out_dir="runs/tables")


def tiny() -> TablesConfig:
  return TablesConfig(results=tuple(f"runs/reproduce/{e}_tiny" for e in ENVS), out_dir="runs/tables_tiny")
