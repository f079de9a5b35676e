"""pigeon.core.metadata's write planner, without a server.

``TreePlanner`` (memory_backend.py) is the smallest backend: its snapshot is a dict of
nodes, sequential counters and child counts, and it emits neutral effects.  Planning
random writes on random trees through the read-on-demand loop and applying the effects
must give what ``Model`` (the contract written out plainly) gives, error for error.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from memory_backend import ABSENT, Node, TreePlanner, TreeSnapshot

from pigeon.core.errors import (
    BadVersion,
    InvalidArgument,
    NodeExists,
    NoSuchNode,
    NotEmpty,
    PigeonError,
    SessionExpired,
)
from pigeon.core.metadata import (
    SEQUENCE_DIGITS,
    Create,
    Delete,
    NeedRead,
    Op,
    StaleRead,
    WriteOp,
    first_reads,
    parent_path,
)

# --- the contract, written out plainly ------------------------------------------------------


@dataclass
class State:
    nodes: dict[str, tuple[bytes, int, bool]]  # path → (value, version, ephemeral)
    counters: dict[str, int]  # parent → next sequence number (absent: 0)

    def children(self, path: str) -> list[str]:
        prefix = "/" if path == "/" else path + "/"
        return [
            p
            for p in self.nodes
            if p.startswith(prefix) and "/" not in p[len(prefix) :] and p != "/"
        ]

    def remove_tree(self, path: str) -> None:
        for p in [p for p in self.nodes if p == path or p.startswith(path + "/")]:
            del self.nodes[p]
        for p in [p for p in self.counters if p == path or p.startswith(path + "/")]:
            del self.counters[p]


class Model:
    def __init__(self, state: State, session: bool) -> None:
        self.s = copy.deepcopy(state)
        self.session = session

    def run(self, ops: list[WriteOp]) -> list[object]:
        results: list[object] = []
        for op in ops:
            if isinstance(op, Create):
                results.append(self.create(op.path, op.value, op.ephemeral, op.sequential))
            elif isinstance(op, Delete):
                self.delete(op.path, op.version, op.recursive)
                results.append(None)
            elif op.kind.value == "create":
                results.append(self.create(op.path, op.value, op.ephemeral, False))
            elif op.kind.value == "set":
                results.append(self.set(op.path, op.value, op.version))
            elif op.kind.value == "delete":
                self.delete(op.path, op.version, False)
                results.append(None)
            else:
                self.existing(op.path, op.version)
                results.append(None)
        return results

    def existing(self, path: str, version: int | None) -> int:
        if path not in self.s.nodes:
            raise NoSuchNode(path)
        current = self.s.nodes[path][1]
        if version is not None and version != current:
            raise BadVersion(f"{path}: version is {current}, expected {version}")
        return current

    def create(self, path: str, value: bytes, ephemeral: bool, sequential: bool) -> str:
        if path == "/" and not sequential:
            raise NodeExists("/")
        parent = parent_path(path + "0" if sequential else path)
        if ephemeral and not self.session:
            raise SessionExpired("the metadata session expired; call new_session()")
        missing = []
        node = parent
        while node != "/" and node not in self.s.nodes:
            missing.append(node)
            node = parent_path(node)
        if node != "/" and self.s.nodes[node][2]:
            raise InvalidArgument(f"{node!r} is ephemeral and cannot have children")
        if sequential:
            number = self.s.counters.get(parent, 0)
            path = f"{path}{number:0{SEQUENCE_DIGITS}d}"
            if path in self.s.nodes:
                raise StaleRead(f"sequential node {path} exists already")
            self.s.counters[parent] = number + 1
        elif path in self.s.nodes:
            raise NodeExists(path)
        for ancestor in reversed(missing):
            self.s.nodes[ancestor] = (b"", 0, False)
        self.s.nodes[path] = (value, 0, ephemeral)
        return path

    def set(self, path: str, value: bytes, version: int | None) -> int:
        current = self.existing(path, version)
        self.s.nodes[path] = (value, current + 1, self.s.nodes[path][2])
        return current + 1

    def delete(self, path: str, version: int | None, recursive: bool) -> None:
        if path == "/":
            raise InvalidArgument("the root node cannot be deleted")
        self.existing(path, version)
        if self.s.children(path) and not recursive:
            raise NotEmpty(path)
        self.s.remove_tree(path)


def apply(state: State, effects: list[tuple[Any, ...]]) -> State:
    out = copy.deepcopy(state)
    for effect in effects:
        kind, path = effect[0], effect[1]
        if kind == "create":
            out.nodes[path] = (effect[2], 0, effect[3])
        elif kind == "number":
            out.counters[path] = effect[2] + 1
        elif kind == "set":
            _, version, ephemeral = out.nodes[path]
            out.nodes[path] = (effect[2], version + 1, ephemeral)
        elif kind == "delete":
            out.remove_tree(path)
    return out


def read(state: State, need: NeedRead, snap: TreeSnapshot) -> None:
    """What a backend's read does: fill the snapshot from the store's state."""
    for path in need.nodes:
        if path in state.nodes:
            snap.nodes[path] = Node(True, state.nodes[path][1], state.nodes[path][2])
        else:
            snap.nodes[path] = ABSENT
    for path in need.counters:
        snap.counters[path] = state.counters.get(path, 0)
    for path in need.children:
        snap.children[path] = len(state.children(path))


def plan_reading(
    state: State, ops: list[WriteOp], *, session: bool = True
) -> tuple[TreePlanner, list[object], int]:
    """Plan ``ops`` on ``state`` as a store does: first reads, then what NeedRead asks."""
    snap = TreeSnapshot()
    need = first_reads(ops, children_of_deletes=True)
    for rounds in range(1, 20):
        asked = len(need.nodes - snap.nodes.keys()) + len(need.counters - snap.counters.keys())
        asked += len(need.children - snap.children.keys())
        assert asked or rounds == 1, "NeedRead asked only for what the snapshot has"
        read(state, need, snap)
        planner = TreePlanner(
            TreeSnapshot(dict(snap.nodes), dict(snap.counters), dict(snap.children)),
            session=session,
        )
        try:
            return planner, planner.plan(ops), rounds
        except NeedRead as more:
            need = more
    raise AssertionError("planning did not converge")


# --- random trees and writes ----------------------------------------------------------------

NAMES = ["a", "b", "q-0000000000"]
PATHS = [f"/{a}" for a in NAMES] + [f"/{a}/{b}" for a in NAMES[:2] for b in NAMES]
PATHS += [f"/a/a/{c}" for c in NAMES]
OP_PATHS = ["/", *PATHS, "/c/d"]
PREFIXES = ["/q-", "/a/q-", "/a/", "/a/a/q-", "/c/d/q-"]


@st.composite
def states(draw: st.DrawFn) -> State:
    chosen = draw(st.sets(st.sampled_from(PATHS)))
    paths = set(chosen)
    for path in chosen:
        while (path := parent_path(path)) != "/":
            paths.add(path)
    nodes = {"/": (b"", draw(st.integers(0, 2)), False)}
    for path in sorted(paths):
        leaf = not any(p.startswith(path + "/") for p in paths)
        nodes[path] = (b"old", draw(st.integers(0, 2)), leaf and draw(st.booleans()))
    counters = {p: draw(st.integers(0, 2)) for p in draw(st.sets(st.sampled_from(["/", *paths])))}
    return State(nodes, counters)


versions = st.none() | st.integers(0, 2)
one_op = st.one_of(
    st.builds(Op.create, st.sampled_from(OP_PATHS), st.just(b"v"), st.booleans()),
    st.builds(Create, st.sampled_from(PREFIXES), st.just(b"s"), st.booleans(), st.just(True)),
    st.builds(Op.set, st.sampled_from(OP_PATHS), st.just(b"x"), versions),
    st.builds(Op.delete, st.sampled_from(OP_PATHS), versions),
    st.builds(Op.check, st.sampled_from(OP_PATHS), versions),
)
writes = st.one_of(
    st.lists(one_op, min_size=1, max_size=5),
    st.builds(lambda p, v: [Delete(p, v, True)], st.sampled_from(OP_PATHS[1:]), versions),
)


@settings(max_examples=400, deadline=None)
@given(states(), writes, st.booleans())
def test_planned_writes_do_what_the_contract_says(
    state: State, ops: list[WriteOp], session: bool
) -> None:
    model = Model(state, session)
    try:
        expected: object = model.run(ops)
    except (PigeonError, StaleRead) as exc:
        expected = exc
    try:
        planner, results, _ = plan_reading(state, ops, session=session)
    except (PigeonError, StaleRead) as exc:
        assert isinstance(expected, Exception), f"planner raised {exc!r}, model gave {expected}"
        assert (type(exc), str(exc)) == (type(expected), str(expected))
        return
    assert results == expected
    assert apply(state, planner.effects) == model.s


@settings(max_examples=200, deadline=None)
@given(states(), st.lists(one_op, min_size=1, max_size=5))
def test_reads_are_few_and_relied_on_reads_are_in_the_snapshot(
    state: State, ops: list[WriteOp]
) -> None:
    try:
        planner, _, rounds = plan_reading(state, ops)
    except (PigeonError, StaleRead):
        return
    # first reads; then per op at most the ancestors of a create and a sequential node
    assert rounds <= 1 + 2 * len(ops)
    assert set(planner.relied) <= planner.snapshot.nodes.keys()


# --- single behaviours ------------------------------------------------------------------------


def test_first_reads() -> None:
    ops: list[WriteOp] = [
        Op.set("/s", b""),
        Create("/a/b/q-", sequential=True),
        Op.delete("/d"),
        Delete("/r", recursive=True),
    ]
    need = first_reads(ops)
    assert (need.nodes, need.counters, need.children) == (
        {"/s", "/a/b", "/d", "/r"},
        {"/a/b"},
        set(),
    )
    assert first_reads(ops, children_of_deletes=True).children == {"/d", "/r"}


def test_a_node_is_asked_for_with_its_ancestors() -> None:
    snap = TreeSnapshot(nodes={"/x": ABSENT})
    with pytest.raises(NeedRead) as need:
        TreePlanner(snap).plan([Op.create("/x/y/z")])
    assert need.value.nodes == {"/x/y"}  # "/x" is read already
    snap.nodes["/x/y"] = ABSENT
    planner = TreePlanner(snap)
    assert planner.plan([Op.create("/x/y/z")]) == ["/x/y/z"]
    assert planner.effects == [
        ("create", "/x", b"", False),
        ("create", "/x/y", b"", False),
        ("create", "/x/y/z", b"", False),
    ]
    # below a missing parent nothing exists: "/x/y/z" itself was never read
    assert "/x/y/z" not in snap.nodes


def test_sequential_create_takes_the_next_number_between_parents_and_node() -> None:
    snap = TreeSnapshot(nodes={"/p": ABSENT, "/p/q-0000000001": ABSENT}, counters={"/p": 0})
    planner = TreePlanner(snap)
    assert planner.plan([Create("/p/q-", b"1", sequential=True)] * 2) == [
        "/p/q-0000000000",
        "/p/q-0000000001",
    ]
    assert planner.effects[:3] == [
        ("create", "/p", b"", False),
        ("number", "/p", 0),
        ("create", "/p/q-0000000000", b"1", False),
    ]
    snap = TreeSnapshot(nodes={"/p": Node(True)}, counters={"/p": 10**SEQUENCE_DIGITS})
    with pytest.raises(InvalidArgument, match="exhausted"):
        TreePlanner(snap).plan([Create("/p/q-", sequential=True)])


def test_a_sequential_node_that_exists_means_the_reads_are_stale() -> None:
    snap = TreeSnapshot(nodes={"/p": Node(True), "/p/q-0000000003": Node(True)}, counters={"/p": 3})
    with pytest.raises(StaleRead):
        TreePlanner(snap).plan([Create("/p/q-", sequential=True)])


def test_ops_see_the_ops_before_them() -> None:
    snap = TreeSnapshot(nodes={"/a": ABSENT, "/n": Node(True, 4)}, children={"/n": 0})
    planner = TreePlanner(snap)
    ops: list[WriteOp] = [
        Op.create("/a"),
        Op.set("/a", b"1"),
        Op.set("/a", b"2", version=1),
        Op.check("/a", 2),
        Op.delete("/n", 4),
        Op.create("/n", b"again"),
        Op.check("/n", 0),
    ]
    assert planner.plan(ops) == ["/a", 1, 2, None, None, "/n", None]
    assert planner.relied == ["/a", "/n"]  # read once each, then the overlay has them


def test_the_first_failing_op_wins() -> None:
    snap = TreeSnapshot(
        nodes={"/x": Node(True, 3), "/e": Node(True, 0, ephemeral=True)}, children={"/x": 1}
    )
    with pytest.raises(BadVersion, match="version is 3, expected 2"):
        TreePlanner(snap).plan([Op.set("/x", b"", 2), Op.delete("/x")])
    with pytest.raises(NotEmpty):
        TreePlanner(snap).plan([Op.set("/x", b"", 3), Op.delete("/x")])
    with pytest.raises(InvalidArgument, match="ephemeral"):
        TreePlanner(snap).plan([Op.create("/e/child"), Op.delete("/")])
    with pytest.raises(SessionExpired):
        TreePlanner(snap, session=False).plan([Op.create("/y", ephemeral=True)])
    with pytest.raises(NodeExists):
        TreePlanner(snap).plan([Op.create("/"), Op.set("/nope", b"")])
    with pytest.raises(InvalidArgument, match="root"):
        TreePlanner(snap).plan([Delete("/", recursive=True)])


def test_recursive_delete_does_not_ask_for_children() -> None:
    snap = TreeSnapshot(nodes={"/x": Node(True, 1)})
    planner = TreePlanner(snap)
    assert planner.plan([Delete("/x", 1, recursive=True)]) == [None]
    assert planner.effects == [("delete", "/x", True)]
    with pytest.raises(NeedRead) as need:
        TreePlanner(snap).plan([Delete("/x", 1)])
    assert need.value.children == {"/x"}
