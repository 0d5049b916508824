"""Agents written the way their users write them, trained by raygent through its gateway (docs/gateway.md)."""
