"""Config bounds: the schema every env publishes, the validator's messages, integral floats, the
operator's limits file (core/limits.py) and the Struct reader that refuses NaN and deep nesting."""
from __future__ import annotations

import json
import math

import pytest
from google.protobuf import struct_pb2

from envserve.core import limits
from envserve.core.env import resolve_config
from envserve.core.limits import LimitsError
from envserve.core.registry import get_env_class
from envserve.core.session import COMMON_CONFIG_DOCS, Session, SessionError, full_spec
from envserve.envs.sokoban.env import MAX_BOXES_BY_DIM
from envserve.rpc.values import BadValue, struct_to_dict, to_struct

GRID = ("sokoban", "frozenlake", "minesweeper")


@pytest.fixture(autouse=True)
def builtin_limits():
    """Every test starts and ends with the built-in bounds (limits are process-wide)."""
    limits.install({})
    yield
    limits.install({})


def spec_of(env_id: str):
    return full_spec(get_env_class(env_id).spec)


def props(env_id: str) -> dict:
    return spec_of(env_id).config_schema()["properties"]


def refused(env_id: str, config: dict) -> str:
    with pytest.raises(ValueError) as e:
        resolve_config(spec_of(env_id), config)
    return str(e.value)


# -- the published schema ------------------------------------------------------------------------
@pytest.mark.parametrize("env_id", GRID)
def test_every_key_is_bounded_and_its_default_within(env_id):
    from jsonschema import Draft202012Validator
    for key, p in props(env_id).items():
        if p["type"] in ("integer", "number"):
            assert "maximum" in p and "minimum" in p, key
        elif p["type"] == "string":
            assert "maxLength" in p or "enum" in p, key
        Draft202012Validator.check_schema(p)
        assert Draft202012Validator(p).is_valid(p["default"]), key


def test_common_keys_have_their_bounds_in_every_env():
    for env_id in GRID:
        p = props(env_id)
        assert set(COMMON_CONFIG_DOCS) <= set(p)
        assert (p["image_size"]["minimum"], p["image_size"]["maximum"]) == (16, 1024)
        assert (p["history_turns"]["minimum"], p["history_turns"]["maximum"]) == (1, 1024)
        assert p["render_image"]["type"] == "boolean"


def test_sokoban_schema_states_its_generator_bounds():
    p = props("sokoban")
    assert (p["dim_room"]["minimum"], p["dim_room"]["maximum"]) == (min(MAX_BOXES_BY_DIM), max(MAX_BOXES_BY_DIM))
    assert p["num_boxes"]["maximum"] == max(MAX_BOXES_BY_DIM.values())
    # A setting that protects the server: its maximum is its default.
    assert p["gen_attempts"]["maximum"] == p["gen_attempts"]["default"]


# -- the validator ---------------------------------------------------------------------------------
@pytest.mark.parametrize("config, message", [
    ({"dim_room": 40}, "config.dim_room: 40 is greater than the maximum of 12"),
    ({"dim_room": 1e300}, "config.dim_room: 1e+300 is greater than the maximum of 12"),
    ({"image_size": -5}, "config.image_size: -5 is less than the minimum of 16"),
    ({"image_size": 1e9}, "config.image_size: 1000000000 is greater than the maximum of 1024"),
    ({"image_size": 3.5}, "config.image_size: 3.5 is not of type 'integer'"),
    ({"image_size": math.nan}, "config.image_size: nan is not a finite number"),
    ({"p_change_directions": math.inf}, "config.p_change_directions: inf is not a finite number"),
    ({"render_image": 1}, "config.render_image: 1 is not of type 'boolean'"),
    ({"dim_room": "6"}, "config.dim_room: '6' is not of type 'integer'"),
    ({"cell_separator": "x" * 100_000}, "config.cell_separator: 100000 characters, more than the maxLength of 4"),
])
def test_refusals_name_the_field(config, message):
    assert refused("sokoban", config) == message


def test_an_unknown_key_lists_the_known_ones():
    message = refused("sokoban", {"dim_rooom": 6})
    assert "unknown config key 'dim_rooom'" in message and "'dim_room'" in message


