"""Where a run's actors go: one Ray placement group per role, reserved up front and awaited with one bound.

`plan(cfg)` says what each role asks for: the learner one group of `learner.num_ranks` bundles (PACK or SPREAD),
each generator one group (a single bundle, or `rollout.tensor_parallel_size` one-GPU bundles under STRICT_PACK so
an engine never spans nodes), each teacher engine of on-policy distillation one group likewise, the reward workers
one PACK group. `place(cfg)` creates the groups and waits for all
of them at once for `ray.placement_timeout_s`; past it every group is removed and `PlacementError` lists what was
asked and what the cluster has. `describe(cfg, nodes)` simulates the same plan against a cluster's nodes without
starting anything (`grpo-dist check CONFIG --cluster ADDRESS`).

Tensor parallelism: the generator actor sits in bundle 0 of its group with no GPU of its own and captures child
tasks, so vLLM's Ray executor finds the group with `ray.util.get_current_placement_group()` and puts one engine
worker (1 GPU, 0 CPU) on each GPU bundle of it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from grpo_dist.config import Config
from grpo_dist.faults import Bounds, gather

Strategy = Literal["PACK", "SPREAD", "STRICT_PACK"]
Bundle = dict[str, float]
RESOURCES = ("CPU", "GPU")
EPS = 1e-6  # Ray counts resources in 1/10000 units; compare with this slack

LEARNER_KEYS = "learner.num_ranks, learner.num_cpus, learner.num_gpus"  # SPREAD is soft: placement never blocks
GENERATOR_KEYS = "rollout.num_generators, rollout.num_cpus, rollout.num_gpus, rollout.tensor_parallel_size"
REWARD_KEYS = "reward.num_workers, reward.num_cpus"
TEACHER_KEYS = (
    "algorithm.distill.num_engines, algorithm.distill.num_cpus, algorithm.distill.num_gpus, "
    "algorithm.distill.tensor_parallel_size"
)


class PlacementError(RuntimeError):
    """The cluster cannot hold the run's actors; the message lists what was asked, what the cluster has and which
    config keys size each role."""


@dataclass(frozen=True)
class RoleRequest:
    """One placement group: what one role of the run reserves."""

    role: str
    """'learner', 'generator 0', 'generator 1', ... or 'reward'."""
    bundles: list[Bundle]
    """Resources of each bundle, e.g. {"CPU": 1.0, "GPU": 1.0}; one bundle per learner rank, engine worker or
    reward worker."""
    strategy: Strategy
    """Ray's placement strategy for the group."""
    keys: str
    """The config keys that size this role: what to change when it does not fit."""


def plan(cfg: Config) -> list[RoleRequest]:
    """The placement groups a run reserves, learner first, then each generator, each teacher engine
    (`algorithm.distill`), then the reward workers."""
    learner, rollout, reward = cfg.learner, cfg.rollout, cfg.reward
    requests = [
        RoleRequest(
            "learner",
            [_bundle(learner.num_cpus, learner.num_gpus) for _ in range(learner.num_ranks)],
            "SPREAD" if learner.placement == "spread" else "PACK",
            LEARNER_KEYS,
        )
    ]
    requests += [generator_request(cfg, index) for index in range(rollout.num_generators)]
    if (distill := cfg.algorithm.distill) is not None:
        keys = TEACHER_KEYS
        requests += [
            engine_request(f"teacher {index}", distill.num_cpus, distill.num_gpus, distill.tensor_parallel_size, keys)
            for index in range(distill.num_engines)
        ]
    requests.append(
        RoleRequest("reward", [_bundle(reward.num_cpus, 0.0) for _ in range(reward.num_workers)], "PACK", REWARD_KEYS)
    )
    return requests


def generator_request(cfg: Config, index: int) -> RoleRequest:
    """Generator `index`'s group: one bundle, or one GPU bundle per engine worker, all on one node."""
    rollout = cfg.rollout
    return engine_request(
        f"generator {index}", rollout.num_cpus, rollout.num_gpus, rollout.tensor_parallel_size, GENERATOR_KEYS
    )


