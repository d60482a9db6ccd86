"""Bearer tokens and what each may do.

A session belongs to the token that opened it. The ground-truth services (StateService,
MonitorService) can require tokens of their own (state tokens), so a policy cannot read the
truth; a state token reads a session only where the session's owner granted it (by the state
token's name, at Open or in the owner's token entry), unless the operator lets it read all.

A token entry is the token, optionally followed by whitespace-separated `key=value` options:

    T1 name=team-a max_sessions=2000 grants=judge-a
    J1 name=judge-a
    * max_sessions=1000 opens_per_second=500      (defaults for every session token)

Session-token options: name, max_sessions, max_in_flight, opens_per_second and open_burst (quotas
per replica) and grants (a state token's name; repeat the key for several). State-token options: name and
reads=* (reads every session). A token without a name is known by a digest prefix.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from envserve.common.headers import ON_BEHALF

BEARER = "bearer "
DEFAULTS_ENTRY = "*"
QUOTA_KEYS = ("max_sessions", "max_in_flight", "opens_per_second", "open_burst")
SESSION_KEYS = ("name", "grants", *QUOTA_KEYS)
STATE_KEYS = ("name", "reads")


def owner_of(token: str) -> str:
    # Session records keep a digest, never the token itself.
    return hashlib.blake2b(token.encode(), digest_size=12).hexdigest()


def read_token_entries(path: str = "", inline: str = "") -> tuple[str, ...]:
    """Token entries (a token and its options) from a file (one per line, '#' comments) and/or a
    comma-separated string, in order, without repeats."""
    found: list[str] = []
    if path:
        for line in Path(path).read_text().splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                found.append(" ".join(line.split()))
    found += [" ".join(t.split()) for t in inline.split(",") if t.strip()]
    return tuple(dict.fromkeys(found))


def read_tokens(path: str = "", inline: str = "") -> tuple[str, ...]:
    """The tokens alone (what a client sends), without their options or the defaults entry."""
    return tuple(dict.fromkeys(e.split()[0] for e in read_token_entries(path, inline)
                               if e.split()[0] != DEFAULTS_ENTRY))


class TokenFileError(ValueError):
    """A token entry the server cannot use; the message names the entry by its name or position."""


@dataclass(frozen=True)
class Quota:
    """Limits on one token's use of a replica; None: no limit of that kind."""
    max_sessions: int | None = None
    max_in_flight: int | None = None
    opens_per_second: float | None = None
    open_burst: int | None = None    # sessions opened at once before opens_per_second applies


@dataclass(frozen=True)
class TokenPolicy:
    owner: str                 # the token's digest
    name: str
    quota: Quota = Quota()
    grants: frozenset[str] = frozenset()   # state-token names that read this token's sessions
    reads_all: bool = False    # a state token the operator lets read every session


@dataclass(frozen=True)
class Reader:
    """Who asks StateService or MonitorService: a session token (reads its own sessions), a state
    token (by its name, where granted; every session with reads_all), or anyone (auth off)."""
    owner: str | None = None   # a session token's digest
    name: str = ""             # a state token's name
    reads_all: bool = False
    on_behalf: str | None = None   # a judge's caller (ON_BEHALF): only that caller's sessions

    def may_read(self, session_owner: str, session_readers: frozenset[str]) -> bool:
        if self.on_behalf is not None and self.on_behalf != session_owner:
            return False
        if self.reads_all:
            return True
        if self.owner is not None:
            return self.owner == session_owner
        return bool(self.name) and self.name in session_readers


EVERYONE = Reader(reads_all=True)


def _options(entry: str, allowed: tuple[str, ...], where: str) -> tuple[str, dict]:
    token, *pairs = entry.split()
    options: dict = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not value:
            raise TokenFileError(f"{where}: option {pair!r} is not key=value")
        if key not in allowed:
            raise TokenFileError(f"{where}: unknown option {key!r}; known: {', '.join(allowed)}")
        if key == "grants":
            options.setdefault("grants", set()).add(value)
        elif key in options:
            raise TokenFileError(f"{where}: option {key!r} given twice")
        else:
            options[key] = value
    return token, options


def _quota(options: dict, where: str) -> dict:
    out = {}
    for key in QUOTA_KEYS:
        if key not in options:
            continue
        try:
            value = float(options[key]) if key == "opens_per_second" else int(options[key])
        except ValueError:
            raise TokenFileError(f"{where}: {key} must be a number, got {options[key]!r}") from None
        if not value > 0:
            raise TokenFileError(f"{where}: {key} must be above 0, got {options[key]}")
        out[key] = value
    return out


