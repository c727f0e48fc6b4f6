"""Chapters 04 and 07: the time a number of bytes takes at a copy bandwidth, in microseconds."""


def floor_us(n_bytes, gbps):
    """The floor, in µs, of a kernel that moves ``n_bytes`` (reads + writes) at a copy bandwidth of
    ``gbps`` GB/s."""
    # GB/s is 1e9 bytes per second (not GiB, 2**30), and the copy bandwidth already counts reads
    # plus writes, as the byte count does: seconds = n_bytes / (gbps * 1e9), and a second is 1e6 µs.
    return n_bytes / (gbps * 1e9) * 1e6
