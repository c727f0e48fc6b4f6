"""Chapter 14: the saved-tensor hooks that move a checkpoint to pinned host memory on a side stream
and back."""

import torch


def offload_hooks():
    def pack(tensor, side):
        # Queue the copy on the side stream, after the kernels that wrote the tensor; the forward
        # goes on at once.
        host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu",
                           pin_memory=torch.cuda.is_available())
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            host.copy_(tensor, non_blocking=True)
        tensor.record_stream(side)  # its memory is not handed out again before the side stream has read it
        return tensor.device, host

    def unpack(packed, side):
        device, host = packed
        # Allocated on the compute stream, which uses it; the side stream waits for what the compute
        # stream queued before (the new block may still be read by earlier kernels), copies, and
        # records an event after the copy.
        tensor = torch.empty(host.shape, dtype=host.dtype, device=device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            tensor.copy_(host, non_blocking=True)
            copied = side.record_event()
        tensor.record_stream(side)
        # the compute stream waits for this copy, not the whole GPU
        torch.cuda.current_stream().wait_event(copied)
        return tensor

    return pack, unpack