def engine_request(role: str, num_cpus: float, num_gpus: float, tensor_parallel: int, keys: str) -> RoleRequest:
    """One vLLM engine's group (a generator's or a teacher's): one bundle, or one GPU bundle per engine worker."""
    if tensor_parallel == 1:
        return RoleRequest(role, [_bundle(num_cpus, num_gpus)], "PACK", keys)
    return RoleRequest(role, [_bundle(num_cpus, 1.0) for _ in range(tensor_parallel)], "STRICT_PACK", keys)


def generator_resources(cfg: Config) -> dict[str, float]:
    """`num_cpus` and `num_gpus` of one generator actor in its group's bundle 0. With tensor parallelism the actor
    takes no GPU: vLLM's engine workers take one each, bundle 0's included."""
    rollout = cfg.rollout
    return engine_resources(rollout.num_cpus, rollout.num_gpus, rollout.tensor_parallel_size)


def engine_resources(num_cpus: float, num_gpus: float, tensor_parallel: int) -> dict[str, float]:
    """An engine actor's resources in bundle 0 of its group (no GPU of its own with tensor parallelism)."""
    return {"num_cpus": num_cpus, "num_gpus": num_gpus if tensor_parallel == 1 else 0.0}


class Placement:
    """The run's placement groups, ready, and the scheduling strategy of each actor in them."""

    def __init__(self, requests: list[RoleRequest], groups: dict[str, PlacementGroup]) -> None:
        self.requests = {request.role: request for request in requests}
        self.groups = groups
        self.asked = False  # whether the run asked Ray's autoscaler for room (`ask_autoscaler`)

    def learner_strategies(self) -> list[PlacementGroupSchedulingStrategy]:
        """One per learner rank: rank i in bundle i."""
        group = self.groups["learner"]
        return [_in_bundle(group, rank) for rank in range(len(self.requests["learner"].bundles))]

    def generator_strategy(self, index: int) -> PlacementGroupSchedulingStrategy:
        """Generator `index` (resources: `generator_resources(cfg)`) in bundle 0 of its group, capturing child tasks:
        with tensor parallelism vLLM's Ray executor finds the group with `ray.util.get_current_placement_group()`
        and puts one engine worker on each of its GPU bundles."""
        role = f"generator {index}"
        if role not in self.groups:
            raise PlacementError(f"no placement group for {role}: the run has {self._count('generator')} generators")
        return _in_bundle(self.groups[role], 0, capture=True)

    def teacher_strategy(self, index: int) -> PlacementGroupSchedulingStrategy:
        """Teacher engine `index` in bundle 0 of its group, capturing child tasks (as a generator)."""
        role = f"teacher {index}"
        if role not in self.groups:
            raise PlacementError(f"no placement group for {role}: the run has {self._count('teacher')} teacher engines")
        return _in_bundle(self.groups[role], 0, capture=True)

    def reward_strategy(self, index: int) -> PlacementGroupSchedulingStrategy:
        """Reward worker `index` in bundle `index` of the reward group."""
        workers = len(self.requests["reward"].bundles)
        if not 0 <= index < workers:
            raise PlacementError(f"no bundle for reward worker {index}: the reward group has {workers}")
        return _in_bundle(self.groups["reward"], index)

    def request_generator(self, cfg: Config, index: int) -> ray.ObjectRef:
        """Ask for generator `index`'s group while the run goes (elastic scaling), without waiting: the reference
        returned is ready once the cluster has room for it (on an autoscaling cluster, once a node has joined)."""
        request = generator_request(cfg, index)
        group = placement_group(request.bundles, strategy=request.strategy)
        self.requests[request.role], self.groups[request.role] = request, group
        return group.ready()

    def remove_generator(self, index: int) -> None:
        """Release generator `index`'s group (its actor already stopped)."""
        role = f"generator {index}"
        remove_placement_group(self.groups.pop(role))
        self.requests.pop(role)

    def ask_autoscaler(self) -> int:
        """Tell Ray's autoscaler what the run needs now: every bundle of its groups, those still waiting for room
        included (`ray.autoscaler.sdk.request_resources`: a floor the cluster is scaled to, replacing the run's
        last; a cluster without an autoscaler ignores it). Returns the bundles asked for."""
        from ray.autoscaler.sdk import request_resources

        bundles = [dict(bundle) for request in self.requests.values() for bundle in request.bundles]
        request_resources(bundles=bundles)
        self.asked = True
        return len(bundles)

    def remove(self) -> None:
        """Release every group (actors still in them are killed by Ray), and the run's request to Ray's autoscaler,
        if it made one (a request stands until replaced: the cluster would keep the run's nodes)."""
        if self.asked:
            from ray.autoscaler.sdk import request_resources

            try:
                request_resources(bundles=[])
                self.asked = False
            except Exception as err:  # the run ends either way; the nodes are then the autoscaler's idle ones
                print(
                    f"warning: could not withdraw the run's request to Ray's autoscaler ({type(err).__name__}: {err})"
                )
        for group in self.groups.values():
            remove_placement_group(group)
        self.groups = {}

    def _count(self, prefix: str) -> int:
        return sum(role.startswith(prefix) for role in self.groups)


