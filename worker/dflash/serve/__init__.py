"""The worker service. `protocol` and `client` are stdlib-only (PL/Python imports them);
`server` owns the models."""
