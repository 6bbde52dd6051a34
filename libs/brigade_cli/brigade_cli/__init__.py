"""The `brigade` command and what runs on one machine: `brigade up`, `ctl` (a gRPC client for run
inspection), `cost`, local dev servers and plots. Services never import this package."""