def parse_policies(entries=(), state_entries=()) -> tuple[dict[str, TokenPolicy], dict[str, TokenPolicy], Quota]:
    """Session tokens' and state tokens' policies by digest, and the defaults entry's quota."""
    sessions: dict[str, TokenPolicy] = {}
    states: dict[str, TokenPolicy] = {}
    defaults: dict = {}
    names: dict[str, str] = {}
    for kind, source, allowed, out in (("token", entries, SESSION_KEYS, sessions),
                                       ("state token", state_entries, STATE_KEYS, states)):
        for i, entry in enumerate(source, 1):
            where = f"{kind} entry {i}"
            token, options = _options(entry, allowed if entry.split()[0] != DEFAULTS_ENTRY else QUOTA_KEYS, where)
            if token == DEFAULTS_ENTRY:
                if kind != "token":
                    raise TokenFileError(f"{where}: defaults ('*') apply to session tokens only")
                defaults.update(_quota(options, "defaults entry"))
                continue
            owner = owner_of(token)
            name = options.get("name") or f"token-{owner[:8]}"
            where = f"{kind} {name!r}"
            if names.get(name, owner) != owner:
                raise TokenFileError(f"{where}: two tokens share the name {name!r}")
            names[name] = owner
            reads = options.get("reads", "")
            if reads not in ("", "*"):
                raise TokenFileError(f"{where}: reads takes '*' (every session), got {reads!r}")
            out[owner] = TokenPolicy(owner=owner, name=name, quota=Quota(**_quota(options, where)),
                                     grants=frozenset(options.get("grants", ())), reads_all=reads == "*")
    return sessions, states, Quota(**defaults)


class Denied(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


@dataclass
class Authenticator:
    """Checks a call's bearer token. Tokens are kept as their digests: a presented token is hashed
    once and looked up, which takes the same time whichever token it is, and no token is compared
    byte by byte. tokens and state_tokens are token entries (read_token_entries)."""
    tokens: tuple = ()
    state_tokens: tuple = ()
    policies: dict = field(init=False)
    state_policies: dict = field(init=False)
    default_quota: Quota = field(init=False)

    def __post_init__(self):
        self.policies, self.state_policies, self.default_quota = parse_policies(self.tokens, self.state_tokens)

    @property
    def owners(self) -> set[str]:
        return set(self.policies)

    @property
    def enabled(self) -> bool:
        return bool(self.policies)

    def policy(self, owner: str) -> TokenPolicy | None:
        return self.policies.get(owner)

    def name_of(self, owner: str) -> str:
        p = self.policies.get(owner)
        return p.name if p is not None else "anonymous"

    def state_names(self) -> set[str]:
        return {p.name for p in self.state_policies.values()}

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
        if not self.policies:
            return ""
        token = self.bearer(context)
        if token is None:
            raise Denied(grpc.StatusCode.UNAUTHENTICATED,
                         "missing bearer token: send metadata 'authorization: Bearer <token>'")
        owner = owner_of(token)
        if owner not in self.policies:
            if owner in self.state_policies:
                raise Denied(grpc.StatusCode.PERMISSION_DENIED,
                             "a state token reads ground truth only; EnvService needs a session token")
            raise Denied(grpc.StatusCode.UNAUTHENTICATED, "invalid bearer token")
        return owner

    def reader(self, context) -> Reader:
        """For StateService/MonitorService: who reads, and so which sessions it may read. Without
        state tokens a session token reads its own sessions; without any token everyone reads
        everything. Raises Denied."""
        if self.state_policies:
            token = self.bearer(context)
            if token is None:
                raise Denied(grpc.StatusCode.UNAUTHENTICATED, "StateService needs its bearer token")
            owner = owner_of(token)
            p = self.state_policies.get(owner)
            if p is not None:
                return Reader(name=p.name, reads_all=p.reads_all, on_behalf=self.on_behalf(context))
            if owner in self.policies:
                raise Denied(grpc.StatusCode.PERMISSION_DENIED,
                             "StateService requires a state token; session tokens cannot read ground truth")
            raise Denied(grpc.StatusCode.UNAUTHENTICATED, "invalid bearer token")
        if self.policies:
            return Reader(owner=self.env_owner(context))
        return EVERYONE

    @staticmethod
    def on_behalf(context) -> str | None:
        for key, value in context.invocation_metadata() or ():
            if key == ON_BEHALF:
                return value.decode(errors="replace") if isinstance(value, bytes) else value
        return None

    def readers_for(self, owner: str, requested=()) -> frozenset[str]:
        """The state-token names that may read a session `owner` opens: its entry's standing grants
        and those named at Open. Raises Denied for a name no state token has."""
        requested = frozenset(requested)
        unknown = requested - self.state_names()
        if unknown:
            known = sorted(self.state_names())
            raise Denied(grpc.StatusCode.INVALID_ARGUMENT,
                         f"state_readers names no state token here: {sorted(unknown)}"
                         + (f"; state tokens: {known}" if known else "; this replica has no state tokens"))
        p = self.policies.get(owner)
        return requested | (p.grants if p is not None else frozenset())