def place(cfg: Config) -> Placement:
    """Create every group of `plan(cfg)` and wait for all of them at most `ray.placement_timeout_s`; past that,
    remove them all and raise PlacementError naming what waits, what was asked and what the cluster has."""
    requests = _gpu_groups_first(plan(cfg))
    groups = {request.role: placement_group(request.bundles, strategy=request.strategy) for request in requests}
    refs = {role: group.ready() for role, group in groups.items()}
    bound = Bounds.of(cfg).placement
    outcomes = gather(list(refs.values()), bound)
    waiting = [role for role, outcome in zip(refs, outcomes, strict=True) if not outcome.ok]
    if not waiting:
        return Placement(requests, groups)
    message = _not_placed_message(requests, waiting, bound.seconds, cluster_nodes())  # before removal: free is as seen
    Placement(requests, groups).remove()
    raise PlacementError(message)


def cluster_nodes() -> list[dict[str, Any]]:
    """The alive nodes of the connected cluster: ip, node_id, CPU and GPU in all, free_CPU and free_GPU now."""
    from ray._private.state import available_resources_per_node  # a DeveloperAPI, also used by vLLM

    free = available_resources_per_node()
    nodes = []
    for node in ray.nodes():
        if not node["Alive"]:
            continue
        total, available = node["Resources"], free.get(node["NodeID"], {})
        nodes.append(
            {"ip": node["NodeManagerAddress"], "node_id": node["NodeID"]}
            | {name: float(total.get(name, 0.0)) for name in RESOURCES}
            | {f"free_{name}": float(available.get(name, 0.0)) for name in RESOURCES}
        )
    return nodes


def describe(cfg: Config, nodes: Sequence[Mapping[str, Any]]) -> str:
    """The placement plan of `cfg` against `nodes` ({"ip", "CPU", "GPU"}, optionally "node_id", "free_CPU",
    "free_GPU"): the cluster, each group and the nodes a first fit gives its bundles (groups with GPUs first, as
    `place` creates them), totals, and a last line 'fits' or 'does not fit: <why>'. Pure: starts nothing."""
    requests = _gpu_groups_first(plan(cfg))
    assignment, failure = _simulate(requests, nodes)
    asked, total = _totals([bundle for request in requests for bundle in request.bundles]), _totals(nodes)
    lines = [f"cluster: {len(nodes)} nodes, {_amounts(total)}"]
    lines += [f"  node {index}  {_node_text(node)}" for index, node in enumerate(nodes)]
    lines.append("plan (groups with GPUs first, first fit on each node's total resources):")
    role_width = max(len(request.role) for request in requests)
    text_width = max(len(_request_text(request)) for request in requests)
    for request in requests:
        where = _where(assignment[request.role]) if request.role in assignment else "no room"
        lines.append(f"  {request.role:{role_width}}  {_request_text(request):{text_width}}  -> {where}")
    lines.append(f"asked in all: {_amounts(asked)}; the cluster has {_amounts(total)}")
    reason = _shortfall(requests, asked, total) or failure
    lines.append(f"does not fit: {reason}" if reason else "fits")
    return "\n".join(lines)


