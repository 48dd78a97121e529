"""dreamjax.curriculum (see the modules; DESIGN.md describes the layout)."""
