"""What the live-weights server and trainer share: the model's architecture (``state_dict`` names and shapes
must match on both sides) and a short hash of its weights (each side prints it, to compare)."""

from __future__ import annotations

import hashlib

import torch


def build_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))


def weights_digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]
