"""The DFlash engine: drafter, target adapter, verify rules and the speculative loop."""
