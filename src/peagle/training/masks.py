"""The P-EAGLE training attention mask.

A training example is a set of *elements* ``(a, d)``: anchor position ``a``, depth ``d`` (docs/DESIGN.md section 4).
Element ``(a, d)`` may attend to ``(a', d')`` iff both are in the same document, neither is padding, and

    (d' == 0 and a' <= a)        every real (depth-0) slot up to and including its anchor, or
    (a' == a and d' <= d)        its own chain of parallel slots up to itself.

Worked example, anchors 0..2, K = 3, all elements kept, depth-major order
``(0,0) (1,0) (2,0) (0,1) (1,1) (2,1) (0,2) (1,2) (2,2)``; row = query, column = key, ``x`` = attend:

    query \\ key  (0,0) (1,0) (2,0) (0,1) (1,1) (2,1) (0,2) (1,2) (2,2)
    (0,0)          x
    (1,0)          x     x
    (2,0)          x     x     x
    (0,1)          x                 x
    (1,1)          x     x                 x
    (2,1)          x     x     x                 x
    (0,2)          x                 x                 x
    (1,2)          x     x                 x                 x
    (2,2)          x     x     x                 x                 x

The rule depends only on element *coordinates*, never on the data, so the trainer computes the coordinate grid
once at the maximum length ([`PEagleMaskTemplate`]), takes the rows of each example by slicing the grid to the
example's anchor count and keeping its COD elements (depth-major order: all depth-0 elements first, then depth 1,
...), and evaluates the rule with one broadcast comparison (no per-element Python).  A dense mask stored at the
maximum length would need ``(K * L)**2`` booleans (4 GiB for L = 8K, K = 8), so only the grid is stored.
"""

from __future__ import annotations

import torch


