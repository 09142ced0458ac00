"""Environments. Craftax: craftax.py (the batched env with logging and exact optimistic resets, the
env-name table, the state unwrapper), unroll.py (craftax's inner loops traced unrolled), scan.py (the one
scan of env steps the tools share); text/ (semantic extraction, renderers, action parsing); textenvs/
(multi-turn text envs for LLM policies: the protocol, Craftax as text, verifiable tasks and rewards)."""
