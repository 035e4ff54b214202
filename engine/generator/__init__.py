"""The generator: jobs, the step loop, admission, sampling, beam search and stop
handling (docs/ENGINE.md §7)."""