def fits(cfg: Config, nodes: Sequence[Mapping[str, Any]]) -> bool:
    """Whether `describe(cfg, nodes)` ends in 'fits'."""
    return _simulate(_gpu_groups_first(plan(cfg)), nodes)[1] is None


def _bundle(num_cpus: float, num_gpus: float) -> Bundle:
    bundle = {"CPU": float(num_cpus)}
    if num_gpus > 0:
        bundle["GPU"] = float(num_gpus)
    return bundle


def _in_bundle(group: PlacementGroup, index: int, capture: bool = False) -> PlacementGroupSchedulingStrategy:
    return PlacementGroupSchedulingStrategy(
        placement_group=group,
        placement_group_bundle_index=index,
        placement_group_capture_child_tasks=capture,
    )


def _gpu_groups_first(requests: list[RoleRequest]) -> list[RoleRequest]:
    """Groups needing GPUs are created (and simulated) before CPU-only ones, so CPU bundles do not crowd them."""
    return sorted(requests, key=lambda request: _totals(request.bundles)["GPU"] <= 0)


def _simulate(
    requests: list[RoleRequest], nodes: Sequence[Mapping[str, Any]]
) -> tuple[dict[str, list[int]], str | None]:
    """First fit of each group in turn: {role: node index of each bundle} for the groups that found room, and why
    the first one that did not found none (None when all fit)."""
    free = [{name: float(node.get(name, 0.0)) for name in RESOURCES} for node in nodes]
    assignment: dict[str, list[int]] = {}
    failure = None
    for request in requests:
        placed = _fit(request, free)
        if placed is not None:
            assignment[request.role] = placed
        elif failure is None:
            failure = _no_room(request, free)
    return assignment, failure


def _fit(request: RoleRequest, free: list[Bundle]) -> list[int] | None:
    """Node index of each bundle of one group, taken from `free`; None (and `free` untouched) if it has no room."""
    whole = _totals(request.bundles)
    one_node = next((index for index, node in enumerate(free) if _fits(whole, node)), None)
    if request.strategy == "STRICT_PACK" or (request.strategy == "PACK" and one_node is not None):
        if one_node is None:
            return None
        _take(whole, free[one_node])
        return [one_node] * len(request.bundles)
    trial = [dict(node) for node in free]
    chosen: list[int] = []
    for bundle in request.bundles:
        used = [index for index in range(len(trial)) if index in chosen]
        unused = [index for index in range(len(trial)) if index not in chosen]
        order = unused + used if request.strategy == "SPREAD" else used + unused
        index = next((index for index in order if _fits(bundle, trial[index])), None)
        if index is None:
            return None
        _take(bundle, trial[index])
        chosen.append(index)
    free[:] = trial
    return chosen


def _fits(need: Mapping[str, float], node: Mapping[str, float]) -> bool:
    return all(node.get(name, 0.0) + EPS >= amount for name, amount in need.items())


def _take(need: Mapping[str, float], node: dict[str, float]) -> None:
    for name, amount in need.items():
        node[name] = node.get(name, 0.0) - amount


