"""dreamjax.replay (see the modules; DESIGN.md describes the layout)."""
