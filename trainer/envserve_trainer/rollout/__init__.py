"""Stage 5, rollout: playing episodes through envserve (trajectories, prompts, the rollout engine, forked
branches, the perception warm-up). May import: policies, models, methods, config, and envserve.client."""
