"""Defaults of what envserve's HTTP fronts accept (the facade, a replica's OpenEnv endpoint, `up
--http-port`): the server's config, the facade's limits and the command line take them from here."""

MAX_BODY_BYTES = 64 * 1024 * 1024  # a request body or WebSocket message; as the replicas' max gRPC message
MAX_JSON_DEPTH = 64  # the protocol's messages nest five deep; env configs a few more
OPENENV_MAX_HTTP_SESSIONS = 10_000  # OpenEnv sessions opened over plain HTTP; as a replica's --max-sessions
TOKEN_CACHE_ENTRIES = 1024  # callers' tokens whose batchers are kept between calls
MCP_MAX_SESSIONS = 10_000  # MCP sessions an endpoint holds at once (each an envserve session); as --max-sessions
