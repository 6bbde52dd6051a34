"""Tiny models, specs and synthetic rollouts for brigade's tests and benchmarks, the hosts that
drive the learner and rollout services on a simulated device (slow_learner, slow_worker), a
fault-injecting S3 proxy (faulty_s3) and the audited local system both drive (audited_system).
Dev-only: no service imports it and no image installs it."""
