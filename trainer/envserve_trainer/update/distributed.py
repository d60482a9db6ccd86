"""torchrun support: DDP or FSDP from the environment torchrun sets, nothing home-made.

One process per GPU (or CPU process, gloo). Each rank collects its own share of the iteration's
task groups (a group never spans ranks, so group-relative advantages need no communication) and
gradients are averaged by DDP/FSDP. Rank 0 writes checkpoints and logs.

FSDP (fully_shard) shards parameters, so the sharded module cannot generate on its own (ranks run
different numbers of decoding steps and its all-gathers would deadlock): rollouts use a full copy
whose weights are refreshed from the sharded model after every update, the same hand-off a vLLM
engine gets.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any, Sequence, TypeVar

import torch

T = TypeVar("T")


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    strategy: str = "none"

    @classmethod
    def from_env(cls, device: str = "cpu") -> "Dist":
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return cls()
        import torch.distributed as td
        if not td.is_initialized():
            td.init_process_group(backend="nccl" if device.startswith("cuda") else "gloo")
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if device.startswith("cuda"):
            torch.cuda.set_device(local)
        return cls(rank=td.get_rank(), world=td.get_world_size(), local_rank=local)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world > 1

    def device(self, requested: str) -> str:
        return f"cuda:{self.local_rank}" if requested.startswith("cuda") and self.active else requested

    def wrap(self, model: torch.nn.Module, strategy: str) -> torch.nn.Module:
        if not self.active:
            return model
        if strategy == "fsdp":
            from torch.distributed.fsdp import fully_shard
            fully_shard(model)
            self.strategy = "fsdp"
            return model
        from torch.nn.parallel import DistributedDataParallel
        self.strategy = "ddp"
        dev = next(model.parameters()).device
        return DistributedDataParallel(model, device_ids=[dev.index] if dev.type == "cuda" else None)

    def no_sync(self, wrapped: torch.nn.Module, enabled: bool):
        """Skip the gradient all-reduce on micro-batches before the last of an accumulation."""
        if not (self.active and enabled):
            return contextlib.nullcontext()
        if hasattr(wrapped, "no_sync"):
            return wrapped.no_sync()
        if hasattr(wrapped, "set_requires_gradient_sync"):
            @contextlib.contextmanager
            def fsdp_no_sync():
                wrapped.set_requires_gradient_sync(False)
                try:
                    yield
                finally:
                    wrapped.set_requires_gradient_sync(True)
            return fsdp_no_sync()
        return contextlib.nullcontext()

    def full_state_dict(self, wrapped: torch.nn.Module) -> dict[str, torch.Tensor]:
        """Every weight, unsharded, on the CPU (collective under FSDP: all ranks must call it)."""
        if self.strategy == "fsdp":
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
            # cpu_offload would leave ranks other than 0 empty; every rank needs the weights here.
            full = get_model_state_dict(wrapped, options=StateDictOptions(full_state_dict=True))
            return {k: v.detach().cpu() for k, v in full.items()}
        module = getattr(wrapped, "module", wrapped)
        return {k: v.detach().cpu() for k, v in module.state_dict().items()}

    def full_optimizer_state(self, wrapped: torch.nn.Module, optimizer) -> dict:
        """The optimizer's state, unsharded (collective under FSDP)."""
        if self.strategy == "fsdp":
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
            return get_optimizer_state_dict(wrapped, optimizer,
                                            options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return optimizer.state_dict()

    def load_optimizer_state(self, wrapped: torch.nn.Module, optimizer, state: dict) -> None:
        if self.strategy == "fsdp":
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
            set_optimizer_state_dict(wrapped, optimizer, state, options=StateDictOptions(full_state_dict=True))
        else:
            optimizer.load_state_dict(state)

    def barrier(self) -> None:
        if self.active:
            import torch.distributed as td
            td.barrier()

    def shard(self, items: Sequence[T]) -> list[T]:
        """This rank's items: every world-th, starting at its rank."""
        return list(items[self.rank::self.world])

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's object, in rank order (all ranks get the list)."""
        if not self.active:
            return [obj]
        import torch.distributed as td
        out: list[Any] = [None] * self.world
        td.all_gather_object(out, obj)
        return out

    def close(self) -> None:
        if self.active:
            import torch.distributed as td
            if td.is_initialized():
                td.destroy_process_group()
