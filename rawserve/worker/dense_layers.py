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
    the model's vectors, which the first takes). ValueError, naming the module or its
    file, for weights that cannot be read or do not fit its config."""
    layers = []
    for module in modules:
        if module.in_features != width:
            raise ValueError(
                f"the Dense module {module.path} takes {module.in_features} numbers where "
                f"the model's vectors have {width}"
            )
        weights = read_weights(model_dir / module.path)
        with torch.device("meta"):  # sized by its config: nothing made before it fits
            layer = DenseLayer(module)
        try:
            layer.load_state_dict(
                {key: value.float() for key, value in weights.items()}, assign=True
            )
        except RuntimeError as exc:  # missing, unexpected or misshapen weights
            first = str(exc).splitlines()[1:2] or [str(exc)]
            raise ValueError(
                f"the Dense module {module.path}'s weights do not fit its config: "
                f"{first[0].strip()}"
            ) from None
        layers.append(layer.to(device).eval())
        width = module.out_features
    return layers


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    """A Dense module's tensors: its model.safetensors, else its pytorch_model.bin (as
    sentence-transformers looks for them); ValueError naming a file that is not whole."""
    safetensors = folder / "model.safetensors"
    path = safetensors if safetensors.is_file() else folder / "pytorch_model.bin"
    try:
        if path is safetensors:
            return load_file(path)
        return dict(torch.load(path, "cpu", weights_only=True))
    except Exception as exc:  # noqa: BLE001 - cut short, corrupt, or not tensors alone
        raise ValueError(
            f"{folder.name}/{path.name} is not a whole weights file "
            f"({type(exc).__name__}): download it again"
        ) from None
