"""More than one GPU: FSDP2 sharding and the process group (``fsdp``), the loop across ranks
(``parallel``), the ``torchrun`` entry point (``finetune``) and 1 GPU against N (``scaling``).

The top wing: imports the training loop, the patch and the kernels; nothing imports it."""
