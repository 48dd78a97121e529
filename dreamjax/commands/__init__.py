"""One thin module per CLI command (`dreamjax <command> --config ...`): its config and its `run`, over `dreamjax.loop`
and the libraries. No command imports another, except `reproduce`, which runs them all."""
