"""Training: Llama presets with random weights (``models``), generated SFT batches (``data``), the
fine-tuning loop (``loop``) and its command line (``finetune``), the longest sequence that fits
(``fit``), the tensors alive at a step's peak (``peak_memory``) and the profiled step
(``profiling``).

Imports the kernels, the Hugging Face wing and the benchmark wing; only the distributed wing imports
it."""
