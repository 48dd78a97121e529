"""dreamjax.train (see the modules; DESIGN.md describes the layout)."""
