"""`dreamjax tables`: the paper's Table 1 and Table 2 layouts from several `dreamjax reproduce` runs.

  dreamjax tables --config configs/tables.py --set results=runs/reproduce/twx,runs/reproduce/alfworld
"""

from dreamjax.commands.tables import TablesConfig


def config() -> TablesConfig:
  return TablesConfig(results=("runs/reproduce/twx",), out_dir="runs/tables")