def test_integral_floats_become_ints_and_ints_floats_for_number_keys():
    config = resolve_config(spec_of("sokoban"), {"dim_room": 8.0, "num_boxes": 2.0, "p_change_directions": 1})
    assert config["dim_room"] == 8 and type(config["dim_room"]) is int
    assert type(config["num_boxes"]) is int
    assert config["p_change_directions"] == 1.0 and type(config["p_change_directions"]) is float


def test_a_repeated_config_is_checked_like_a_new_one():
    spec = spec_of("sokoban")
    assert resolve_config(spec, {"render_image": True})["render_image"] is True
    # 1 == True as a key of the memo of checked configs: the type keeps them apart.
    assert refused("sokoban", {"render_image": 1}) == "config.render_image: 1 is not of type 'boolean'"
    assert refused("sokoban", {"render_image": 1}) == "config.render_image: 1 is not of type 'boolean'"


def test_a_caller_may_lower_a_protective_limit_but_not_raise_it():
    spec = spec_of("svg")
    assert resolve_config(spec, {"render_timeout_s": 1.0, "max_svg_bytes": 1000})["render_timeout_s"] == 1.0
    assert "greater than the maximum of 5.0" in refused("svg", {"render_timeout_s": 60})
    assert "greater than the maximum of 32768" in refused("svg", {"max_svg_bytes": 10 ** 7})
    assert "is not a multiple of 256" in refused("svg", {"render_memory_mb": 300})


def test_a_server_path_is_refused_without_touching_the_filesystem(tmp_path):
    for key in ("svg_dir", "dino_model_path", "dreamsim_model_path"):
        existing, missing = refused("svg", {key: str(tmp_path)}), refused("svg", {key: str(tmp_path / "nope")})
        # The same words whether the path exists or not.
        assert existing.replace(str(tmp_path), "P") == missing.replace(str(tmp_path / "nope"), "P")
        assert existing == f"config.{key}: {str(tmp_path)!r} is not one of ['']"


def test_package_arguments_cannot_name_a_path_and_are_bounded():
    pytest.importorskip("gymnasium")
    assert refused("gymnasium:FrozenLake-v1", {"kwargs": {"xml_file": "/etc/passwd"}}) == \
        "config.kwargs.xml_file: '/etc/passwd' names a path: a path separator is not allowed here"
    from envserve.core.env import arguments_bounds
    from jsonschema import Draft202012Validator
    v = Draft202012Validator({"type": "object", **arguments_bounds()})
    assert v.is_valid({"map_name": "8x8", "is_slippery": False, "desc": ["SFF", "FHG"], "max_episode_steps": 3})
    assert not v.is_valid({"xml_file": "/etc/passwd"})
    assert not v.is_valid({"a": 1e9})
    assert not v.is_valid({f"k{i}": 1 for i in range(17)})
    assert not v.is_valid({"nested": {"object": 1}})


def test_the_envs_cross_field_rules_stay_with_the_env():
    with pytest.raises(SessionError) as e:
        Session("sokoban", {"dim_room": 10, "num_boxes": 3})
    assert e.value.code == "INVALID_ARGUMENT" and "num_boxes 3 is too many for dim_room 10: at most 2" in e.value.message
    with pytest.raises(SessionError, match="num_mines must be fewer than rows\\*cols"):
        Session("minesweeper", {"rows": 2, "cols": 2, "num_mines": 4})
    Session("sokoban", {"dim_room": 12, "num_boxes": 2}).close()


