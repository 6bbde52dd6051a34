"""Tiny models, specs and synthetic rollouts for brigade's tests and benchmarks. Dev-only: no
service imports it and no image installs it."""
