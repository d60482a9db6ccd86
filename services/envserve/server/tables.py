"""Tables: a two-player game whose seats are separate sessions.

Open with `opponent: "session"` (common.tables) and an even count seats every two
sessions at a table. The game itself is one session of the env opened with `opponent: "self"`,
the host, which plays whichever seat is to move; the seats live here, in the front, and take
turns on it:

- a seat's step plays its move on the host and is answered when it is that seat's turn again
  (the other seat has moved) or the game is over, so each seat sees only its own turns;
- seat 0's reset starts a new game; seat 1's is answered at its first turn of the next game;
- a move the game rejects, or a call out of turn, is answered at once, and the turn stays;
- a seat's result is its own move's (reward, parsed actions, feedback) with the observation of
  its next turn, and at the game's end its own seat's reward and success.

Seats cannot be forked or moved to another replica; when the host ends (closed, expired, lost
with its worker) a waiting seat is answered with the reason.
"""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

from google.protobuf import json_format

from envserve.common.tables import SELF_PLAY_OPPONENT, SEATS_PER_TABLE, count_problem
from envserve.rpc.values import code_number, json_text
from envserve.v1 import envserve_pb2 as pb

from . import convert

OK = 0


@dataclass
class Seat:
    sid: str
    index: int
    # The answer this seat waits for (its last step's or reset's), resolved with a StepResult.
    waiter: "asyncio.Future | None" = None
    # The result of this seat's own last move, kept until its next turn's observation arrives.
    own: "pb.StepResult | None" = None
    # Whether the waiting call is a reset, which waits for the next game rather than this one.
    joining: bool = False
    # A result for this seat that arrived while it was not waiting (its first turn of a game it
    # had not joined yet), with the game's number.
    mail: "tuple[int, pb.StepResult] | None" = None
    left: bool = False


@dataclass
class Table:
    host: str
    seats: list[Seat]
    owner: str
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    games: int = 0          # games started (host resets)
    to_move: "int | None" = None
    over: bool = True
    # Why the table is over for good (a seat left), answered to the other seat's calls.
    ended: str = ""


def _error(sid: str, code: str, message: str) -> pb.StepResult:
    return convert.error_result(sid, code, message)


def _info(r: pb.StepResult) -> dict:
    if r.info_json:
        return json.loads(r.info_json)
    return json_format.MessageToDict(r.info) if r.HasField("info") else {}


