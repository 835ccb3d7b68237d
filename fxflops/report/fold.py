"""Group the module tree for display: identical numbered repeats fold into one entry with a count.

A transformer's 24 layers are the same subtree 24 times; showing one with `24 x` keeps an
80-layer model on one screen. Only numbered repeats fold (a ModuleList's or Sequential's children
named 0, 1, 2 ...), as DeepSpeed users expect: differently named siblings (`up` and `down`) are
different modules, however alike, and are always shown apart. Every displayed entry is a `Group`: the qualified names of the
module instances it stands for (one when nothing is folded), so numbers of one instance times
`count` give back what the parent holds, and latencies can be averaged over the instances.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from dataclasses import dataclass

from fxflops.results import Estimate, ModuleStats


@dataclass(frozen=True)
class Group:
    """One displayed entry of the module tree."""

    names: tuple[str, ...]  # qualified names of every instance shown by this entry
    count: int  # sibling subtrees folded into this entry (1 = not folded)
    label: str  # "feature_extractor", "0-23", "query, key" ("" for the root)
    depth: int

    @property
    def name(self) -> str:
        """Qualified name of the instance whose numbers are shown."""
        return self.names[0]

    @property
    def folded(self) -> bool:
        return self.count > 1


def relative_name(parent: str, child: str) -> str:
    """`encoder.layer.0` under `encoder.layer` -> `0`."""
    if parent and child.startswith(parent + "."):
        return child[len(parent) + 1 :]
    return child if not parent else child.rsplit(".", 1)[-1]


def subtree_signatures(estimate: Estimate) -> dict[str, Hashable]:
    """A value per module that is equal exactly when two subtrees are identical.

    Latency is left out on purpose: identical layers are never timed identically.
    """
    signatures: dict[str, Hashable] = {}
    # Pre-order reversed visits every child before its parent.
    for name in reversed(list(estimate.modules)):
        stats = estimate.modules[name]
        children = tuple(
            (relative_name(name, child), signatures.get(child)) for child in stats.children
        )
        signatures[name] = (
            stats.type,
            stats.extra_repr,
            stats.params,
            stats.macs,
            stats.flops,
            stats.self_macs,
            stats.self_flops,
            stats.bwd_macs,
            stats.bwd_flops,
            stats.calls,
            tuple(stats.shared.items()),
            children,
        )
    return signatures


def root_group() -> Group:
    return Group(names=("",), count=1, label="", depth=0)


def _run_label(parent: str, children: list[str]) -> str:
    """`0-23` for a run of consecutive indices, otherwise the one name."""
    names = [relative_name(parent, child) for child in children]
    if len(names) > 1 and all(part.isdigit() for part in names):
        numbers = [int(part) for part in names]
        if numbers == list(range(numbers[0], numbers[0] + len(numbers))):
            return f"{numbers[0]}-{numbers[-1]}"
    return ", ".join(names)


def _runs(positions: list[str], signatures: dict[str, Hashable], fold: bool) -> list[list[int]]:
    """Contiguous runs of consecutively numbered child positions with identical subtrees (singletons
    when not folding)."""
    runs: list[list[int]] = []
    for index, child in enumerate(positions):
        if (fold and runs and _numbered_next(positions[runs[-1][-1]], child)
                and signatures[positions[runs[-1][0]]] == signatures[child]):
            runs[-1].append(index)
        else:
            runs.append([index])
    return runs


def _numbered_next(previous: str, child: str) -> bool:
    """Whether `child` is the repeat numbered right after `previous` (`layers.3` after `layers.2`)."""
    before, after = previous.rsplit(".", 1)[-1], child.rsplit(".", 1)[-1]
    return before.isdigit() and after.isdigit() and int(after) == int(before) + 1


def child_groups(
    estimate: Estimate, group: Group, signatures: dict[str, Hashable], fold: bool = True
) -> list[Group]:
    """The entries under `group`, in definition order."""
    modules = estimate.modules
    first = modules[group.name]
    # Instances of a folded group are identical subtrees, so their children line up by position.
    per_instance = [modules[name].children for name in group.names]
    groups = []
    for run in _runs(first.children, signatures, fold):
        names = tuple(children[index] for index in run for children in per_instance)
        label = _run_label(group.name, [first.children[index] for index in run])
        groups.append(Group(names=names, count=len(run), label=label, depth=group.depth + 1))
    return groups


def walk(
    estimate: Estimate, fold: bool = True, max_depth: int = -1
) -> Iterator[tuple[Group, list[Group]]]:
    """Pre-order (group, its displayed children); children are empty past `max_depth`."""
    signatures = subtree_signatures(estimate)
    stack = [root_group()]
    while stack:
        group = stack.pop()
        shown = max_depth < 0 or group.depth < max_depth
        children = child_groups(estimate, group, signatures, fold) if shown else []
        yield group, children
        stack.extend(reversed(children))


def stats_of(estimate: Estimate, group: Group) -> ModuleStats:
    return estimate.modules[group.name]


def mean_latency(estimate: Estimate, group: Group, field: str = "latency") -> float | None:
    """Mean measured latency (or `field`, e.g. "bwd_latency") over the instances of `group` (None when
    none was timed)."""
    latencies = [getattr(estimate.modules[name], field) for name in group.names]
    measured = [value for value in latencies if value is not None]
    if not measured:
        return None
    return sum(measured) / len(measured)


def root_latency(estimate: Estimate) -> float | None:
    """What "% latency" is a share of: the top module's hooked latency, else the plain one."""
    root = estimate.modules[""].latency if "" in estimate.modules else None
    if root is not None:
        return root
    return estimate.measurements.fwd_latency if estimate.measurements else None

