"""Stage 7, update: the learner's gradient step, data-parallel plumbing, the DPO-family losses over the
policy and the step reward model's training. May import: samples, rollout, policies, models, methods, config."""
