"""primitive_skill through the real gRPC server: a scripted solver that reads object positions from
GetState completes all four tasks by real arm motion, invalid actions move nothing, picking empty air
holds nothing, a push moves only what it touches, seeds give the same layout in two processes, and a
fork replays exactly. Needs mani-skill + sapien and a Vulkan device (Mesa lavapipe works)."""
import grpc
import numpy as np
import pytest

pytest.importorskip("mani_skill")

from envserve.client import EnvClient, decode_image, state_dict  # noqa: E402
from envserve.client.errors import EnvServeError  # noqa: E402
from envserve.envs.primitive_skill.env import PrimitiveSkillEnv  # noqa: E402
from envserve.client.experts import PrimitiveSkillExpert, Truth  # noqa: E402
from serverproc import ServerProcess, sapien_vulkan_problem  # noqa: E402

DEFAULTS = PrimitiveSkillEnv.spec.config_defaults
STAGE = DEFAULTS["stage_reward"]


_PROBLEM = sapien_vulkan_problem()
if _PROBLEM:
    pytest.skip(f"SAPIEN cannot create a Vulkan render device (set VK_ICD_FILENAMES): {_PROBLEM}",
                allow_module_level=True)


def answer(*actions: str) -> str:
    return f"<answer>{'|'.join(actions)}</answer>"


def xyz(p, dz=0.0) -> str:
    return f"{round(p[0])},{round(p[1])},{round(p[2] + dz)}"


@pytest.fixture(scope="module")
def server():
    with ServerProcess(["primitive_skill"], workers=1, metrics=False) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    with EnvClient(server.address) as c:
        yield c


def truth(client, sid):
    return state_dict(client.get_state(sid, -1))


def open_task(client, task, seed, **config):
    sid = client.open("primitive_skill", 1, {"task": task, "render_image": False, **config}, "no_think")[0]
    first = client.reset_one(sid, seed=seed)
    return sid, first


# The expert (envserve.client.experts) reads the true positions each turn and answers up to two
# skills; these seeds are the layouts each task was first checked on.
SOLVER_SEEDS = {"place": 3, "stack": 4, "align": 0, "drawer": 2}


@pytest.mark.parametrize("task", ["place", "stack", "align", "drawer"])
def test_scripted_solver_completes_task_by_motion(client, task):
    sid, first = open_task(client, task, SOLVER_SEEDS[task])
    start = truth(client, sid)
    assert start["task"] == task and start["stage"] == -1 and not start["success"]
    assert "Object positions:" in first.observation.text and "x_workspace_limit" in first.observation.text
    # The observation lists the positions in VAGEN's order, without names.
    listed = [tuple(round(v) for v in {**start["objects"], **start["targets"]}[n]) for n in start["position_order"]]
    assert str(listed) in first.observation.text
    expert = PrimitiveSkillExpert()
    results = []
    for _ in range(4):
        move = expert.act(Truth.from_response(client.get_state(sid, -1)), 2)
        r = client.step_one(sid, answer(*move.actions))
        assert r.action_valid, (move.actions, r.feedback)
        results.append(r)
        if r.done:
            break
    last = results[-1]
    assert last.done and last.success and not last.truncated
    assert last.reward_components["success"] == DEFAULTS["success_reward"]
    # A subgoal stage paid (s + 1) x stage_reward on the way, and each executed skill cost the step penalty.
    assert results[0].reward_components["stage"] >= STAGE
    total_skills = sum(r.actions_executed for r in results)
    paid = sum(r.reward_components.get("stage", 0.0) for r in results)
    total = sum(r.reward for r in results)
    assert abs(total - (paid + DEFAULTS["success_reward"] + total_skills * DEFAULTS["step_penalty"])) < 1e-6
    end = truth(client, sid)
    assert end["success"] and end["stage"] == end["num_stages"] and end["skills_executed"] == total_skills
    # The objects really moved from where they started.
    moved = [n for n in start["objects"] if np.linalg.norm(np.subtract(end["objects"][n], start["objects"][n])) > 30]
    assert moved
    client.close_sessions([sid])


