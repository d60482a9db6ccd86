"""VAGEN's primitive-skill manipulation tasks on ManiSkill3 + SAPIEN (needs Vulkan: see BUILD-NOTES)."""
from .env import PrimitiveSkillEnv

__all__ = ["PrimitiveSkillEnv"]
