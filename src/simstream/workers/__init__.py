"""Process supervision and the error channel, shared by the data engine and the RL runner."""
