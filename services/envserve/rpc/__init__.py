"""What the replica server and the judge service share as gRPC services: bearer-token auth, TLS
credentials, the Prometheus endpoint, status codes and Struct values. Depends on nothing in envserve."""
