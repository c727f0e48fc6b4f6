"""The benchmark harness: timing (``timing``), the peers compared (``peers``), the bytes-based sweep
(``sweep``), results files and tables (``results``), plots (``plots``), host time per call
(``overhead``), and the per-family benchmarks of the matmul-bound loss (``linear_ce``), the
optimizer step (``adamw``) and the CUDA C++ RMSNorm (``cuda_compare``).

Imports the kernels and the Hugging Face wing; the training and distributed wings import it (for
results files and timing), never the other way round."""
