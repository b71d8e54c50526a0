"""From responses to preferences: the oracle, pair construction and the replay buffer's selection."""
