"""Chapter 14: the tile loop of a tiled MLP forward."""

import torch


def tiled_forward(x: torch.Tensor, mlp_tile, tile_rows: int) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])            # [tokens, hidden]: the batch and the sequence are all rows
    out = torch.empty_like(rows)                  # x's dtype and device
    n = rows.shape[0]
    # consecutive tiles, each starting where the last one stopped
    for start in range(0, n, tile_rows):
        stop = min(start + tile_rows, n)          # the last tile may be partial
        out[start:stop] = mlp_tile(rows[start:stop])
    return out.view(x.shape)