class Tables:
    """The tables of one replica; `replica` is the Replica whose sessions host them."""

    def __init__(self, replica) -> None:
        self.r = replica
        self.by_seat: dict[str, tuple[Table, Seat]] = {}
        self.by_host: dict[str, Table] = {}
        # Whether any served env has seats: streams then take the path that can answer late.
        self.possible = any(s.seats > 1 for s in replica.specs.values())

    # -- opening and closing ------------------------------------------------------------------
    async def open(self, env_id: str, count: int, config: dict, action_format: str, owner: str,
                   refused) -> tuple[list[str], str]:
        spec = self.r.specs.get(env_id)
        if spec is not None and spec.seats != SEATS_PER_TABLE:
            raise refused("INVALID_ARGUMENT", f"opponent 'session' seats the players of a two-player game at a "
                                              f"table; {env_id} has {spec.seats} player(s)")
        if count_problem(count or 1):
            raise refused("INVALID_ARGUMENT", count_problem(count or 1))
        hosts, prompt = await self.r.open(env_id, count // SEATS_PER_TABLE, {**config, "opponent": SELF_PLAY_OPPONENT},
                                          action_format, owner)
        ids: list[str] = []
        for host in hosts:
            seats = [Seat(self.r.new_session_id(), k) for k in range(SEATS_PER_TABLE)]
            table = Table(host, seats, owner)
            self.by_host[host] = table
            for seat in seats:
                self.by_seat[seat.sid] = (table, seat)
                ids.append(seat.sid)
        return ids, prompt

    def find(self, sid: str, owner: "str | None") -> "tuple[Table | None, Seat | None, str, str]":
        got = self.by_seat.get(sid)
        if got is None:
            return None, None, "NOT_FOUND", f"unknown session {sid!r}"
        table, seat = got
        if owner is not None and table.owner != owner:
            return None, None, "PERMISSION_DENIED", f"session {sid!r} belongs to another token"
        return table, seat, "", ""

    def leave(self, sid: str, owner: "str | None") -> "tuple[pb.ItemStatus, str | None]":
        """A seat's Close: (its status, the host id to close once every seat has left)."""
        table, seat, code, message = self.find(sid, owner)
        if table is None:
            return pb.ItemStatus(code=code_number(code), message=message), None
        seat.left = True
        table.ended = f"Player {seat.index} left the table"
        del self.by_seat[sid]
        for other in table.seats:
            if other is not seat:
                self._answer(other, _error(other.sid, "ABORTED", f"Player {seat.index} left the table"))
        if all(s.left for s in table.seats):
            self.by_host.pop(table.host, None)
            return pb.ItemStatus(code=OK), table.host
        return pb.ItemStatus(code=OK), None

    def host_ended(self, host: str, code: str, reason: str) -> list[str]:
        """The host session is gone: its waiting seats are answered and the seats forgotten.
        Returns the seat ids (the caller records them as lost where the host was)."""
        table = self.by_host.pop(host, None)
        if table is None:
            return []
        for seat in table.seats:
            self.by_seat.pop(seat.sid, None)
            self._answer(seat, _error(seat.sid, code, reason))
        return [s.sid for s in table.seats]

    # -- turns -------------------------------------------------------------------------------
    def alone_at_table(self, sids: list[str]) -> list[bool]:
        """Whether each seat is the only one of its table among sids. A call answers at its seat's
        next turn, which needs the other seat's move: two seats of a table in one unary batch
        would wait for each other, so both are refused."""
        hosts = [self.by_seat[sid][0].host for sid in sids]
        return [hosts.count(h) == 1 for h in hosts]

    async def refuse_shared_batch(self, sid: str) -> bytes:
        return _error(sid, "INVALID_ARGUMENT", "two seats of one table in one batch would wait for each other: "
                                               "send each seat's calls on its own (a stream, another thread)"
                      ).SerializeToString()

    async def run(self, item: tuple, owner: "str | None" = "") -> bytes:
        """A step or reset item of a seat -> its serialized StepResult, answered at its turn."""
        sid = item[1]
        table, seat, code, message = self.find(sid, owner)
        if table is None:
            return _error(sid, code, message).SerializeToString()
        if table.ended:
            return _error(sid, "ABORTED", table.ended).SerializeToString()
        async with table.lock:
            if seat.waiter is not None and not seat.waiter.done():
                return _error(sid, "FAILED_PRECONDITION", "this seat already has a call waiting for its turn"
                              ).SerializeToString()
            now = await (self._reset(table, seat, item) if item[0] == "reset" else self._step(table, seat, item))
            if now is None:
                seat.waiter = asyncio.get_running_loop().create_future()
            waiter = seat.waiter
        if now is not None:
            return now.SerializeToString()
        try:
            result = await waiter
        finally:
            if seat.waiter is waiter:  # answered, or its caller went away
                seat.waiter, seat.joining = None, False
        return result.SerializeToString()

    async def _host(self, table: Table, item: tuple) -> pb.StepResult:
        element = (await self.r.run_elements([(item[0], table.host, *item[2:])], None))[0]
        return pb.BatchResponse.FromString(element).results[0]

    async def _reset(self, table: Table, seat: Seat, item: tuple) -> "pb.StepResult | None":
        seat.own = None
        if seat.index != 0:
            # Seat 1 joins the game seat 0 has started (and it has not yet seen) or starts next:
            # its answer is its first turn, or the end if the game ended before it joined.
            mail, seat.mail = seat.mail, None
            if mail is not None and mail[0] == table.games:
                return mail[1]
            seat.joining = True
            return None
        r = await self._host(table, item)
        if r.status.code != OK:
            return self._as(seat, r)
        # A new game under a seat still waiting on a turn of the last one: that call ends here.
        for other in table.seats:
            other.mail = None
            if other is not seat and not other.joining:
                self._answer(other, _error(other.sid, "ABORTED", "Player 0 started a new game; reset to join it"))
        table.games += 1
        return self._after(table, seat, r, mover=None)

    async def _step(self, table: Table, seat: Seat, item: tuple) -> "pb.StepResult | None":
        if table.over or table.to_move != seat.index:
            why = "the game is over; reset to play again" if table.over else f"it is Player {table.to_move}'s turn"
            return _error(seat.sid, "FAILED_PRECONDITION", f"not this seat's turn: {why}")
        r = await self._host(table, item)
        if r.status.code != OK:
            return self._as(seat, r)
        seat.own = r
        return self._after(table, seat, r, mover=seat)

    def _after(self, table: Table, seat: Seat, r: pb.StepResult, mover: "Seat | None") -> "pb.StepResult | None":
        """Records the host's turn r and hands it to whoever is to move; the calling seat's
        answer if it is now (its own turn again, or the end), else None (it waits)."""
        info = _info(r)
        table.over = r.done or r.truncated
        seat_to_move = info.get("seat_to_move")  # a Struct number: a float
        table.to_move = None if table.over or seat_to_move is None else int(seat_to_move)
        mine: "pb.StepResult | None" = None
        for s in table.seats:
            if table.over or table.to_move == s.index:
                out = self._turn_of(s, r, info)
                if s is seat:
                    mine = out
                else:
                    self._answer(s, out, table.games)
        if mover is not None and mine is None and not table.over and table.to_move is None:
            mine = self._as(seat, r)  # a game that names no seat to move: nobody waits forever
        return mine

    def _turn_of(self, seat: Seat, r: pb.StepResult, info: dict) -> pb.StepResult:
        """Seat's answer at this host turn: its own last move's result (if it moved) with r's
        observation and, at the end, its own reward and success."""
        base, seat.own = seat.own, None
        out = pb.StepResult()
        out.CopyFrom(r)
        if base is None:  # a reset's answer, or seat 1's first turn: nothing of its own yet
            out.reward = 0.0
            out.reward_components.clear()
            del out.parsed_actions[:]
            out.reasoning.clear()
            out.feedback, out.transition, out.actions_executed, out.action_valid = "", "", 0, True
        elif base is not r:  # its move, then the other seat's: its own result, the new observation
            out.CopyFrom(base)
            out.observation.CopyFrom(r.observation)
            out.info.CopyFrom(r.info)
            out.anchor, out.turn, out.episode, out.trial = r.anchor, r.turn, r.episode, r.trial
            out.done, out.truncated = r.done, r.truncated
        out.session_id = seat.sid
        out.info["seat"] = seat.index
        out.info_json = json_text({**_info(r), "seat": seat.index})
        key = str(seat.index)
        if r.done and base is not r:
            # The game ended on the other seat's move: this seat's share of it.
            game = float(info.get("rewards", {}).get(key, 0.0))
            out.reward_components["game"] = out.reward_components.get("game", 0.0) + game
            out.reward = sum(out.reward_components.values())
            out.success = bool(info.get("successes", {}).get(key, False))
        return out

    def _as(self, seat: Seat, r: pb.StepResult) -> pb.StepResult:
        out = pb.StepResult()
        out.CopyFrom(r)
        out.session_id = seat.sid
        return out

    def _answer(self, seat: Seat, result: pb.StepResult, game: int = 0) -> None:
        if seat.waiter is not None and not seat.waiter.done():
            seat.joining = False
            seat.waiter.set_result(result)
        elif result.status.code == OK:
            seat.mail = (game, result)