# -- operator limits ---------------------------------------------------------------------------------
def write(tmp_path, data, name="limits.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(data) if name.endswith(".json") else data)
    return str(path)


def test_limits_replace_bounds_keyword_by_keyword(tmp_path):
    path = write(tmp_path, {"sokoban": {"dim_room": {"maximum": 8}, "num_boxes": {"default": 2}},
                            "svg": {"svg_dir": {"enum": ["", str(tmp_path)]}},
                            "*": {"image_size": {"maximum": 512}, "max_turns": {"maximum": 20}}})
    limits.install(limits.load(path, ["sokoban", "svg"]))
    p = props("sokoban")
    assert (p["dim_room"]["minimum"], p["dim_room"]["maximum"]) == (5, 8)
    assert p["num_boxes"]["default"] == 2 and resolve_config(spec_of("sokoban"), {})["num_boxes"] == 2
    assert p["image_size"]["maximum"] == 512 and props("frozenlake")["image_size"]["maximum"] == 512
    assert refused("sokoban", {"dim_room": 9}) == "config.dim_room: 9 is greater than the maximum of 8"
    assert refused("frozenlake", {"image_size": 600}) == "config.image_size: 600 is greater than the maximum of 512"
    assert resolve_config(spec_of("svg"), {"svg_dir": str(tmp_path)})["svg_dir"] == str(tmp_path)
    # Back to the built-in bounds.
    limits.install({})
    assert props("sokoban")["dim_room"]["maximum"] == 12 and props("sokoban")["num_boxes"]["default"] == 1


def test_an_operator_may_raise_a_bound_and_remove_one(tmp_path):
    limits.install({"sokoban": {"num_boxes": {"maximum": 6}}, "svg": {"svg_dir": {"enum": None, "maxLength": 4096}}},
                   check=True)
    assert resolve_config(spec_of("sokoban"), {"num_boxes": 6})["num_boxes"] == 6
    # Raising num_boxes' maximum lifts the env's table of boxes per room side.
    Session("sokoban", {"dim_room": 10, "num_boxes": 4}).close()
    assert resolve_config(spec_of("svg"), {"svg_dir": "/any/where"})["svg_dir"] == "/any/where"
    assert "enum" not in props("svg")["svg_dir"]


def test_yaml_limits_where_pyyaml_is_installed(tmp_path):
    pytest.importorskip("yaml")
    path = write(tmp_path, "sokoban:\n  dim_room: {maximum: 7}\n'*':\n  history_turns: {maximum: 128}\n", "limits.yaml")
    assert limits.load(path, ["sokoban"]) == {"sokoban": {"dim_room": {"maximum": 7}},
                                              "*": {"history_turns": {"maximum": 128}}}


@pytest.mark.parametrize("data, message", [
    ({"sokobam": {"dim_room": {"maximum": 8}}}, "unknown env id 'sokobam'"),
    ({"sokoban": {"dim_rooom": {"maximum": 8}}}, "sokoban.dim_rooom: sokoban has no config key 'dim_rooom'"),
    ({"sokoban": {"dim_room": {"maximun": 8}}}, "sokoban.dim_room: unknown keyword 'maximun'"),
    ({"sokoban": {"dim_room": {"type": "string"}}}, "sokoban.dim_room: unknown keyword 'type'"),
    ({"sokoban": {"dim_room": {"maximum": "8"}}}, "sokoban.dim_room: '8' is not of type 'number'"),
    ({"sokoban": {"dim_room": {"maximum": 5}}}, "sokoban.dim_room: the bounds refuse sokoban's default"),
    ({"*": {"dim_room": {"maximum": 8}}}, "*.dim_room: '*' sets the session keys every env has"),
    ({"*": {"image_size": {"maximum": 200}}}, "*.image_size: the bounds refuse svg's default"),
    ({"sokoban": {"dim_room": {}}}, "sokoban.dim_room: must map JSON Schema keywords"),
    ({"sokoban": ["dim_room"]}, "sokoban: must map config keys to JSON Schema keywords"),
    (["sokoban"], "must map env ids"),
])
def test_a_bad_limits_file_is_one_clear_line(tmp_path, data, message):
    path = write(tmp_path, data)
    with pytest.raises(LimitsError) as e:
        limits.load(path, ["sokoban", "svg"])
    assert message in str(e.value) and "\n" not in str(e.value) and str(e.value).startswith(f"config limits {path}: ")


@pytest.mark.parametrize("text, message", [("{", "not valid JSON"), ('{"sokoban": {"dim_room": {"maximum": NaN}}}',
                                                                       "not valid JSON: NaN is not a finite number")])
def test_a_limits_file_that_does_not_parse(tmp_path, text, message):
    path = tmp_path / "limits.json"
    path.write_text(text)
    with pytest.raises(LimitsError, match=message):
        limits.load(str(path))


def test_a_missing_limits_file(tmp_path):
    with pytest.raises(LimitsError, match="cannot read it"):
        limits.load(str(tmp_path / "none.json"))


# -- Struct to dict ----------------------------------------------------------------------------------
def test_struct_to_dict_reads_what_message_to_dict_reads():
    from google.protobuf import json_format
    s = to_struct({"a": 1, "b": [1, {"c": None, "d": "x"}], "e": True, "f": {}})
    assert struct_to_dict(s) == json_format.MessageToDict(s)


@pytest.mark.parametrize("value, path", [(math.nan, "config.k"), (math.inf, "config.k"), (-math.inf, "config.k")])
def test_struct_to_dict_names_a_non_finite_number(value, path):
    s = struct_pb2.Struct()
    s.update({"k": value})
    with pytest.raises(BadValue, match=f"^{path}: "):
        struct_to_dict(s)
    # json_format raises too, but without the field.
    s = struct_pb2.Struct()
    s.update({"kwargs": {"desc": ["SF", value]}})
    with pytest.raises(ValueError, match=r"^config\.kwargs\.desc\[1\]: .* is not a finite number"):
        struct_to_dict(s)


def test_struct_to_dict_refuses_deep_nesting():
    def nested(depth):
        d = value = {}
        for _ in range(depth - 1):
            value["n"] = {}
            value = value["n"]
        return d
    assert struct_to_dict(to_struct(nested(32))) == nested(32)
    with pytest.raises(BadValue, match="nested deeper than 32 levels"):
        struct_to_dict(to_struct(nested(33)))
    deep_list = [[[1]]]
    assert struct_to_dict(to_struct({"l": deep_list}), max_depth=4) == {"l": deep_list}
    with pytest.raises(BadValue, match=r"config\.l\[0\]\[0\]: nested deeper than 3 levels"):
        struct_to_dict(to_struct({"l": deep_list}), max_depth=3)


# -- config_json beside the Struct -------------------------------------------------------------------
def test_config_json_keeps_integers_and_is_read_like_the_struct():
    from envserve.rpc.values import config_of
    from envserve.v1 import envserve_pb2 as pb
    assert config_of(pb.OpenRequest(config_json='{"dim_room": [6, 6], "num_boxes": 1}')) == \
        {"dim_room": [6, 6], "num_boxes": 1}
    assert isinstance(config_of(pb.OpenRequest(config_json='{"n": 3}'))["n"], int)
    assert config_of(pb.OpenRequest(config=to_struct({"n": 3}))) == {"n": 3.0}
    assert config_of(pb.OpenRequest()) == {}


@pytest.mark.parametrize("request_kwargs, message", [
    ({"config_json": "[1, 2]"}, "must be a JSON object"),
    ({"config_json": "{not json"}, "not valid JSON"),
    ({"config_json": '{"k": NaN}'}, "not valid JSON"),
    ({"config_json": '{"k": ' + "[" * 40 + "]" * 40 + "}"}, "nested deeper than 32"),
    ({"config_json": "{}", "config": {"a": 1}}, "not both"),
])
def test_config_json_refusals_name_the_problem(request_kwargs, message):
    from envserve.rpc.values import config_of
    from envserve.v1 import envserve_pb2 as pb
    kwargs = dict(request_kwargs)
    if "config" in kwargs:
        kwargs["config"] = to_struct(kwargs["config"])
    with pytest.raises(BadValue, match=message):
        config_of(pb.OpenRequest(**kwargs))


def test_json_text_spells_what_other_languages_parse():
    import numpy as np
    from envserve.rpc.values import json_text
    assert json_text({"p": np.array([4, 1]), "x": np.float32(0.5), "s": "é"}) == '{"p":[4,1],"x":0.5,"s":"é"}'
    assert json_text({"a": [math.inf, {"b": -math.inf}], "c": 1}) == '{"a":[null,{"b":null}],"c":1}'
