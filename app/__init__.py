"""Ray Serve applications: the policy deployment, the training application, the agent endpoint, the config schema.

Kept import-light: `raygent play` and `raygent envs` must not pay for importing Ray.
"""
