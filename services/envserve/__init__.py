"""envserve: reinforcement-learning environments for LLM and VLM agents, served over gRPC."""

__version__ = "0.1.0"
