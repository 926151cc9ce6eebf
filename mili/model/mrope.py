"""M-RoPE (Qwen3-VL, Qwen3.5): three position ids per token (time, height, width) and the rotary frequencies each
one drives, as transformers' ``get_rope_index`` and ``Qwen3VLTextRotaryEmbedding`` compute them.

Text tokens carry one position on all three axes, counting on from the previous token, so a text-only prompt's
M-RoPE is plain RoPE (MILI then passes [T] positions and pays nothing). An image's tokens (its merged h×w grid)
all start where the text stopped: time stays there, height and width count the token's row and column from it;
the text after the image continues from the image's start plus max(rows, columns). A prompt's positions thus end
below its length; every later token (decode) sits at its index plus ``delta`` = (largest position + 1) - length
on all three axes.

Frequencies are interleaved (Qwen3-VL's ``mrope_interleaved``): frequency j takes the height position when
j % 3 == 1 and j < 3·sections[1], the width position when j % 3 == 2 and j < 3·sections[2], else time.
"""

from __future__ import annotations

import torch

from mili.errors import ModelLoadError


def rope_index(input_ids: list[int], grid_thw: list[tuple[int, int, int]], image_token_id: int,
               spatial_merge: int) -> tuple[torch.Tensor, int]:
    """(positions [3, T] int64, delta) for a prompt whose image tokens are runs of t·h·w / merge²
    ``image_token_id`` ids, one run per ``grid_thw`` entry (the patch grid of each image, in order)."""
    positions = torch.empty(3, len(input_ids), dtype=torch.long)
    grids = iter(grid_thw)
    i = current = 0
    while i < len(input_ids):
        if input_ids[i] != image_token_id:
            start = i
            while i < len(input_ids) and input_ids[i] != image_token_id:
                i += 1
            positions[:, start:i] = torch.arange(current, current + i - start)
            current += i - start
            continue
        grid = next(grids, None)
        if grid is None:
            raise ValueError("more image tokens in the prompt than images")
        t, h, w = grid[0], grid[1] // spatial_merge, grid[2] // spatial_merge
        n = t * h * w
        if input_ids[i:i + n] != [image_token_id] * n:
            raise ValueError(f"image tokens at {i}: fewer in a row than the image's {n} ({t}×{h}×{w})")
        grid_t, grid_h, grid_w = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
        positions[:, i:i + n] = torch.stack([grid_t, grid_h, grid_w]).reshape(3, -1) + current
        current += max(h, w)
        i += n
    if next(grids, None) is not None:
        raise ValueError("more images than image-token runs in the prompt")
    delta = (int(positions.max()) + 1 - len(input_ids)) if input_ids else 0
    return positions, delta


def decode_positions(start: int, count: int, delta: int) -> torch.Tensor:
    """[3, count] positions of tokens ``start`` .. ``start + count - 1`` past an M-RoPE prompt."""
    return (torch.arange(start, start + count) + delta).expand(3, count)


def mrope_axes(rope_params: dict, num_freqs: int) -> torch.Tensor | None:
    """Which position axis (0 time, 1 height, 2 width) drives each of the ``num_freqs`` frequencies, or None
    when the config has no ``mrope_section`` (plain RoPE)."""
    sections = rope_params.get("mrope_section")
    if not sections:
        return None
    if rope_params.get("mrope_interleaved", True) is not True:
        raise ModelLoadError("config.json sets mrope_interleaved false (Qwen2-VL's sectioned M-RoPE): MILI computes "
                             "Qwen3-VL's interleaved layout only")
    if len(sections) != 3:
        raise ModelLoadError(f"config.json mrope_section {sections} must be three sizes (time, height, width)")
    # (as transformers: sections are not checked against num_freqs; the time axis takes what the others leave)
    j = torch.arange(num_freqs)
    axes = torch.zeros(num_freqs, dtype=torch.long)
    axes[(j % 3 == 1) & (j < 3 * sections[1])] = 1
    axes[(j % 3 == 2) & (j < 3 * sections[2])] = 2
    return axes
