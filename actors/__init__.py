"""Ray actors: env groups (with their memory), the controller, the training job's worker loop."""
