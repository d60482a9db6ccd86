"""Bearer tokens. A session belongs to the token that opened it; the ground-truth services
(StateService, MonitorService) can require their own tokens so a policy cannot read the truth."""
from __future__ import annotations

import hashlib
from pathlib import Path

import grpc

BEARER = "bearer "


def owner_of(token: str) -> str:
    # Session records keep a digest, never the token itself.
    return hashlib.blake2b(token.encode(), digest_size=12).hexdigest()


def read_tokens(path: str = "", inline: str = "") -> tuple[str, ...]:
    """Tokens from a file (one per line, '#' comments) and/or a comma-separated string."""
    found: list[str] = []
    if path:
        for line in Path(path).read_text().splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                found.append(line)
    found += [t.strip() for t in inline.split(",") if t.strip()]
    return tuple(dict.fromkeys(found))


class Denied(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


class Authenticator:
    # Tokens are kept as their digests: a presented token is hashed once and looked up, which
    # takes the same time whichever token it is, and no token is compared byte by byte.
    def __init__(self, tokens=(), state_tokens=()):
        self.owners = {owner_of(t) for t in tokens}
        self.state_owners = {owner_of(t) for t in state_tokens}

    @property
    def enabled(self) -> bool:
        return bool(self.owners)

    @staticmethod
    def bearer(context) -> str | None:
        for key, value in context.invocation_metadata() or ():
            if key == "authorization":
                if isinstance(value, bytes):
                    value = value.decode(errors="replace")
                return value[len(BEARER):].strip() if value.lower().startswith(BEARER) else None
        return None

    def env_owner(self, context) -> str:
        """The caller's owner id for EnvService; "" when auth is off. Raises Denied."""
        if not self.owners:
            return ""
        token = self.bearer(context)
        if token is None:
            raise Denied(grpc.StatusCode.UNAUTHENTICATED,
                         "missing bearer token: send metadata 'authorization: Bearer <token>'")
        owner = owner_of(token)
        if owner not in self.owners:
            if owner in self.state_owners:
                raise Denied(grpc.StatusCode.PERMISSION_DENIED,
                             "a state token reads ground truth only; EnvService needs a session token")
            raise Denied(grpc.StatusCode.UNAUTHENTICATED, "invalid bearer token")
        return owner

    def state_owner(self, context) -> str | None:
        """For StateService/MonitorService: None means 'may read every session' (a state token,
        or no auth at all); an owner id means only that owner's sessions. Raises Denied."""
        if self.state_owners:
            token = self.bearer(context)
            if token is None:
                raise Denied(grpc.StatusCode.UNAUTHENTICATED, "StateService needs its bearer token")
            owner = owner_of(token)
            if owner in self.state_owners:
                return None
            if owner in self.owners:
                raise Denied(grpc.StatusCode.PERMISSION_DENIED,
                             "StateService requires a state token; session tokens cannot read ground truth")
            raise Denied(grpc.StatusCode.UNAUTHENTICATED, "invalid bearer token")
        if self.owners:
            return self.env_owner(context)
        return None
