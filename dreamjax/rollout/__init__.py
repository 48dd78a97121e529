"""Multi-turn rollouts against any batched env, real or synthetic: the agent's prompt and answer format (`agent`),
the batched engine that alternates policy sampling and env steps (`engine`), and the token-in/token-out turn rows it
returns (`trajectory`). Nothing is re-exported: import the modules."""
