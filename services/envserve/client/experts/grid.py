"""Experts of the grid games: search for Sokoban and FrozenLake, deduction for Minesweeper."""
from __future__ import annotations

import collections
import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from .base import CONTINUE, EXPLORE, PLAN, Expert, Move, Truth, cell, cells, rc, relation_text

MOVES = {"Up": (-1, 0), "Down": (1, 0), "Left": (0, -1), "Right": (0, 1)}


def _path(seen: dict, node) -> list[str]:
    path = []
    while seen[node] is not None:
        node, move = seen[node]
        path.append(move)
    return path[::-1]


def plan_sokoban(state: dict) -> list[str]:
    """Breadth-first search over (player, boxes): the fewest moves that put every box on a target
    ([] when none exists). VAGEN's rooms (6x6, one box) solve in milliseconds."""
    walls = {(r, c) for r, row in enumerate(state["grid"]) for c, ch in enumerate(row) if ch == "#"}
    targets = frozenset(cells(state["targets"]))
    start = (cell(state["player"]), frozenset(cells(state["boxes"])))
    seen, queue = {start: None}, collections.deque([start])
    while queue:
        node = queue.popleft()
        player, boxes = node
        if boxes <= targets:
            return _path(seen, node)
        for move, (dr, dc) in MOVES.items():
            nxt = (player[0] + dr, player[1] + dc)
            if nxt in walls:
                continue
            new_boxes = boxes
            if nxt in boxes:
                beyond = (nxt[0] + dr, nxt[1] + dc)
                if beyond in walls or beyond in boxes:
                    continue
                new_boxes = (boxes - {nxt}) | {beyond}
            child = (nxt, frozenset(new_boxes))
            if child not in seen:
                seen[child] = (node, move)
                queue.append(child)
    return []


def plan_frozenlake(state: dict) -> list[str]:
    """The shortest path from the player to the goal around the holes ([] when the goal is cut off)."""
    rows, cols = (int(v) for v in state.get("dim") or (state["size"], state["size"]))
    holes, goal, start = set(cells(state["holes"])), cell(state["goal"]), cell(state["player"])
    seen, queue = {start: None}, collections.deque([start])
    while queue:
        here = queue.popleft()
        if here == goal:
            return _path(seen, here)
        for move, (dr, dc) in MOVES.items():
            nxt = (here[0] + dr, here[1] + dc)
            if 0 <= nxt[0] < rows and 0 <= nxt[1] < cols and nxt not in holes and nxt not in seen:
                seen[nxt] = (here, move)
                queue.append(nxt)
    return []


def _plan_move(path: list[str], max_actions: int, facts: str, turn: int) -> Move:
    if not path:
        # No solution from here (cannot happen on generated tasks); a harmless move keeps the turn valid.
        return Move(["Up"], f"{facts} No sequence of moves solves this state any more.", CONTINUE)
    now = path[:max_actions]
    left = len(path) - len(now)
    plan = f"{facts} The shortest solution is {len(path)} moves: {', '.join(path)}."
    reasoning = (f"{plan} I make the first {len(now)}." if turn == 0 else
                 f"{facts} {len(path)} moves remain: {', '.join(path)}. Next: {', '.join(now)}"
                 f"{f', then {left} more' if left else ', which finishes it'}.")
    return Move(now, reasoning, PLAN if turn == 0 else CONTINUE, plan=plan)


class SokobanExpert(Expert):
    env_id = "sokoban"

    def act(self, truth: Truth, max_actions: int) -> Move:
        s = truth.state
        boxes = ", ".join(rc(b) for b in cells(s["boxes"]))
        targets = ", ".join(rc(t) for t in cells(s["targets"]))
        facts = f"I am at {rc(cell(s['player']))}; box at {boxes}; target at {targets}."
        return _plan_move(plan_sokoban(s), max_actions, facts, truth.turn)


