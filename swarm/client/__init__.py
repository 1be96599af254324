"""The trainer side: push micro-batches through the swarm and account for every sample."""
