"""Learning: every loss, sequence log-probs, the MADPO step, the joint reward model, RL and critics."""
