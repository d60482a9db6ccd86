"""`envserve up --containers` (envserve.containers): the family images and Redis started through the
Docker Engine API, one container per environment, reachable from the host through the directory;
stopping removes every container and the network."""
from __future__ import annotations

import uuid

import pytest

from stack import GRID_ENVS, leftovers

pytestmark = [pytest.mark.containers, pytest.mark.timeout(900)]


def test_up_containers_serves_every_grid_env_through_the_directory(engine_api, built):
    from envserve import containers
    from envserve.client.routing import RoutedClient
    from envserve.demo import play
    base, _, _ = built
    redis_image = "localhost/envserve-redis:latest" if base == "local" else containers.DEFAULT_REDIS_IMAGE
    name = f"envup{uuid.uuid4().hex[:8]}"
    label = f"{containers.LABEL}={name}"
    stack = containers.start(engine_api, GRID_ENVS, redis_image=redis_image, name=name, first_port=0,
                             redis_port=0, workers=1)
    try:
        running = leftovers(engine_api, label, f"{name}_")
        assert len(running["containers"]) == len(GRID_ENVS) + 1, running
        rc = RoutedClient(stack.directory_url, use_external=True)
        try:
            replicas = rc.replicas(refresh=True)
            assert sorted(e for r in replicas for e in r.envs) == sorted(GRID_ENVS)
            for r in replicas:
                (env_id,) = r.envs
                assert r.address == f"{name}_{env_id}:50051"
                assert r.external_address == f"127.0.0.1:{stack.ports[env_id]}"
            for env_id in GRID_ENVS:
                assert play(rc, env_id, 21)["success"]
        finally:
            rc.close()
    finally:
        containers.stop(engine_api, stack)
    assert leftovers(engine_api, label, f"{name}_") == {"containers": [], "networks": []}
