"""The hand-written StepResult encoder against the generated protobuf classes."""
import random

import numpy as np
from google.protobuf import json_format

from envserve.core.session import TurnResult
from envserve.rpc.values import json_text
from envserve.server import convert, wire
from envserve.v1 import envserve_pb2 as pb


def reference(sid: str, r: TurnResult) -> pb.StepResult:
    """The same result built with the generated classes."""
    msg = pb.StepResult(session_id=sid, reward=r.reward, done=r.done, truncated=r.truncated, success=r.success,
                        action_valid=r.valid, actions_executed=r.actions_executed,
                        parsed_actions=r.parsed_actions, anchor=r.anchor, transition=r.transition,
                        feedback=r.feedback, turn=r.turn, episode=r.episode, trial=r.trial)
    msg.observation.text = r.text
    msg.observation.turn = r.turn
    msg.observation.episode = r.episode
    msg.reward_components.update(r.components)
    msg.reasoning.update(r.reasoning)
    msg.status.SetInParent()  # an OK result still carries its (empty) status
    if r.info:
        msg.info.update(r.info)
        msg.info_json = json_text(r.info)
    return msg


def random_text(rng, n=30):
    return "".join(rng.choice("abc <>/\n\t,é漢🙂\x00") for _ in range(rng.randint(0, n)))


def random_value(rng, depth=0):
    makers = [lambda: None, lambda: rng.random() < 0.5, lambda: rng.uniform(-1e6, 1e6), lambda: random_text(rng),
              lambda: rng.randint(-5, 5),
              lambda: {random_text(rng, 5): random_value(rng, depth + 1) for _ in range(3)},
              lambda: [random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]]
    return makers[rng.randint(0, 6 if depth < 2 else 4)]()


def test_encoder_matches_generated_classes():
    rng = random.Random(7)
    for _ in range(500):
        r = TurnResult(
            text=random_text(rng, 200), reward=rng.choice([0.0, -0.1, 10.0, rng.uniform(-50, 50)]),
            components={random_text(rng, 6): rng.uniform(-5, 5) for _ in range(rng.randint(0, 3))},
            done=rng.random() < 0.5, truncated=rng.random() < 0.5, success=rng.random() < 0.5,
            valid=rng.random() < 0.5, actions_executed=rng.randint(0, 3),
            parsed_actions=[random_text(rng, 8) for _ in range(rng.randint(0, 3))],
            reasoning={random_text(rng, 6): random_text(rng) for _ in range(rng.randint(0, 3))},
            anchor=random_text(rng, 16), transition=random_text(rng, 16), feedback=random_text(rng),
            info={random_text(rng, 6): random_value(rng) for _ in range(rng.randint(0, 4))},
            turn=rng.randint(0, 300), episode=rng.choice([0, 1, 2**31 - 1]),
            trial=rng.choice([0, 1, 300, 2**31 - 1]))
        sid = random_text(rng, 20)
        decoded = pb.StepResult.FromString(wire.step_result(sid, r))
        assert decoded == reference(sid, r)


def test_negative_numbers_and_images():
    r = TurnResult(text="x", turn=-1, episode=-5, reward=-0.0, image=np.zeros((4, 6, 3), np.uint8))
    decoded = pb.StepResult.FromString(convert.encode_turn("s", r))
    assert decoded.observation.turn == -1 and decoded.episode == -5
    img = decoded.observation.images[0]
    assert (img.height, img.width, img.channels, img.name) == (4, 6, 3, "observation")
    assert img.png.startswith(b"\x89PNG")


def test_numpy_values_in_info():
    r = TurnResult(text="", info={"pos": np.array([1, 2]), "x": np.float32(0.5), "n": np.int64(3)})
    decoded = pb.StepResult.FromString(wire.step_result("s", r))
    assert json_format.MessageToDict(decoded.info) == {"pos": [1.0, 2.0], "x": 0.5, "n": 3.0}
    # The JSON sibling keeps the integers integers, in every language that parses it.
    assert decoded.info_json == '{"pos":[1,2],"x":0.5,"n":3}'


def test_ok_results_carry_a_status_and_non_finite_info_is_null_in_json():
    decoded = pb.StepResult.FromString(wire.step_result("s", TurnResult(text="", info={"v": float("nan")})))
    assert decoded.HasField("status") and decoded.status.code == 0
    assert decoded.info_json == '{"v":null}'
    assert not pb.StepResult.FromString(wire.step_result("s", TurnResult(text=""))).info_json
