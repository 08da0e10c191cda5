"""The measurements behind design choices, each run by hand with `python -m` and written to
benchmarks/ (docs name the result, this folder the script that made it)."""
