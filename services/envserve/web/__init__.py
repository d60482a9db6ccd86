"""HTTP access to envserve: a JSON facade over the gRPC services and a live sessions page
(extras `web`: fastapi, uvicorn)."""
from .app import create_app
from .limits import HTTP_STATUS
from .server import serve, start_in_thread

__all__ = ["create_app", "serve", "start_in_thread", "HTTP_STATUS"]
