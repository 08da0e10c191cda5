"""What one GPU lease measures (tools/gpu_lease.sh runs each module with `python -m`; each
module's `write` makes its benchmarks/gpu_*.md here, after the lease)."""