def test_stage_rewards_follow_vagen_subgoals(client):
    sid, _ = open_task(client, "stack", 4)
    o = truth(client, sid)["objects"]
    r = client.step_one(sid, answer(f"pick({xyz(o['red_cube'])})"))
    # Stage 0 (red grasped) pays (0 + 1) x 2.
    assert r.reward_components["stage"] == STAGE and truth(client, sid)["gripper"]["holding"] == "red_cube"
    r = client.step_one(sid, answer(f"place({xyz(o['green_cube'], 45)})"))
    # Stage 1 (red on green, released) pays (1 + 1) x 2.
    assert r.reward_components["stage"] == 2 * STAGE and truth(client, sid)["stage"] == 1
    assert "red_cube is on green_cube" in client.get_state(sid, -1).relations
    # Picking red off again and putting it back reaches no new stage: nothing is paid twice.
    o = truth(client, sid)["objects"]
    r = client.step_one(sid, answer(f"pick({xyz(o['red_cube'])})", f"place({xyz(o['green_cube'], 45)})"))
    assert "stage" not in r.reward_components and truth(client, sid)["best_stage"] == 1
    client.close_sessions([sid])


def test_invalid_actions_move_nothing(client):
    sid, first = open_task(client, "place", 1)
    before = truth(client, sid)
    for text, needle in ((answer("pick(1000,0,20)"), "outside the workspace"),
                         (answer("place(0,0,5)"), "outside the workspace"),
                         (answer("pick(1,2)"), "takes 3 coordinates"),
                         (answer("push(0,0,20,10,10)"), "takes 6 coordinates"),
                         (answer("jump(1,2,3)"), "Valid actions"),
                         (answer("pick(a,b,c)"), "Valid actions")):
        r = client.step_one(sid, text)
        assert not r.action_valid and needle in r.feedback and r.actions_executed == 0, (text, r.feedback)
        assert r.reward_components["invalid_action"] < 0 and r.anchor == first.anchor
        now = truth(client, sid)
        assert now["objects"] == before["objects"] and now["gripper"] == before["gripper"]
        assert now["skills_executed"] == 0
    # The first of two actions runs; the invalid second one stops the turn.
    r = client.step_one(sid, answer("pick(0,-150,20)", "place(9999,0,0)"))
    assert not r.action_valid and r.actions_executed == 1 and truth(client, sid)["skills_executed"] == 1
    client.close_sessions([sid])


def test_clip_to_workspace_is_vagens_alternative(client):
    sid, _ = open_task(client, "align", 2, clip_to_workspace=True)
    r = client.step_one(sid, answer("pick(1000,0,20)"))
    assert r.action_valid
    # The gripper went to the clipped point, the workspace's x limit.
    assert abs(truth(client, sid)["gripper"]["position"][0] - truth(client, sid)["workspace"]["x"][1]) < 10
    client.close_sessions([sid])


def test_motion_is_real_empty_air_holds_nothing_and_push_moves_only_what_it_touches(client):
    sid, _ = open_task(client, "align", 7)
    s0 = truth(client, sid)
    red, green = s0["objects"]["red_cube"], s0["objects"]["green_cube"]
    # Empty air: the point of a grid farthest from both cubes. The arm goes there and closes on nothing.
    grid = [(x, y, 20) for x in (-50, 0, 50, 100) for y in (-150, -75, 0, 75, 150)]
    air = max(grid, key=lambda g: min(np.linalg.norm(np.subtract(g[:2], p[:2])) for p in (red, green)))
    assert min(np.linalg.norm(np.subtract(air[:2], p[:2])) for p in (red, green)) > 60
    assert client.step_one(sid, answer(f"pick({xyz(air)})")).action_valid
    s1 = truth(client, sid)
    assert s1["gripper"]["holding"] is None and s1["gripper"]["closed"] is True
    assert np.linalg.norm(np.subtract(s1["gripper"]["position"][:2], air[:2])) < 10
    assert s1["objects"] == s0["objects"]
    # Placing with an empty hand moves nothing either.
    assert client.step_one(sid, answer("place(100,0,80)")).action_valid
    assert truth(client, sid)["objects"] == s0["objects"]
    # A real grasp lifts the cube with the hand.
    assert client.step_one(sid, answer(f"pick({xyz(green)})")).action_valid
    s2 = truth(client, sid)
    assert s2["gripper"]["holding"] == "green_cube" and s2["objects"]["green_cube"][2] > 80
    assert s2["objects"]["red_cube"] == s0["objects"]["red_cube"]
    # Set the green cube down on the side away from the red one, then push it along +x.
    y = 100 if red[1] < 0 else -100
    assert client.step_one(sid, answer(f"place(20,{y},30)")).action_valid
    s3 = truth(client, sid)
    g3 = s3["objects"]["green_cube"]
    assert abs(g3[0] - 20) < 10 and abs(g3[1] - y) < 10 and s3["gripper"]["holding"] is None
    r = client.step_one(sid, answer(f"push(-25,{y},20,45,{y},20)"))
    assert r.action_valid
    s4 = truth(client, sid)
    moved = np.subtract(s4["objects"]["green_cube"], g3)
    assert moved[0] > 20 and abs(moved[1]) < 15 and abs(moved[2]) < 3
    assert s4["objects"]["red_cube"] == s0["objects"]["red_cube"]
    client.close_sessions([sid])


