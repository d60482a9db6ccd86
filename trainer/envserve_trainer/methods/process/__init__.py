"""Process rewards over Fork: Monte-Carlo values of session states (montecarlo), the formulas of agentprm, inverse_prm,
progrm, ipr, rro, arpo and dpo as pure functions (defaults in config.process). May import: methods, config."""
from ...config.process import (AgentPRMConfig, ARPOConfig, DPOConfig, InversePRMConfig, IPRConfig, ProgRMConfig,
                               RROConfig)
from . import agentprm, arpo, dpo, inverse_prm, ipr, progrm, rro
from .montecarlo import MCSettings, StatePoint, StateValue, discounted, estimate

__all__ = ["AgentPRMConfig", "ARPOConfig", "DPOConfig", "InversePRMConfig", "IPRConfig", "MCSettings", "ProgRMConfig",
           "RROConfig", "StatePoint", "StateValue", "agentprm", "arpo", "discounted", "dpo", "estimate", "inverse_prm",
           "ipr", "progrm", "rro"]
