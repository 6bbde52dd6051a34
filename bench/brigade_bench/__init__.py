"""brigade's benchmarks: `brigade bench NAME` (brigade_bench.cli, mounted by `brigade` through the
`brigade.commands` entry point) runs `brigade_bench.<name>.run(quick)`. They drive the real services
through the local harness (brigade_harness.system); the report and plots live in bench/."""
