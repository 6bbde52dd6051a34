"""The `brigade` command and what runs on one machine: `brigade up` (on brigade_harness's local
system), `ctl` (a gRPC client for run inspection), `cost` and plots; other distributions add
commands through the `brigade.commands` entry points (`brigade bench`). No library or service
imports this package."""