class FrozenLakeExpert(Expert):
    env_id = "frozenlake"

    def act(self, truth: Truth, max_actions: int) -> Move:
        s = truth.state
        facts = (f"I am at {rc(cell(s['player']))}, the goal is at {rc(cell(s['goal']))} and the holes are at "
                 f"{', '.join(rc(h) for h in cells(s['holes'])) or 'nowhere'}.")
        return _plan_move(plan_frozenlake(s), max_actions, facts, truth.turn)


# The order a neighbour expert tries moves in: towards the goal's corner first.
NEIGHBOUR_ORDER = ("Down", "Right", "Left", "Up")
AROUND = {"Down": "below me", "Right": "right of me", "Left": "left of me", "Up": "above me"}


def neighbour_move(around: Mapping[str, str], back: str | None = None) -> tuple[str, str]:
    """(move, why) the neighbour rule picks from what lies each way (move -> "ice", "a hole", "the
    goal" or "the edge"; a move missing counts as unsafe), `back` being the move that returns to the
    cell the player came from. The rule reads nothing else, so an answer's own stated surroundings
    give the move it should make."""
    safe = [m for m in NEIGHBOUR_ORDER if around.get(m) in ("ice", "the goal")]
    onward = [m for m in safe if m != back]
    move = (onward or safe or ["Up"])[0]
    why = ("nothing around me is safe" if not safe else
           f"the way on is {move}" if onward else "only going back is safe")
    return move, why


class FrozenLakeNeighbourExpert(FrozenLakeExpert):
    """One move a turn, chosen from the four cells around the player alone: Down when the cell below
    is ice or the goal, else Right, else Left, else Up, never back to the cell it came from while
    another move is safe. Every move follows from what touches the player, so a policy that reads
    the picture locally can learn it, where the shortest path needs the whole board located. It
    reaches the goal on about 0.96 of random 4x4 maps within 10 moves (the search expert: all)."""

    def __init__(self, settings=None):
        super().__init__(settings)
        self._came_from: tuple[int, int] | None = None

    def _around(self, s: Mapping[str, Any]):
        """(where each move leads, what lies there) for the state `s`."""
        rows, cols = (int(v) for v in s.get("dim") or (s["size"], s["size"]))
        holes, goal, here = set(cells(s["holes"])), cell(s["goal"]), cell(s["player"])

        def target(move: str) -> tuple[int, int]:
            dr, dc = MOVES[move]
            return here[0] + dr, here[1] + dc

        def seen(move: str) -> str:
            r, c = target(move)
            if not (0 <= r < rows and 0 <= c < cols):
                return "the edge"
            return "a hole" if (r, c) in holes else "the goal" if (r, c) == goal else "ice"
        return target, seen

    def surroundings(self, state: Mapping[str, Any]) -> str:
        """What the expert's answers say first: the four cells around the player, e.g. "Below me is
        a hole, right of me is ice, left of me is the edge, above me is the edge" (also the caption a
        vision tower learns to read before SFT: envserve_trainer.rollout.perception)."""
        _, seen = self._around(state)
        facts = ", ".join(f"{AROUND[m]} is {seen(m)}" for m in NEIGHBOUR_ORDER)
        return f"{facts[0].upper()}{facts[1:]}"

    def act(self, truth: Truth, max_actions: int) -> Move:
        target, seen = self._around(truth.state)
        back = next((m for m in NEIGHBOUR_ORDER if target(m) == self._came_from), None)
        move, why = neighbour_move({m: seen(m) for m in NEIGHBOUR_ORDER}, back)
        self._came_from = cell(truth.state["player"])
        return Move([move], f"{self.surroundings(truth.state)}; {why}, so I move {move}.",
                    PLAN if truth.turn == 0 else CONTINUE)


# -- Minesweeper ---------------------------------------------------------------------------------
@dataclass
class Deduction:
    """What the visible board proves: safe hidden cells and mines, each with the reason found first."""
    safe: dict[tuple[int, int], str] = field(default_factory=dict)
    mines: dict[tuple[int, int], str] = field(default_factory=dict)


