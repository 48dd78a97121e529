"""dreamjax.rollout (see the modules; DESIGN.md describes the layout)."""
