import pytest

from envserve.core.formats import format_names, get_format

GW = ("<think><observation>box is left of player</observation><reasoning>push it</reasoning>"
      "<prediction>box on target</prediction></think><answer>Left, Up</answer>")


def test_all_formats_registered():
    assert set(format_names()) >= {"no_think", "free_think", "grounding", "worldmodeling",
                                   "grounding_worldmodeling", "meta_reasoning"}


def test_grounding_worldmodeling_fields_and_actions():
    p = get_format("grounding_worldmodeling").parse(GW)
    assert p.valid
    assert p.actions == ["Left", "Up"]
    assert p.fields["observation"] == "box is left of player"
    assert p.fields["prediction"] == "box on target"
    assert p.fields["reasoning"] == "push it"


@pytest.mark.parametrize("text,reason", [
    ("<answer>Left</answer>", "missing <think>"),
    ("<think><reasoning>x</reasoning></think><answer>Left</answer>", "missing <observation>"),
    ("<think><observation>a</observation><reasoning>b</reasoning><prediction>c</prediction></think>", "missing <answer>"),
    ("<think><observation>a</observation><reasoning>b</reasoning><prediction>c</prediction></think>"
     "<answer>Left</answer><answer>Up</answer>", "exactly one <answer>"),
    ("<think><observation>a</observation><reasoning>b</reasoning><prediction>c</prediction></think>"
     "<answer> , </answer>", "holds no action"),
])
def test_grounding_worldmodeling_rejects(text, reason):
    p = get_format("grounding_worldmodeling").parse(text)
    assert not p.valid
    assert reason in p.feedback
    assert p.feedback.startswith("Invalid format")


def test_no_think_rejects_think_and_accepts_answer():
    f = get_format("no_think")
    assert f.parse("<answer>Up</answer>").actions == ["Up"]
    assert not f.parse("<think>x</think><answer>Up</answer>").valid


def test_free_think_answer_must_follow_think():
    f = get_format("free_think")
    assert f.parse("<think>go</think> <answer>Up,Down</answer>").actions == ["Up", "Down"]
    assert not f.parse("<answer>Up</answer><think>go</think>").valid


def test_separator_is_configurable():
    p = get_format("no_think").parse("<answer>Up | Down</answer>", "|")
    assert p.actions == ["Up", "Down"]


@pytest.mark.parametrize("tag", ["planning", "explore", "reflection", "monitor"])
def test_meta_reasoning_each_tag(tag):
    p = get_format("meta_reasoning").parse(f"<{tag}>thinking</{tag}><action>go to desk 1</action>")
    assert p.valid
    assert p.actions == ["go to desk 1"]
    assert p.fields == {"meta_tag": tag, tag: "thinking"}


@pytest.mark.parametrize("text", [
    "<action>look</action>",
    "<planning>a</planning><explore>b</explore><action>look</action>",
    "<planning>a</planning>",
    "<action>look</action><planning>a</planning>",
    "<planning>a<action>look</action>",
])
def test_meta_reasoning_rejects(text):
    p = get_format("meta_reasoning").parse(text)
    assert not p.valid and p.feedback


def test_hostile_texts_never_raise():
    import random
    rng = random.Random(0)
    alphabet = "<>/ abcthinkanswerobservationplanningaction\x00\x07\n\t,é漢"
    for name in format_names():
        f = get_format(name)
        for _ in range(300):
            text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 200)))
            p = f.parse(text)
            assert p.valid or p.feedback
