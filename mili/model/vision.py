"""The Qwen3-VL vision tower (also Qwen3.5 / 3.6's, which is the same tower without DeepStack), as transformers
computes it, under the hub's ``model.visual.*`` names.

Input: the image processor's ``pixel_values`` [P, C·Tp·p·p] (one row per patch, each image's patches already in
merge-block order: the m×m patches that merge into one token are consecutive) and ``grid_thw`` [N, 3] (each
image's patch grid). The tower embeds each patch (a Conv3d whose stride is its kernel: one matrix product over the
flattened patch, so it is a linear layer here, its weight the conv's flattened), adds a learned position table
bilinearly resampled to the image's grid, runs ViT blocks (pre-LayerNorm, full attention within each image, 2-D
rotary positions: half of each head rotated by the patch's row, half by its column) and merges each m×m block of
patches into one token for the language model (``merger``). Qwen3-VL also takes the hidden states after the blocks
listed in ``deepstack_visual_indexes``, merges them alike (``deepstack_merger_list``: LayerNorm after the merge),
and the language model adds them to its hidden states at the image tokens after its first layers.

The linears are plain ``nn.Linear``: MILI's ``swap_linears`` puts them on the same kernels as the text model's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mili.kernels.reference import rotate_half
from mili.model.batch import ImageRows


@dataclass
class VisionOutput:
    """The tower's output for N images: ``embeds`` [Σ tokens, out_hidden] (the images' tokens in order,
    ``tokens_per_image`` each) and one such tensor per DeepStack layer (none for Qwen3.5)."""

    embeds: torch.Tensor
    deepstack: list[torch.Tensor]
    tokens_per_image: list[int]


class VisionMLP(nn.Module):
    def __init__(self, hidden: int, inter: int, dtype: torch.dtype):
        super().__init__()
        self.linear_fc1 = nn.Linear(hidden, inter, dtype=dtype)
        self.linear_fc2 = nn.Linear(inter, hidden, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate="tanh"))  # gelu_pytorch_tanh


class VisionAttention(nn.Module):
    def __init__(self, hidden: int, num_heads: int, dtype: torch.dtype):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, hidden // num_heads
        self.qkv = nn.Linear(hidden, 3 * hidden, dtype=dtype)
        self.proj = nn.Linear(hidden, hidden, dtype=dtype)

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                seq_lens: list[int]) -> torch.Tensor:
        """Full (non-causal) attention within each image's patches: ``seq_lens`` per image (frame), in order."""
        s = x.shape[0]
        q, k, v = self.qkv(x).view(s, 3, self.num_heads, self.head_dim).unbind(1)
        cos, sin = (t[:, None, :] for t in cos_sin)  # (float32: the rotation is computed in float32, as HF)
        q = (q.float() * cos + rotate_half(q.float()) * sin).to(x.dtype)
        k = (k.float() * cos + rotate_half(k.float()) * sin).to(x.dtype)
        out = torch.empty_like(q)
        start = 0
        for n in seq_lens:  # ([1, heads, n, d]: torch's flash kernels take 4-D only; 3-D falls back to the math
            part = slice(start, start + n)  # path, the whole n×n matrix, 6× slower on the CPU at 784 patches)
            q_, k_, v_ = (t[part].transpose(0, 1)[None] for t in (q, k, v))
            out[part] = F.scaled_dot_product_attention(q_, k_, v_)[0].transpose(0, 1)
            start += n
        return self.proj(out.reshape(s, -1))


class VisionBlock(nn.Module):
    def __init__(self, cfg, dtype: torch.dtype):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=1e-6, dtype=dtype)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=1e-6, dtype=dtype)
        self.attn = VisionAttention(cfg.hidden_size, cfg.num_heads, dtype)
        self.mlp = VisionMLP(cfg.hidden_size, cfg.intermediate_size, dtype)

    def forward(self, x, cos_sin, seq_lens):
        x = x + self.attn(self.norm1(x), cos_sin, seq_lens)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """m×m neighbouring patches -> one token of the language model's width. The final merger normalises each patch
    before the merge; DeepStack's (``postshuffle_norm``) the merged vector."""

    def __init__(self, cfg, dtype: torch.dtype, postshuffle_norm: bool = False):
        super().__init__()
        self.merged = cfg.hidden_size * cfg.spatial_merge_size ** 2
        self.postshuffle_norm = postshuffle_norm
        self.norm = nn.LayerNorm(self.merged if postshuffle_norm else cfg.hidden_size, eps=1e-6, dtype=dtype)
        self.linear_fc1 = nn.Linear(self.merged, self.merged, dtype=dtype)
        self.linear_fc2 = nn.Linear(self.merged, cfg.out_hidden_size, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.merged)) if self.postshuffle_norm else self.norm(x).view(-1, self.merged)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class PatchEmbed(nn.Module):
    def __init__(self, cfg, dtype: torch.dtype):
        super().__init__()
        patch = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size ** 2
        self.proj = nn.Linear(patch, cfg.hidden_size, dtype=dtype)  # the checkpoint's Conv3d, flattened on load
        self.dtype = dtype  # (kept: a kernel linear swapped in has no ``weight``)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.proj(pixels.to(self.dtype))