def test_image_is_the_scene_and_follows_the_motion(client):
    sid = client.open("primitive_skill", 1, {"task": "stack", "image_size": 96}, "no_think")[0]
    r0 = client.reset_one(sid, seed=4)
    assert len(r0.observation.images) == 1
    img0 = decode_image(r0.observation.images[0])
    assert img0.shape == (96, 96, 3) and img0.std() > 10
    o = truth(client, sid)["objects"]
    r1 = client.step_one(sid, answer(f"pick({xyz(o['red_cube'])})"))
    img1 = decode_image(r1.observation.images[0])
    assert np.abs(img1.astype(int) - img0.astype(int)).sum() > 0
    client.close_sessions([sid])


def test_same_seed_same_layout_in_another_process(client):
    sids = client.open("primitive_skill", 1, {"task": "random", "render_image": False}, "no_think")
    with ServerProcess(["primitive_skill"], workers=1, metrics=False) as other, EnvClient(other.address) as c2:
        sids2 = c2.open("primitive_skill", 1, {"task": "random", "render_image": False}, "no_think")
        tasks = set()
        for seed in (0, 1, 2, 3, 12345):
            a = client.reset_one(sids[0], seed=seed)
            b = c2.reset_one(sids2[0], seed=seed)
            ta, tb = truth(client, sids[0]), truth(c2, sids2[0])
            assert a.observation.text == b.observation.text and a.anchor == b.anchor
            assert ta == tb
            tasks.add(ta["task"])
        assert tasks == {"align", "place", "stack", "drawer"}
    # Another seed, another layout.
    client.reset_one(sids[0], seed=4)
    l4 = truth(client, sids[0])["objects"]
    client.reset_one(sids[0], seed=8)
    assert truth(client, sids[0])["objects"] != l4
    client.close_sessions(sids)


def test_fork_replays_exactly(client):
    sid, _ = open_task(client, "stack", 4)
    o = truth(client, sid)["objects"]
    client.step_one(sid, answer(f"pick({xyz(o['red_cube'])})", f"place({xyz(o['green_cube'], 45)})"))
    (fork,) = client.fork(sid, 1)
    assert truth(client, fork) == truth(client, sid)
    o = truth(client, sid)["objects"]
    text = answer(f"pick({xyz(o['purple_cube'])})", f"place({xyz(o['red_cube'], 45)})")
    ends = [client.step_one(s, text) for s in (sid, fork)]
    assert ends[0].anchor == ends[1].anchor and ends[0].success and ends[1].success
    assert truth(client, sid) == truth(client, fork)
    client.close_sessions([sid, fork])


@pytest.mark.parametrize("config", [{"task": "fly"}, {"workspace_place": "1,2"}, {"image_size": 4},
                                    {"max_skills": -1}])
def test_bad_config_is_invalid_argument(client, config):
    with pytest.raises(EnvServeError) as e:
        client.open("primitive_skill", 1, config)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