def _totals(items: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    return {name: sum(float(item.get(name, 0.0)) for item in items) for name in RESOURCES}


def _shortfall(requests: list[RoleRequest], asked: Mapping[str, float], total: Mapping[str, float]) -> str | None:
    """Why the run cannot fit whatever the layout: a resource asked beyond the cluster's total."""
    for name in RESOURCES:
        if asked[name] <= total[name] + EPS:
            continue
        by_kind: dict[str, float] = {}  # 'generator 0', 'generator 1' count together
        keys: dict[str, None] = {}
        for request in requests:
            amount = _totals(request.bundles)[name]
            if amount > 0:
                kind = request.role.split(" ")[0]
                by_kind[kind] = by_kind.get(kind, 0.0) + amount
                keys[request.keys] = None
        shares = ", ".join(f"{kind} {amount:g}" for kind, amount in by_kind.items())
        return (
            f"the run asks {asked[name]:g} {name}s in all ({shares}) and the cluster has {total[name]:g}; "
            f"change {'; '.join(keys)} or add nodes"
        )
    return None


def _no_room(request: RoleRequest, free: list[Bundle]) -> str:
    left = "; ".join(f"node {index}: {_amounts(node)}" for index, node in enumerate(free)) or "no nodes"
    if request.strategy == "STRICT_PACK":
        need = f"{_amounts(_totals(request.bundles))} on one node (STRICT_PACK: one engine never spans nodes)"
    else:
        need = f"{_request_text(request)}"
    return f"{request.role} needs {need}, but the groups before it leave {left}; change {request.keys} or add nodes"


def _not_placed_message(
    requests: list[RoleRequest], waiting: list[str], timeout_s: float, nodes: list[dict[str, Any]]
) -> str:
    asked = _totals([bundle for request in requests for bundle in request.bundles])
    total = _totals(nodes)
    free = {name: sum(node[f"free_{name}"] for node in nodes) for name in RESOURCES}
    reason = _shortfall(requests, asked, total) or _simulate(requests, nodes)[1]
    lines = [
        f"could not place every actor group within ray.placement_timeout_s={timeout_s:g}s; still waiting: "
        f"{', '.join(waiting)} (all groups of this run were removed again)",
        "asked:",
        *[f"  {request.role}: {_request_text(request)}" for request in requests],
        f"asked in all: {_amounts(asked)}",
        f"the cluster has {_amounts(total)} in all, {_amounts(free)} free while the placed groups held theirs:",
        *[f"  {_node_text(node)}" for node in nodes],
        f"on an idle cluster: {reason}" if reason else "on an idle cluster it would fit: other work holds the rest",
        f"to fit, change {'; '.join(dict.fromkeys(request.keys for request in requests if request.role in waiting))} "
        "or add nodes; raise ray.placement_timeout_s when an autoscaler has to start nodes",
    ]
    return "\n".join(lines)


def _request_text(request: RoleRequest) -> str:
    first = request.bundles[0]
    if all(bundle == first for bundle in request.bundles):
        bundles = f"{len(request.bundles)} x {_bundle_text(first)}"
    else:
        bundles = ", ".join(_bundle_text(bundle) for bundle in request.bundles)
    return f"{bundles} {request.strategy}"


def _bundle_text(bundle: Mapping[str, float]) -> str:
    return "{" + ", ".join(f"{name}: {amount:g}" for name, amount in bundle.items()) + "}"


def _amounts(resources: Mapping[str, float]) -> str:
    return ", ".join(f"{resources.get(name, 0.0):g} {name}s" for name in RESOURCES)


def _node_text(node: Mapping[str, Any]) -> str:
    name = f"{node.get('ip', '?')}" + (f" ({str(node['node_id'])[:8]})" if node.get("node_id") else "")
    text = f"{name}: {node.get('CPU', 0.0):g} CPU, {node.get('GPU', 0.0):g} GPU"
    if "free_CPU" in node:
        text += f" ({node['free_CPU']:g} CPU, {node.get('free_GPU', 0.0):g} GPU free now)"
    return text


def _where(node_of_bundle: list[int]) -> str:
    """'node 0' when every bundle is on node 0, else 'node 0: bundles 0, 1; node 1: bundle 2'."""
    nodes = list(dict.fromkeys(node_of_bundle))
    if len(nodes) == 1:
        return f"node {nodes[0]}"
    parts = []
    for node in nodes:
        bundles = [str(index) for index, where in enumerate(node_of_bundle) if where == node]
        parts.append(f"node {node}: bundle{'s' if len(bundles) > 1 else ''} {', '.join(bundles)}")
    return "; ".join(parts)
