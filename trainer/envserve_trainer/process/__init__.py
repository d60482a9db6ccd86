"""Process rewards over Fork: Monte-Carlo values of session states (montecarlo.py) and
the methods' formulas as pure functions, a module each: agentprm, inverse_prm, progrm, ipr, rro,
arpo, and dpo (the DPO family IPR and RRO train with); their defaults in config.py."""
from . import agentprm, arpo, dpo, inverse_prm, ipr, progrm, rro
from .config import AgentPRMConfig, ARPOConfig, DPOConfig, InversePRMConfig, IPRConfig, ProgRMConfig, RROConfig
from .montecarlo import MCSettings, StatePoint, StateValue, discounted, estimate

__all__ = ["AgentPRMConfig", "ARPOConfig", "DPOConfig", "InversePRMConfig", "IPRConfig", "MCSettings", "ProgRMConfig",
           "RROConfig", "StatePoint", "StateValue", "agentprm", "arpo", "discounted", "dpo", "estimate", "inverse_prm",
           "ipr", "progrm", "rro"]