def peagle_mask_rule(
    q_anchor: torch.Tensor,
    q_depth: torch.Tensor,
    k_anchor: torch.Tensor,
    k_depth: torch.Tensor,
    q_doc: torch.Tensor | None = None,
    k_doc: torch.Tensor | None = None,
    q_valid: torch.Tensor | None = None,
    k_valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """The attention rule on broadcastable coordinate tensors (True = query may attend to key).

    Used both for dense masks (query coordinates shaped `(..., Eq, 1)`, keys `(..., 1, Ek)`) and as the body of a
    flex-attention ``mask_mod`` (scalar index tensors), so there is one implementation of the rule.

    Example:

    >>> t = torch.tensor
    >>> bool(peagle_mask_rule(t(5), t(2), t(3), t(0)))  # depth-0 key before the anchor
    True
    >>> bool(peagle_mask_rule(t(5), t(2), t(5), t(1)))  # own chain, shallower
    True
    >>> bool(peagle_mask_rule(t(5), t(2), t(4), t(1)))  # another anchor's parallel slot
    False
    """
    allowed = ((k_depth == 0) & (k_anchor <= q_anchor)) | ((k_anchor == q_anchor) & (k_depth <= q_depth))
    if q_doc is not None and k_doc is not None:
        allowed = allowed & (q_doc == k_doc)
    if q_valid is not None:
        allowed = allowed & q_valid
    if k_valid is not None:
        allowed = allowed & k_valid
    return allowed


def _key_coordinates(anchor, depth, valid, document_ids, key_anchor, key_depth, key_valid, key_document_ids):
    """The key coordinates of a mask: the given ones, else the queries' (a square mask)."""
    square = key_anchor is None or key_anchor is anchor
    return (
        anchor if key_anchor is None else key_anchor,
        depth if key_depth is None else key_depth,
        valid if (key_valid is None and square) else key_valid,
        document_ids if (key_document_ids is None and square) else key_document_ids,
    )


def peagle_attention_mask(
    anchor: torch.Tensor,
    depth: torch.Tensor,
    valid: torch.Tensor | None = None,
    document_ids: torch.Tensor | None = None,
    *,
    key_anchor: torch.Tensor | None = None,
    key_depth: torch.Tensor | None = None,
    key_valid: torch.Tensor | None = None,
    key_document_ids: torch.Tensor | None = None,
    pad_self: bool = False,
) -> torch.Tensor:
    """Dense boolean P-EAGLE mask between query and key elements.

    Args:
        anchor, depth: `(..., Eq)` coordinates of the query elements.
        valid: `(..., Eq)` False at padding elements.
        document_ids: `(..., Eq)` document of each element (the document of its anchor).
        key_*: the same for the keys; default: the queries (a square mask).
        pad_self: let padding queries attend to their own key (keeps softmax finite; their outputs are never
            used).  The queries are taken to be the last Eq of the Ek keys (a square mask, or a block appended to
            a KV cache), so query i's own key is key ``Ek - Eq + i``.

    Returns:
        `(..., Eq, Ek)` bool, True = attend.  Add a head axis (`mask[:, None]`) for the drafter.

    Example (anchors 0, 1 with depths 0 and 1; order (0,0) (1,0) (0,1) (1,1)):

    >>> a, d = torch.tensor([0, 1, 0, 1]), torch.tensor([0, 0, 1, 1])
    >>> peagle_attention_mask(a, d).int().tolist()
    [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]
    """
    key_anchor, key_depth, key_valid, key_document_ids = _key_coordinates(
        anchor, depth, valid, document_ids, key_anchor, key_depth, key_valid, key_document_ids
    )
    mask = peagle_mask_rule(
        anchor[..., :, None],
        depth[..., :, None],
        key_anchor[..., None, :],
        key_depth[..., None, :],
        None if document_ids is None else document_ids[..., :, None],
        None if key_document_ids is None else key_document_ids[..., None, :],
        None if valid is None else valid[..., :, None],
        None if key_valid is None else key_valid[..., None, :],
    )
    if pad_self and valid is not None:
        q_len, k_len = mask.shape[-2:]
        if k_len < q_len:
            raise ValueError(
                f"pad_self needs at least as many keys as queries, got {q_len} queries, {k_len} keys."
            )
        own = torch.arange(q_len, device=mask.device)[:, None] + (k_len - q_len) == torch.arange(
            k_len, device=mask.device
        )
        mask = mask | (own & ~valid[..., :, None])
    return mask


class PEagleMaskTemplate:
    """Element coordinates of the full `(K_train, max_anchors)` grid, computed once at the maximum length.

    `num_parallel_positions` is K_train, the number of depths ``0 .. K_train-1``.

    `coordinates(keep)` slices the grid to an example's anchor count and keeps its COD elements in depth-major
    order; `mask(keep)` evaluates the attention rule on them.

    Example:

    >>> tpl = PEagleMaskTemplate(max_anchors=8, num_parallel_positions=3)
    >>> keep = torch.tensor([[True, True, True], [True, False, True], [False, False, True]])
    >>> anchor, depth = tpl.coordinates(keep)
    >>> anchor.tolist(), depth.tolist()
    ([0, 1, 2, 0, 2, 2], [0, 0, 0, 1, 1, 2])
    >>> tpl.mask(keep).shape
    torch.Size([6, 6])
    """

    def __init__(
        self, max_anchors: int, num_parallel_positions: int, device: torch.device | str | None = None
    ):
        self.max_anchors = int(max_anchors)
        self.num_parallel_positions = int(num_parallel_positions)
        self.anchor_grid = torch.arange(self.max_anchors, device=device).expand(
            self.num_parallel_positions, -1
        )
        self.depth_grid = torch.arange(self.num_parallel_positions, device=device)[:, None].expand(
            -1, self.max_anchors
        )

    def coordinates(self, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(anchor, depth)` of the kept elements of a `(K', n)` keep mask (K' <= K_train, n <= max_anchors)."""
        depths, n = keep.shape
        if depths > self.num_parallel_positions or n > self.max_anchors:
            raise ValueError(
                f"keep mask {tuple(keep.shape)} exceeds the template "
                f"({self.num_parallel_positions}, {self.max_anchors}); "
                "build the template at the maximum length and depth."
            )
        keep = keep.to(self.anchor_grid.device)
        return self.anchor_grid[:depths, :n][keep], self.depth_grid[:depths, :n][keep]

    def mask(self, keep: torch.Tensor) -> torch.Tensor:
        """Dense `(E, E)` mask of the kept elements, E = ``keep.sum()``."""
        anchor, depth = self.coordinates(keep)
        return peagle_attention_mask(anchor, depth)


def flex_attention_available() -> bool:
    """Whether this torch ships `torch.nn.attention.flex_attention.create_block_mask`."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask  # noqa: F401
    except ImportError:
        return False
    return True


def peagle_block_mask(
    anchor: torch.Tensor,
    depth: torch.Tensor,
    valid: torch.Tensor | None = None,
    document_ids: torch.Tensor | None = None,
    *,
    key_anchor: torch.Tensor | None = None,
    key_depth: torch.Tensor | None = None,
    key_valid: torch.Tensor | None = None,
    key_document_ids: torch.Tensor | None = None,
    pad_self: bool = False,
    block_size: int = 128,
):
    """The same rule as [`peagle_attention_mask`] as a flex-attention `BlockMask` (no dense `E x E` tensor).

    Args: as [`peagle_attention_mask`], each `(B, E)`; `block_size` is flex attention's tile size.

    Returns:
        `BlockMask` of shape `(B, 1, Eq, Ek)`; pass it as `attention_mask` to a drafter built with
        ``attn_implementation="flex_attention"``.
    """
    if not flex_attention_available():
        raise RuntimeError(
            f"flex attention is not available in torch {torch.__version__}; use the dense mask."
        )
    from torch.nn.attention.flex_attention import create_block_mask

    if anchor.dim() != 2:
        raise ValueError(f"peagle_block_mask expects (B, E) coordinates, got shape {tuple(anchor.shape)}.")
    k_anchor, k_depth, k_valid, k_doc = _key_coordinates(
        anchor, depth, valid, document_ids, key_anchor, key_depth, key_valid, key_document_ids
    )

    def mask_mod(b, h, q_idx, kv_idx):
        allowed = peagle_mask_rule(
            anchor[b, q_idx],
            depth[b, q_idx],
            k_anchor[b, kv_idx],
            k_depth[b, kv_idx],
            None if document_ids is None else document_ids[b, q_idx],
            None if k_doc is None else k_doc[b, kv_idx],
            None if valid is None else valid[b, q_idx],
            None if k_valid is None else k_valid[b, kv_idx],
        )
        if pad_self and valid is not None:
            allowed = allowed | (~valid[b, q_idx] & (q_idx + offset == kv_idx))
        return allowed

    bsz, q_len = anchor.shape
    offset = k_anchor.shape[1] - q_len
    return create_block_mask(
        mask_mod, bsz, None, q_len, k_anchor.shape[1], device=anchor.device, BLOCK_SIZE=block_size
    )


__all__ = [
    "peagle_mask_rule",
    "peagle_attention_mask",
    "PEagleMaskTemplate",
    "peagle_block_mask",
    "flex_attention_available",
]
