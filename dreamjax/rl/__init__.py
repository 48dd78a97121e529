"""dreamjax.rl (see the modules; DESIGN.md describes the layout)."""
