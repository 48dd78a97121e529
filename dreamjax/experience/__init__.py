"""dreamjax.experience (see the modules; DESIGN.md describes the layout)."""
