"""TLS credentials of a gRPC service from its config's file paths."""
from __future__ import annotations

from pathlib import Path

import grpc


def server_credentials(config) -> grpc.ServerCredentials | None:
    """TLS from a config's tls_cert_file and tls_key_file (both or neither), with client certificates
    required when it names a tls_client_ca_file; None for plaintext."""
    if not (config.tls_cert_file or config.tls_key_file):
        return None
    if not (config.tls_cert_file and config.tls_key_file):
        raise ValueError("TLS needs both a certificate and a key file")
    pair = (Path(config.tls_key_file).read_bytes(), Path(config.tls_cert_file).read_bytes())
    ca = Path(config.tls_client_ca_file).read_bytes() if config.tls_client_ca_file else None
    return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)
