"""A user's own model, nothing composerun knows about: `model._target_=my_models.TwoTower`."""

import torch.nn as nn


class TwoTower(nn.Module):
    """Two towers of `depth` linear layers side by side, and a head."""

    def __init__(self, dim: int = 8, depth: int = 2) -> None:
        super().__init__()
        self.left = nn.Sequential(*[nn.Linear(dim, dim) for _ in range(depth)])
        self.right = nn.Sequential(*[nn.Linear(dim, dim) for _ in range(depth)])
        self.head = nn.Linear(dim, dim)

    def forward(self, x):
        return self.head(self.left(x) + self.right(x))
