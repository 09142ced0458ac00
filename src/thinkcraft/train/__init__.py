"""Training loops: thin, timed outer loops around jitted kernels from rl/ (ppo, ppo_hidden, llm_policy)."""
