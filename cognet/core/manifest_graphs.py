"""The graph entries of a model's manifest (`cognet.core.manifest`): each tensor's name,
type and shape (`TensorSpec`), each graph's file, sha256, inputs and outputs (`GraphSpec`),
and the graphs of one more member of an ensemble (`MemberGraphs`). Torch-free. Their types
and ranges are checked by the manifest's schema (`cognet.core.file_schemas.MANIFEST`) before
`from_json` reads them."""

from __future__ import annotations

from dataclasses import dataclass, field

DTYPES = ("int64", "float32", "float16", "float64", "bool")


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # one of DTYPES
    shape: tuple[str | int, ...]  # symbolic axis names (str) or fixed sizes (int)

    def to_json(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}

    @classmethod
    def from_json(cls, obj: dict) -> TensorSpec:
        """A tensor entry that `cognet.core.file_schemas.MANIFEST` took (so are the ones below)."""
        return cls(obj["name"], obj["dtype"], tuple(obj["shape"]))


@dataclass(frozen=True)
class GraphSpec:
    file: str  # relative to the model directory
    sha256: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]

    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.inputs)

    @property
    def output_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.outputs)

    def to_json(self) -> dict:
        return {
            "file": self.file,
            "sha256": self.sha256,
            "inputs": [t.to_json() for t in self.inputs],
            "outputs": [t.to_json() for t in self.outputs],
        }

    @classmethod
    def from_json(cls, obj: dict) -> GraphSpec:
        return cls(
            obj["file"],
            obj["sha256"],
            tuple(TensorSpec.from_json(t) for t in obj["inputs"]),
            tuple(TensorSpec.from_json(t) for t in obj["outputs"]),
        )


@dataclass(frozen=True)
class MemberGraphs:
    """The graphs of one more member of an ensemble (`Manifest.member_graphs`)."""

    graphs: dict[str, GraphSpec]
    variants: dict[str, dict[str, GraphSpec]] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {
            "graphs": specs_json(self.graphs),
            "variants": {v: specs_json(gs) for v, gs in self.variants.items()},
        }

    @classmethod
    def from_json(cls, obj: dict) -> MemberGraphs:
        variants = {v: specs_from_json(g) for v, g in obj.get("variants", {}).items()}
        return cls(specs_from_json(obj["graphs"]), variants)


def specs_from_json(obj: dict) -> dict[str, GraphSpec]:
    return {k: GraphSpec.from_json(g) for k, g in obj.items()}


def specs_json(specs: dict[str, GraphSpec]) -> dict:
    return {k: g.to_json() for k, g in specs.items()}
