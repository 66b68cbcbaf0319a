"""Per-layer profiles of a model: the planner's only input about the model.

A profile is a DAG of layers (graph nodes). Each node carries its forward and backward time in
milliseconds, the bytes of the activation it outputs and the bytes of its parameters; a chain of
nodes is an ``nn.Sequential``. The same values are what PipeDream's profiler records (SOSP'19,
section 3.1), so profiles in PipeDream's ``graph.txt`` format read and write losslessly.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

__all__ = ["Node", "Profile", "ProfileError"]


class ProfileError(ValueError):
    """A profile that cannot be read or does not describe a DAG of layers."""


@dataclass(frozen=True)
class Node:
    """One layer of a profile: its id, a description, and its measured costs.

    ``activation_bytes`` is a tuple because a layer can output several tensors (PipeDream writes
    them as ``[a; b; c]``); ``output_bytes`` is their sum.
    """

    node_id: str
    desc: str
    forward_ms: float
    backward_ms: float
    activation_bytes: tuple[float, ...]
    parameter_bytes: float
    stage_id: int | None = None

    @property
    def output_bytes(self) -> float:
        return math.fsum(self.activation_bytes)

    @property
    def compute_ms(self) -> float:
        return self.forward_ms + self.backward_ms


@dataclass(frozen=True)
class Profile:
    """A DAG of profiled layers; ``nodes`` keep their file order, ``edges`` are (src, dst) pairs."""

    nodes: tuple[Node, ...]
    edges: tuple[tuple[str, str], ...] = ()
    batch_size: int | None = None
    meta: dict[str, str] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        ids = [node.node_id for node in self.nodes]
        if len(set(ids)) != len(ids):
            duplicates = sorted({i for i in ids if ids.count(i) > 1})
            raise ProfileError(f"node ids must be unique (duplicates: {duplicates})")
        known = set(ids)
        for src, dst in self.edges:
            if src not in known or dst not in known:
                missing = src if src not in known else dst
                raise ProfileError(
                    f"every edge must join two nodes of the profile (edge: {src} -- {dst}, "
                    f"unknown node: {missing}); add the node or remove the edge"
                )
        for node in self.nodes:
            _check_costs(node)
        self.topological_order()  # raises on a cycle

    def check_connected(self) -> None:
        """Refuse a file whose nodes (several) include one without any edge: its edge lines
        were lost or never written, and planning it would order the layers arbitrarily. Checked
        when a file is read; the planner's own subgraphs may leave a node alone."""
        if len(self.nodes) < 2:
            return
        joined = {node_id for edge in self.edges for node_id in edge}
        alone = [node.node_id for node in self.nodes if node.node_id not in joined]
        if alone:
            raise ProfileError(
                f"every node of a profile of several nodes must have an edge, or the planner "
                f"cannot order it (nodes without edges: {alone[:5]}, edges: {len(self.edges)}); "
                "add the edges (graph.txt: tab-indented 'src -- dst' lines after the nodes)"
            )

    # ----- construction -----------------------------------------------------------------------

    @classmethod
    def chain(
        cls,
        forward_ms: Sequence[float],
        backward_ms: Sequence[float],
        activation_bytes: Sequence[float | Sequence[float]],
        parameter_bytes: Sequence[float],
        descs: Sequence[str] | None = None,
        batch_size: int | None = None,
        meta: Mapping[str, str] | None = None,
    ) -> Profile:
        """A chain of layers (an ``nn.Sequential``) named ``layer0``, ``layer1``, ...

        A layer's ``activation_bytes`` is one number, or one number per output tensor.
        """
        names = list(descs) if descs is not None else [f"Layer{i}" for i in range(len(forward_ms))]
        lengths = {
            len(forward_ms),
            len(backward_ms),
            len(activation_bytes),
            len(parameter_bytes),
            len(names),
        }
        if len(lengths) != 1:
            raise ProfileError(
                "a chain needs one value per layer in every list (lengths: "
                f"forward {len(forward_ms)}, backward {len(backward_ms)}, activation "
                f"{len(activation_bytes)}, parameter {len(parameter_bytes)}, descs {len(names)})"
            )
        nodes = tuple(
            Node(f"layer{i}", names[i], float(f), float(b), _as_floats(a), float(p))
            for i, (f, b, a, p) in enumerate(
                zip(forward_ms, backward_ms, activation_bytes, parameter_bytes, strict=True)
            )
        )
        edges = tuple((f"layer{i}", f"layer{i + 1}") for i in range(len(nodes) - 1))
        return cls(nodes, edges, batch_size=batch_size, meta=dict(meta or {}))

    # ----- graph queries ----------------------------------------------------------------------

    def node(self, node_id: str) -> Node:
        for node in self.nodes:
            if node.node_id == node_id:
                return node
        raise KeyError(node_id)

    def successors(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {node.node_id: [] for node in self.nodes}
        for src, dst in self.edges:
            out[src].append(dst)
        return out

    def predecessors(self) -> dict[str, list[str]]:
        into: dict[str, list[str]] = {node.node_id: [] for node in self.nodes}
        for src, dst in self.edges:
            into[dst].append(src)
        return into

    def is_chain(self) -> bool:
        """True when the graph is one path (an ``nn.Sequential``), whatever the file order.

        A DAG is a single path exactly when its edges are the consecutive pairs of a
        topological order (that order is then the only one).
        """
        order = self.topological_order()
        return sorted(self.edges) == sorted(zip(order, order[1:], strict=False))

    def topological_order(self) -> list[str]:
        """Node ids in a topological order (Kahn's algorithm).

        Nodes become ready first in, first out; the sources start in file order.
        """
        into = {node.node_id: 0 for node in self.nodes}
        for _, dst in self.edges:
            into[dst] += 1
        succ = self.successors()
        order: list[str] = []
        ready = [node.node_id for node in self.nodes if into[node.node_id] == 0]
        while ready:
            current = ready.pop(0)
            order.append(current)
            for nxt in succ[current]:
                into[nxt] -= 1
                if into[nxt] == 0:
                    ready.append(nxt)
        if len(order) != len(self.nodes):
            stuck = sorted(node_id for node_id, count in into.items() if count > 0)
            raise ProfileError(f"a profile must be acyclic (nodes on a cycle: {stuck[:5]})")
        return order

    # ----- PipeDream's graph.txt --------------------------------------------------------------

    @classmethod
    def from_graph_txt(cls, text: str, source: str = "<string>") -> Profile:
        """Parse PipeDream's ``graph.txt``: node lines, then tab-indented ``a -- b`` edge lines."""
        nodes: list[Node] = []
        edges: list[tuple[str, str]] = []
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                if line.startswith("\t"):
                    src, dst = line.strip().split(" -- ")
                    edges.append((src, dst))
                else:
                    nodes.append(_parse_node_line(line.strip()))
            except (ValueError, IndexError, KeyError) as error:
                raise ProfileError(
                    f"a graph.txt line must be 'id -- desc -- forward_compute_time=..., "
                    f"backward_compute_time=..., activation_size=..., parameter_size=...' or a "
                    f"tab-indented 'src -- dst' edge (file: {source}, line {number}: "
                    f"{line.strip()[:80]!r}); fix or regenerate the profile"
                ) from error
        if not nodes:
            raise ProfileError(f"a profile needs at least one node (file: {source})")
        try:
            profile = cls(tuple(nodes), tuple(edges))
            profile.check_connected()
            return profile
        except ProfileError as error:
            raise ProfileError(f"{error} (file: {source})") from error

    def to_graph_txt(self) -> str:
        lines = [_format_node_line(node) for node in self.nodes]
        lines += [f"\t{src} -- {dst}" for src, dst in self.edges]
        return "\n".join(lines) + "\n"

    # ----- JSON -------------------------------------------------------------------------------

    def to_json(self) -> str:
        return json.dumps(
            {
                "nodes": [asdict(node) for node in self.nodes],
                "edges": [list(edge) for edge in self.edges],
                "batch_size": self.batch_size,
                "meta": self.meta,
            },
            indent=1,
        )

    @classmethod
    def from_json(cls, text: str) -> Profile:
        data = json.loads(text)
        nodes = tuple(
            Node(**{**node, "activation_bytes": tuple(node["activation_bytes"])})
            for node in data["nodes"]
        )
        edges = tuple((src, dst) for src, dst in data["edges"])
        profile = cls(nodes, edges, data.get("batch_size"), dict(data.get("meta") or {}))
        profile.check_connected()
        return profile

    # ----- files ------------------------------------------------------------------------------

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        """Read a profile from ``.json`` (ours) or any other suffix (PipeDream's graph.txt)."""
        path = Path(path)
        try:
            text = path.read_text()
        except OSError as error:
            raise ProfileError(
                f"the profile file cannot be read (path: {path}): {error}"
            ) from error
        if path.suffix == ".json":
            try:
                return cls.from_json(text)
            except (ValueError, KeyError, TypeError) as error:
                raise ProfileError(
                    f"a JSON profile needs 'nodes' and 'edges' as written by Profile.save "
                    f"(path: {path}): {error}"
                ) from error
        return cls.from_graph_txt(text, source=str(path))

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.write_text(self.to_json() if path.suffix == ".json" else self.to_graph_txt())

    def with_nodes(self, nodes: Iterable[Node]) -> Profile:
        return Profile(tuple(nodes), self.edges, self.batch_size, dict(self.meta))


def _check_costs(node: Node) -> None:
    """Times and sizes are measurements: a negative or non-finite one (a profiler's bad clock
    difference, a hand-edited file) would make the planner prefer that layer's stage."""
    costs = {
        "forward_ms": node.forward_ms,
        "backward_ms": node.backward_ms,
        "parameter_bytes": node.parameter_bytes,
    }
    costs.update({f"activation_bytes[{i}]": a for i, a in enumerate(node.activation_bytes)})
    for name, value in costs.items():
        if not (math.isfinite(value) and value >= 0):
            raise ProfileError(
                f"a profile's times and sizes must be finite and non-negative (node: "
                f"{node.node_id}, {name}: {value}); measure the layer again or fix its line"
            )


def _as_floats(value: float | Sequence[float]) -> tuple[float, ...]:
    if isinstance(value, Sequence) and not isinstance(value, str):
        return tuple(float(v) for v in value)
    return (float(value),)


def _parse_node_line(line: str) -> Node:
    tokens = line.split(" -- ")
    node_id, desc, metadata = tokens[0], tokens[1], tokens[2]
    stage_id = int(tokens[3].split("=")[1]) if len(tokens) > 3 else None
    fields = dict(item.split("=", 1) for item in metadata.split(", "))
    raw_activation = fields["activation_size"]
    if raw_activation.startswith("["):
        activation = tuple(float(x) for x in raw_activation.strip("[]").split("; "))
    else:
        activation = (float(raw_activation),)
    return Node(
        node_id,
        desc,
        float(fields["forward_compute_time"]),
        float(fields["backward_compute_time"]),
        activation,
        float(fields["parameter_size"]),
        stage_id,
    )


def _format_node_line(node: Node) -> str:
    if len(node.activation_bytes) == 1:
        activation = repr(node.activation_bytes[0])
    else:
        activation = "[" + "; ".join(repr(a) for a in node.activation_bytes) + "]"
    stage = f" -- stage_id={node.stage_id}" if node.stage_id is not None else ""
    desc = node.desc.replace("\n", "")
    return (
        f"{node.node_id} -- {desc} -- forward_compute_time={node.forward_ms!r}, "
        f"backward_compute_time={node.backward_ms!r}, activation_size={activation}, "
        f"parameter_size={node.parameter_bytes!r}{stage}"
    )
