"""Running the judge: its gRPC server (JudgeService, health, reflection), metrics, and its settings.

Settings come from a JSON (or YAML, where PyYAML is installed) file plus command-line overrides:

    {"scoring":  {"f1_threshold": 0.7, ...},              # JudgeConfig
     "llm":      {"base_url": "http://vllm:8000/v1", "model": "Qwen/...", ...},   # LLMJudgeConfig
     "judges":   {"navigation": "llm"},                    # per-env choice
     "fallback": "llm"}                                    # envs the rule judge cannot score

The rule judge is always there (the embedded default); the LLM judge exists when "llm" is given.
"""
from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import grpc
from grpc_health.v1 import health_pb2
from grpc_health.v1._async import HealthServicer

from envserve.rpc.auth import Authenticator
from envserve.rpc.parsing import add_health_and_reflection, add_service
from envserve.rpc.serving import add_port, server_options
from envserve.rpc.tls import server_credentials
from envserve.v1 import envserve_pb2_grpc as pb_grpc

from .base import Judge
from .config import JudgeConfig
from .rule_judge import RuleJudge
from .service import JudgeCore, JudgeMetrics, JudgeSelection, JudgeServicer

log = logging.getLogger("envserve.judge")
SERVICE_NAME = "envserve.v1.JudgeService"


@dataclass
class JudgeServerConfig:
    host: str = "127.0.0.1"
    port: int = 50070
    # Where the ground truth is read: one replica's address, or a directory of replicas.
    env_address: str = ""
    directory_url: str = ""
    state_token: str = ""
    # CA of replicas that serve TLS.
    env_tls_ca_file: str = ""
    scoring: Mapping[str, Any] = field(default_factory=dict)
    llm: Mapping[str, Any] | None = None
    judges: Mapping[str, str] = field(default_factory=dict)
    fallback: str = ""
    max_concurrent_items: int = 64
    # Ground-truth records kept for the reads that share them (grounding of t+1, world modelling of
    # t): at most this many, each dropped once unused for this long.
    truth_cache_records: int = 4096
    truth_cache_seconds: float = 600.0
    metrics_port: int = -1
    metrics_host: str = "127.0.0.1"
    tokens: tuple[str, ...] = ()
    tls_cert_file: str = ""
    tls_key_file: str = ""
    tls_client_ca_file: str = ""

    def __post_init__(self) -> None:
        if bool(self.env_address) == bool(self.directory_url):
            raise ValueError("give exactly one of env_address (HOST:PORT) and directory_url (redis://...)")
        if self.truth_cache_records < 1 or self.truth_cache_seconds <= 0:
            raise ValueError(f"truth_cache_records must be >= 1 and truth_cache_seconds > 0, got "
                             f"{self.truth_cache_records} and {self.truth_cache_seconds}")

    @staticmethod
    def read_file(path: str) -> dict[str, Any]:
        """The settings file as a dict (JSON, or YAML when PyYAML is installed)."""
        text = Path(path).read_text()
        if path.endswith((".yaml", ".yml")):
            try:
                import yaml  # only for YAML files
            except ImportError:
                raise ValueError(f"{path}: YAML settings need PyYAML (pip install pyyaml); "
                                 "or write them as JSON") from None
            data = yaml.safe_load(text) or {}
        else:
            data = json.loads(text or "{}")
        unknown = set(data) - {"scoring", "llm", "judges", "fallback", "max_concurrent_items",
                               "truth_cache_records", "truth_cache_seconds"}
        if unknown:
            raise ValueError(f"{path}: unknown keys {sorted(unknown)}")
        return data


def build_judges(config: JudgeServerConfig) -> tuple[JudgeConfig, dict[str, Judge]]:
    scoring = JudgeConfig.from_mapping(config.scoring)
    judges: dict[str, Judge] = {"rule": RuleJudge(scoring)}
    if config.llm:
        from .llm_judge import LLMJudge, LLMJudgeConfig  # httpx only where an LLM judge is configured
        judges["llm"] = LLMJudge(LLMJudgeConfig.from_mapping(config.llm), scoring)
    return scoring, judges


def truth_source(config: JudgeServerConfig):
    from envserve.client import AsyncEnvClient, AsyncRoutedClient
    root = Path(config.env_tls_ca_file).read_bytes() if config.env_tls_ca_file else None
    if config.env_address:
        return AsyncEnvClient(config.env_address, state_token=config.state_token or None, root_certificates=root)
    return AsyncRoutedClient(config.directory_url, state_token=config.state_token or None, root_certificates=root)


class JudgeServer:
    def __init__(self, config: JudgeServerConfig):
        self.config = config
        self.scoring, self.judges = build_judges(config)
        self.selection = JudgeSelection(self.judges, config.judges, config.fallback)
        self.metrics = JudgeMetrics()
        self.source = None
        self.core: JudgeCore | None = None
        self.server: grpc.aio.Server | None = None
        self.health = HealthServicer()
        self.port = self.metrics_port = 0

    async def start(self) -> int:
        self.source = truth_source(self.config)
        self.core = JudgeCore(self.source, self.selection, self.scoring, self.config.max_concurrent_items,
                              self.metrics, self.config.truth_cache_records, self.config.truth_cache_seconds)
        self.server = grpc.aio.server(options=server_options())
        add_service(pb_grpc.add_JudgeServiceServicer_to_server,
                    JudgeServicer(self.core, Authenticator(self.config.tokens)), self.server)
        add_health_and_reflection(self.server, self.health, (SERVICE_NAME,))
        self.port = add_port(self.server, self.config.host, self.config.port, server_credentials(self.config))
        if self.config.metrics_port >= 0:
            self.metrics_port = self.metrics.serve_http(self.config.metrics_host, self.config.metrics_port)
        await self.server.start()
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        return self.port

    async def stop(self, grace: float = 5.0) -> None:
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        if self.server is not None:
            await self.server.stop(grace)
        for judge in self.judges.values():
            await judge.aclose()
        if self.source is not None:
            await self.source.close()
        self.metrics.close()


async def serve_forever(server: JudgeServer) -> None:
    config = server.config
    await server.start()
    stopped = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopped.set)
    source = config.env_address or config.directory_url
    chosen = ", ".join(f"{env}={name}" for env, name in config.judges.items()) or "rule where it applies"
    extra = f", metrics on :{server.metrics_port}" if server.metrics_port else ""
    print(f"envserve judge on {config.host}:{server.port} (truth from {source}; judges: {chosen}"
          f"{'; fallback ' + config.fallback if config.fallback else ''}){extra}", flush=True)
    await stopped.wait()
    await server.stop()


def run(server: JudgeServer) -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    asyncio.run(serve_forever(server))


__all__ = ["JudgeServer", "JudgeServerConfig", "build_judges", "run", "serve_forever"]
