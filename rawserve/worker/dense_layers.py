"""sentence-transformers' Dense modules, run on the pooled vectors as it runs them.

Worker process only (imports torch).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from rawserve.models.sentence_folder import DenseModule


class DenseLayer(torch.nn.Module):
    """activation(W x + b), plus x (projected where the sizes differ) when residual: the
    parameter names are sentence-transformers' own, so its weights load as saved."""

    def __init__(self, module: DenseModule):
        super().__init__()
        self.linear = torch.nn.Linear(module.in_features, module.out_features, module.bias)
        self.activation = getattr(torch.nn, module.activation)()
        self.residual: torch.nn.Module | None = None
        if module.residual:
            same = module.in_features == module.out_features
            self.residual = (
                torch.nn.Identity()
                if same
                else torch.nn.Linear(module.in_features, module.out_features, bias=False)
            )

    def forward(self, vectors: torch.Tensor) -> torch.Tensor:
        out = self.activation(self.linear(vectors))
        return out if self.residual is None else out + self.residual(vectors)


def load_dense_layers(
    model_dir: Path, modules: tuple[DenseModule, ...], width: int, device: str
) -> list[DenseLayer]:
    """The folder's Dense layers in float32 on `device`, in order (`width`: the size of
    the model's vectors, which the first takes). ValueError, naming the module, for
    weights that do not fit its config."""
    layers = []
    for module in modules:
        if module.in_features != width:
            raise ValueError(
                f"the Dense module {module.path} takes {module.in_features} numbers where "
                f"the model's vectors have {width}"
            )
        layer = DenseLayer(module)
        folder = model_dir / module.path
        safetensors = folder / "model.safetensors"
        if safetensors.is_file():
            weights = load_file(safetensors)
        else:
            weights = torch.load(folder / "pytorch_model.bin", "cpu", weights_only=True)
        try:
            layer.load_state_dict({key: value.float() for key, value in weights.items()})
        except RuntimeError as exc:  # missing, unexpected or misshapen weights
            first = str(exc).splitlines()[1:2] or [str(exc)]
            raise ValueError(
                f"the Dense module {module.path}'s weights do not fit its config: "
                f"{first[0].strip()}"
            ) from None
        layers.append(layer.to(device).eval())
        width = module.out_features
    return layers
