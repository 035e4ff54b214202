"""The generator: jobs, the step loop, sampling and stop handling (ENGINE_SPEC §7)."""
