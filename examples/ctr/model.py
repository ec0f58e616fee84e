"""A small DLRM-style click model for :class:`examples.ctr.data.ClickDataset`."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

import torch
from torch import nn

__all__ = ["DLRM"]


def _mlp(sizes: Sequence[int], last_relu: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(pairwise(sizes)):
        layers.append(nn.Linear(a, b))
        if last_relu or i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    """DLRM (Naumov et al., 2019), reduced to a CPU-sized example.

    One dense ``nn.Embedding(hash_size, emb_dim)`` per sparse field; a bottom MLP maps the
    dense features to an ``emb_dim`` vector; the pairwise dot products of that vector and
    the field embeddings (strict lower triangle of their Gram matrix) are concatenated with
    the dense vector and fed to a top MLP that ends in one logit. Initialisation uses
    torch's global RNG: seed it (``torch.manual_seed``) before constructing.
    """

    _rows: torch.Tensor
    _cols: torch.Tensor

    def __init__(
        self,
        num_dense: int = 4,
        num_sparse: int = 8,
        hash_size: int = 1000,
        emb_dim: int = 16,
        bottom: Sequence[int] = (32,),
        top: Sequence[int] = (64, 32),
        tables: bool = True,
        crosses: bool = False,
    ) -> None:
        super().__init__()
        self.num_sparse = num_sparse
        # crosses: one more vector, the sum of a multi-hot input's rows (examples.ctr.features)
        self.crosses = nn.EmbeddingBag(hash_size, emb_dim, mode="sum") if crosses else None
        if self.crosses is not None:
            nn.init.uniform_(self.crosses.weight, -(hash_size**-0.5), hash_size**-0.5)
        # tables False: the embeddings are held elsewhere (parameter servers): see ``interact``
        embeddings = [nn.Embedding(hash_size, emb_dim) for _ in range(num_sparse if tables else 0)]
        for emb in embeddings:
            # DLRM's init, U(-1/sqrt(n), 1/sqrt(n)); N(0, 1) would make the dot products huge.
            nn.init.uniform_(emb.weight, -(hash_size**-0.5), hash_size**-0.5)
        self.embeddings = nn.ModuleList(embeddings)
        self.bottom = _mlp([num_dense, *bottom, emb_dim], last_relu=True)
        n_vec = num_sparse + 1 + (1 if crosses else 0)
        rows, cols = torch.tril_indices(n_vec, n_vec, offset=-1)
        self.register_buffer("_rows", rows, persistent=False)
        self.register_buffer("_cols", cols, persistent=False)
        self.top = _mlp([emb_dim + n_vec * (n_vec - 1) // 2, *top, 1], last_relu=False)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor, crosses: torch.Tensor | None = None) -> torch.Tensor:
        """``dense`` float ``[n, num_dense]``, ``sparse`` int64 ``[n, num_sparse]`` (and, for a
        model built with ``crosses``, ``crosses`` int64 ``[n, k]``) -> logits ``[n]``."""
        vectors = [emb(sparse[:, f]) for f, emb in enumerate(self.embeddings)]
        if self.crosses is not None:
            if crosses is None:
                raise ValueError("this model was built with crosses: pass them")
            vectors.append(self.crosses(crosses))
        return self.interact(dense, vectors)

    def interact(self, dense: torch.Tensor, vectors: list[torch.Tensor]) -> torch.Tensor:
        """The model from the field embeddings on: ``vectors`` holds one ``[n, emb_dim]`` tensor
        per sparse field (looked up by ``forward``, or pulled from parameter servers)."""
        x = self.bottom(dense)
        t = torch.stack([x, *vectors], dim=1)  # [n, num_sparse + 1, emb_dim]
        gram = torch.bmm(t, t.transpose(1, 2))
        inter = gram[:, self._rows, self._cols]
        return self.top(torch.cat([x, inter], dim=1)).squeeze(-1)
