"""What the framework adapter tests share, importable by name from any test module (a conftest is
not: every folder's conftest.py is a module named `conftest`): the sessions a replica holds
(MonitorService), and an expert that answers a turn like a model would."""
from __future__ import annotations

import grpc

from envserve.v1 import envserve_pb2 as pb
from envserve.v1 import envserve_pb2_grpc as pb_grpc


def live_session_ids(address: str, env_id: str) -> set[str]:
    """The sessions of env_id the replica holds now (MonitorService.ListSessions)."""
    with grpc.insecure_channel(address) as ch:
        reply = pb_grpc.MonitorServiceStub(ch).ListSessions(pb.ListSessionsRequest(env_id=env_id, limit=10000))
    return {s.session_id for s in reply.sessions}


class ExpertPolicy:
    """Plays one episode of a session as a model would: reads the turn's true state (GetState), asks
    the env's expert for the turn's actions and writes them as an answer in the session's format.
    `session` is the adapter's envserve.integrations._common.Session."""

    def __init__(self, session):
        from envserve.client.experts import expert_for
        self.session = session
        self.settings = session.settings()
        self.expert = expert_for(session.env_id)(self.settings)

    def __call__(self) -> str:
        from envserve.client.experts import Truth
        truth = Truth.from_response(self.session.state())
        move = self.expert.act(truth, int(self.settings["max_actions_per_turn"]))
        return self.session.answer(move.actions)
