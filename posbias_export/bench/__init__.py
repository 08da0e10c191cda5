"""Speed and memory, measured side by side in one run: attention at long lengths (each
configuration in its own process, worker.py), decode latency, and ORT's profile."""
