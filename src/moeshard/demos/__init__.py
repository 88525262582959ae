"""Applications that use the engine as a user would: the colocated RL demo."""
