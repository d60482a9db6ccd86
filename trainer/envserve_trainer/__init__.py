"""envserve-trainer: RL training of LLM agents on environments served by envserve.

The trainer talks to environments only through `envserve.client`.
"""

__version__ = "0.1.0"
