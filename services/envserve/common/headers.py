"""Names of the gRPC metadata envserve's own parts send each other (the client, the judge, the
replica), kept where each of them may import them."""

# A judge's GetState calls carry the digest (rpc.auth.owner_of) of the token its own caller presented,
# so that the replica answers them only for that caller's sessions.
ON_BEHALF = "envserve-on-behalf-of"
