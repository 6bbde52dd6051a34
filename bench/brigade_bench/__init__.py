"""brigade's benchmarks: `brigade bench NAME` runs `brigade_bench.<name>.run(quick)`. They drive the
real services through the local system (brigade_cli.system); the report and plots live in bench/."""