class VisionTower(nn.Module):
    """``model.visual``: Qwen3VLVisionModel (and Qwen3_5VisionModel: no ``deepstack_visual_indexes``)."""

    def __init__(self, cfg, dtype: torch.dtype):
        super().__init__()
        self.merge = cfg.spatial_merge_size
        self.patch_embed = PatchEmbed(cfg, dtype)
        self.pos_embed = nn.Embedding.from_pretrained(torch.empty(cfg.num_position_embeddings, cfg.hidden_size,
                                                                  dtype=dtype))
        self.grid_side = int(cfg.num_position_embeddings ** 0.5)
        self.blocks = nn.ModuleList(VisionBlock(cfg, dtype) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg, dtype)
        self.deepstack_indexes = list(getattr(cfg, "deepstack_visual_indexes", None) or [])
        self.deepstack_merger_list = nn.ModuleList(PatchMerger(cfg, dtype, postshuffle_norm=True)
                                                   for _ in self.deepstack_indexes)
        self.head_dim = cfg.hidden_size // cfg.num_heads
        self.rope_theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0)

    def forward(self, pixels: torch.Tensor, grid_thw: list[tuple[int, int, int]]) -> VisionOutput:
        x = self.patch_embed(pixels)
        x = x + self.position_embeddings(grid_thw).to(x.dtype)
        cos_sin = self.rotary(grid_thw)
        seq_lens = [h * w for t, h, w in grid_thw for _ in range(t)]  # attention within each frame
        deepstack = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos_sin, seq_lens)
            if i in self.deepstack_indexes:
                deepstack.append(self.deepstack_merger_list[self.deepstack_indexes.index(i)](x))
        tokens = [t * h * w // self.merge ** 2 for t, h, w in grid_thw]
        return VisionOutput(self.merger(x), deepstack, tokens)

    def _block_order(self, grid: torch.Tensor, t: int) -> torch.Tensor:
        """A per-patch [h, w, ...] grid in the processor's patch order (m×m merge blocks, row-major), t frames."""
        h, w, m = grid.shape[0], grid.shape[1], self.merge
        blocks = grid.reshape(h // m, m, w // m, m, *grid.shape[2:]).transpose(1, 2)
        return blocks.reshape(h * w, *grid.shape[2:]).repeat(t, *([1] * (grid.dim() - 2)))

    def position_embeddings(self, grid_thw) -> torch.Tensor:
        """The learned side×side table resampled to each image's h×w grid (bilinear, corners aligned)."""
        side, table = self.grid_side, self.pos_embed.weight.float()
        out = []
        for t, h, w in grid_thw:
            (r0, r1, dr), (c0, c1, dc) = _taps(h, side, table.device), _taps(w, side, table.device)
            emb = ((1 - dr)[:, None, None] * ((1 - dc)[None, :, None] * table[r0[:, None] * side + c0]
                                              + dc[None, :, None] * table[r0[:, None] * side + c1])
                   + dr[:, None, None] * ((1 - dc)[None, :, None] * table[r1[:, None] * side + c0]
                                          + dc[None, :, None] * table[r1[:, None] * side + c1]))
            out.append(self._block_order(emb, t))
        return torch.cat(out)

    def rotary(self, grid_thw) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 cos, sin [patches, head_dim]: the row's angles then the column's, the pair repeated
        (rotate-half)."""
        device = self.pos_embed.weight.device
        half = self.head_dim // 2  # the row and the column each rotate half the head: head_dim / 4 frequencies each
        # (computed here, not a buffer: the model is built on the meta device and a buffer would come out empty)
        inv_freq = 1.0 / self.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float, device=device) / half)
        rows_cols = []
        for t, h, w in grid_thw:
            rows = torch.arange(h, device=device)[:, None].expand(h, w)
            cols = torch.arange(w, device=device)[None, :].expand(h, w)
            rows_cols.append(self._block_order(torch.stack([rows, cols], dim=-1), t))
        pos = torch.cat(rows_cols).float()
        angles = (pos[:, :, None] * inv_freq).flatten(1)  # [patches, row freqs | column freqs]
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos(), angles.sin()


def _taps(size: int, side: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Bilinear taps (lower, upper index) and the upper's weight for ``size`` points spread over ``side`` rows,
    the first and last on the table's first and last (align_corners)."""
    src = torch.arange(size, device=device, dtype=torch.float) * (side - 1) / max(size - 1, 1)
    low = src.floor()
    return low.long(), (low.long() + 1).clamp(max=side - 1), src - low


def flatten_patch_weight(weight: torch.Tensor) -> torch.Tensor:
    """The checkpoint's Conv3d kernel [hidden, C, Tp, p, p] as the patch embedding's linear weight."""
    return weight.reshape(weight.shape[0], -1) if weight.dim() == 5 else weight


def chunk_image_rows(is_image: torch.Tensor, vision: VisionOutput, start: int, end: int) -> ImageRows | None:
    """The ImageRows of a prompt's tokens ``start`` .. ``end - 1`` (rows counted from ``start``), or None when none
    is an image token. ``is_image``: [prompt length] bool, the image-pad tokens; ``vision``: the tower's output for
    all the prompt's images (the k-th image token takes row k of it)."""
    chunk = is_image[start:end]
    if not bool(chunk.any()):
        return None
    first = int(is_image[:start].sum())
    count = int(chunk.sum())
    rows = chunk.nonzero().flatten().to(vision.embeds.device)
    return ImageRows(rows, vision.embeds[first:first + count], [d[first:first + count] for d in vision.deepstack])
