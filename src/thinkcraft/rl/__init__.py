"""RL maths. JAX: Categorical, networks, GAE, PPO loss and update. torch: LLM-policy losses (llm_losses)."""
