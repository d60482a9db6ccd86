"""Stage 6, samples: turning played trials into training samples with their rewards and advantages.
May import: rollout, methods, config."""