def _neighbours(r: int, c: int, rows: int, cols: int):
    for dr, dc in itertools.product((-1, 0, 1), repeat=2):
        if (dr or dc) and 0 <= r + dr < rows and 0 <= c + dc < cols:
            yield r + dr, c + dc


def _board(visible: list[str]) -> tuple[int, int, dict[tuple[int, int], int], set[tuple[int, int]]]:
    """(rows, cols, revealed numbers, hidden cells) of the board as the agent sees it."""
    rows, cols = len(visible), len(visible[0]) if visible else 0
    numbers, hidden = {}, set()
    for r, line in enumerate(visible):
        for c, ch in enumerate(line):
            if ch.isdigit():
                numbers[(r, c)] = int(ch)
            else:
                hidden.add((r, c))
    return rows, cols, numbers, hidden


def _constraints(numbers, hidden, rows, cols, known: Deduction):
    """Each number as (unknown hidden neighbours, mines among them, the number's cell)."""
    out = []
    for (r, c), n in numbers.items():
        around = [p for p in _neighbours(r, c, rows, cols) if p in hidden]
        unknown = frozenset(p for p in around if p not in known.mines and p not in known.safe)
        if unknown:
            out.append((unknown, n - sum(1 for p in around if p in known.mines), (r, c)))
    return out


def deduce_minesweeper(visible: list[str], num_mines: int) -> Deduction:
    """The standard rules on the visible board only: a number whose unknown neighbours must all be
    mines (or all safe), subset reasoning between two numbers, and the total mine count."""
    rows, cols, numbers, hidden = _board(visible)
    known = Deduction()
    changed = True
    while changed:
        changed = False
        cons = _constraints(numbers, hidden, rows, cols, known)
        for unknown, need, at in cons:
            if need == 0:
                why = f"{rc(at)} shows {numbers[at]} and already touches {numbers[at]} known mine(s)" \
                    if numbers[at] else f"{rc(at)} shows 0"
                changed |= _mark(known.safe, unknown, why)
            elif need == len(unknown):
                changed |= _mark(known.mines, unknown, f"{rc(at)} shows {numbers[at]} and has exactly that many "
                                                       f"hidden neighbours left")
        if changed:
            continue
        for (a, na, at_a), (b, nb, at_b) in itertools.permutations(cons, 2):
            if a < b:
                rest, extra = b - a, nb - na
                if extra == 0:
                    changed |= _mark(known.safe, rest, f"the mines next to {rc(at_b)} are all among the hidden "
                                                       f"neighbours it shares with {rc(at_a)}")
                elif extra == len(rest):
                    changed |= _mark(known.mines, rest, f"{rc(at_b)} needs {extra} more mine(s) than "
                                                        f"{rc(at_a)} and has exactly {extra} other hidden neighbour(s)")
            if changed:
                break
        if changed:
            continue
        unknown = hidden - known.mines.keys() - known.safe.keys()
        if unknown and len(known.mines) == num_mines:
            changed |= _mark(known.safe, unknown, f"all {num_mines} mines are found")
        elif unknown and len(unknown) == num_mines - len(known.mines):
            changed |= _mark(known.mines, unknown, "the hidden cells left are exactly the mines left")
    return known


def _mark(found: dict, where, why: str) -> bool:
    new = [p for p in sorted(where) if p not in found]
    for p in new:
        found[p] = why
    return bool(new)


