"""Hugging Face integration: ``patch_llama`` puts the kernels into a transformers Llama; the
attention and padding masks it can drop or fold; TRL's trainers kept on the model's own loss.

Imports the kernels below it (``kernels.*``) and transformers; nothing from the benchmark, training
or distributed wings."""
