"""What our files are measured beside, run as their users run them: transformers eager
(eager_runs), llama.cpp (llama_cpp_runs), the plain dynamo and Optimum exports (baselines), and
our own files run and timed the same way (ort_runs). The benches and their tests use it; the
import of a model folder (hf/) does not."""