def mine_probabilities(visible: list[str], num_mines: int, known: Deduction,
                       max_frontier: int = 24) -> dict[tuple[int, int], float]:
    """Each unknown hidden cell's chance of a mine, every arrangement of the remaining mines that
    agrees with the numbers counted equally. Exact by enumerating the cells next to numbers when
    there are at most `max_frontier` of them; beyond that, each number's local ratio."""
    rows, cols, numbers, hidden = _board(visible)
    cons = _constraints(numbers, hidden, rows, cols, known)
    unknown = sorted(hidden - known.mines.keys() - known.safe.keys())
    frontier = sorted({p for u, _, _ in cons for p in u})
    inner = [p for p in unknown if p not in set(frontier)]
    left = num_mines - len(known.mines)
    if len(frontier) > max_frontier:
        # Too many arrangements to count: a cell next to numbers gets the highest ratio of mines to
        # hidden cells among them, any other the overall density.
        probs = {p: left / max(len(unknown), 1) for p in inner}
        for u, need, _ in cons:
            for p in u:
                probs[p] = max(probs.get(p, 0.0), need / len(u))
        return probs
    index = {p: i for i, p in enumerate(frontier)}
    limits = [([index[p] for p in u], need) for u, need, _ in cons]
    weight_sum, mine_weight, inner_mines = 0.0, [0.0] * len(frontier), 0.0
    assignment = [0] * len(frontier)

    def consistent(upto: int) -> bool:
        for members, need in limits:
            placed = sum(assignment[i] for i in members if i < upto)
            open_ = sum(1 for i in members if i >= upto)
            if placed > need or placed + open_ < need:
                return False
        return True

    def search(i: int, placed: int) -> None:
        nonlocal weight_sum, inner_mines
        if placed > left or not consistent(i):
            return
        if i == len(frontier):
            rest = left - placed
            if rest > len(inner):
                return
            w = float(math.comb(len(inner), rest))
            weight_sum += w
            inner_mines += w * rest
            for j, v in enumerate(assignment):
                if v:
                    mine_weight[j] += w
            return
        for v in (0, 1):
            assignment[i] = v
            search(i + 1, placed + v)
        assignment[i] = 0

    search(0, 0)
    if weight_sum == 0:
        return {p: left / max(len(unknown), 1) for p in unknown}
    probs = {p: mine_weight[i] / weight_sum for i, p in enumerate(frontier)}
    for p in inner:
        probs[p] = inner_mines / weight_sum / len(inner)
    return probs


class MinesweeperExpert(Expert):
    """Plays from the visible board only (GetState's `visible`, never `mines` or `board`)."""
    env_id = "minesweeper"

    def describe(self, truth: Truth) -> str:
        # The relation sentences name only numbers that border hidden cells; say how much is hidden.
        hidden = sum(line.count("?") for line in truth.state["visible"])
        total = int(truth.state["rows"]) * int(truth.state["cols"])
        return " ".join(filter(None, [f"{hidden} of {total} cells are hidden.", relation_text(truth.relations)]))

    def act(self, truth: Truth, max_actions: int) -> Move:
        s = truth.state
        visible = [str(line) for line in s["visible"]]
        num_mines = int(s["num_mines"])
        rows, cols, numbers, hidden = _board(visible)
        if not numbers:
            # The first reveal is always safe; a corner has the fewest neighbours, so it is the
            # likeliest to be a 0 that opens an area.
            plan = ("Nothing is revealed yet and the first reveal is always safe: I open the corner (0, 0), the "
                    "cell most likely to be a 0, then reveal only cells the numbers prove safe.")
            return Move(["(0, 0)"], plan, PLAN if truth.turn == 0 else CONTINUE, plan=plan)
        known = deduce_minesweeper(visible, num_mines)
        if known.safe:
            target, why = next(iter(sorted(known.safe.items())))
            mines = f" Known mines: {', '.join(rc(p) for p in sorted(known.mines))}." if known.mines else ""
            return Move([rc(target)], f"{rc(target)} is safe: {why}.{mines}", CONTINUE)
        probs = mine_probabilities(visible, num_mines, known)
        target = min(sorted(probs), key=lambda p: probs[p])
        if probs[target] <= 1e-12:
            return Move([rc(target)], f"{rc(target)} is safe: every arrangement of the remaining mines that "
                                      f"agrees with the numbers leaves it free.", CONTINUE)
        return Move([rc(target)], f"No hidden cell is certainly safe. {rc(target)} has the lowest chance of a "
                                  f"mine, about {probs[target]:.0%}, so I reveal it.", EXPLORE, guessed=True)
