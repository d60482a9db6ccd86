"""WebShop (Yao et al. 2022): find and buy the product an instruction describes.

Pages as WebShop's site has them: search -> results (10 a page, at most 50, "< Prev" from page
2, "Next >", "Back to Search") -> item (option values by group, "Description", "Features",
"Reviews", "< Prev", "Buy Now") -> sub-page ("< Prev"). Actions `search[query]` and
`click[label]` (labels case-insensitive); an action the page does not offer is invalid, with
feedback, and changes nothing. Clickables are keyed by their label, as in WebShop's text
environment: a value listed under two option groups selects it in the last of them. Buying ends the episode with WebShop's score (reward.py).

The store (products, goals, search index) is shared by every session of a process; a session
holds only where it is, so snapshot/restore copy a few fields.
"""
from __future__ import annotations

import re
from typing import Any, Mapping

from envserve.core.env import (REWARD_BOUNDS, SEED_BOUNDS, SERVER_PATH_BOUNDS, ActionOutcome, Environment, EnvSpec,
                               TaskDescription,
                               GroundTruth, Split)

from .catalog import Goal, Product
from .reward import score_purchase, title_nouns
from .store import Store, StoreKey, load_store

SPLIT_STRIDE = 1_000_000
SPLIT_NAMES = ("train", "dev", "test")   # train first: a reset without a seed or split draws from it
_ACTION = re.compile(r"^\s*(search|click)\s*\[(.*)\]\s*$", re.IGNORECASE | re.DOTALL)
SUB_PAGES = ("description", "features", "reviews")
OBSERVATION_MODES = ("text", "simple", "text_rich")

SYSTEM_PROMPT = """You are shopping on WebShop, a web store, for the product the instruction describes.
Pages: the search page has a search bar; a results page lists products (10 per page) by their ID, title and price; a product page shows its options (e.g. color, size), price and rating, and links to its Description, Features and Reviews; "Buy Now" buys the product with the options you selected.
Actions, one per turn:
search[your query]  (only on the search page)
click[label]  (a button, a product ID, or an option value shown on the page, e.g. click[Next >], click[B0A23F5LFZ], click[black], click[Buy Now])
Each observation lists the page's text, parts separated by [SEP], and the actions available.
Goal: buy a product that matches the instruction's attributes and options within its price. The episode ends when you buy."""


def _split_doc(name: str) -> str:
    return {"test": "WebShop's test goals: the first test_goals of the shuffled goals",
            "dev": "the next dev_goals", "train": "the rest"}[name]


def goal_index(store: Store, seed: int) -> int:
    """The goal a seed names: its split by seed range, then an index into the split's goals."""
    name = SPLIT_NAMES[(seed // SPLIT_STRIDE) % len(SPLIT_NAMES)]
    r = store.split_range(name)
    if not len(r):
        raise ValueError(f"the {name} split is empty with this catalogue ({len(store.goals)} goals)")
    return r[(seed % SPLIT_STRIDE) % len(r)]


class WebShopEnv(Environment):
    spec = EnvSpec(
        env_id="webshop",
        description="WebShop: search, browse and buy the product an instruction describes (official data "
                    "from WEBSHOP_DATA, else a generated catalogue in its schema); WebShop's reward.",
        system_prompt=SYSTEM_PROMPT,
        action_space="search[query] on the search page; click[label] with a button, product ID or option value",
        # verl-agent: 15 steps per episode; LaMer: 12 (set max_turns).
        max_turns=15,
        max_actions_per_turn=1,
        modalities=("text",),
        config_defaults={
            # A query may hold the default separator (","): one action per answer, uncut.
            "action_separator": "",
            "data_dir": "",
            "num_products": 1000,
            "catalogue_seed": 0,
            "goal_source": "synthetic",
            "goal_shuffle_seed": 233,
            "price_seed": 0,
            "test_goals": 500,
            "dev_goals": 1000,
            "observation_mode": "text",
            "results_per_page": 10,
            "max_results": 50,
            "reward_mode": "success",
            "reward_success": 10.0,
            "score_scale": 1.0,
            "option_quirk": True,
            "show_attributes": False,
        },
        config_docs={
            "data_dir": "folder of WebShop's official files (items_shuffle*.json, items_ins_v2*.json, "
                        "items_human_ins.json); empty: $WEBSHOP_DATA, else a generated catalogue",
            "num_products": "products read or generated (WebShop: 1000, or the full 1.18M)",
            "catalogue_seed": "seed of the generated catalogue",
            "goal_source": "synthetic (one goal per option combination) or human instructions",
            "goal_shuffle_seed": "seed of the goals' shuffle before the split (WebShop: 233)",
            "price_seed": "seed of the price drawn within a range and of the price caps",
            "test_goals": "goals of the test split (WebShop: 500)",
            "dev_goals": "goals of the dev split, after the test goals (WebShop: 1000)",
            "observation_mode": "text (WebShop's: the page's visible texts joined by [SEP], the instruction among "
                                "them), simple (verl-agent's and LaMer's: the instruction on its own line, "
                                "then the texts below it, quoted) or text_rich (WebShop's, [button] marks)",
            "results_per_page": "products per results page (WebShop: 10)",
            "max_results": "search results kept (WebShop: 50)",
            "reward_mode": "success: reward_success when the score is 1 (verl-agent, LaMer), else 0; "
                           "score: score_scale x WebShop's score",
            "reward_success": "reward of a purchase scoring 1 in success mode (verl-agent and LaMer: 10)",
            "score_scale": "multiplies WebShop's score (0-1) in score mode",
            "option_quirk": "score options as WebShop's code does ((group, value) pairs; see reward.py)",
            "show_attributes": "an Attributes sub-page on item pages (WebShop's show_attrs)",
        },
        config_bounds={
            # WebShop's official files, on the server: the operator's allow-list only.
            "data_dir": SERVER_PATH_BOUNDS,
            # A store (catalogue, goals, BM25 index) is built per distinct (data_dir, sizes, seeds) and
            # a worker keeps 4: 1,000 generated products build in 0.4 s on a 2-core machine (5,000 in
            # 1.4 s). The full 1.18M-product catalogue is an operator's choice (core/limits.py).
            "num_products": {"minimum": 1, "maximum": 1000},
            "catalogue_seed": SEED_BOUNDS,
            "goal_source": {"enum": ["synthetic", "human"]},
            "goal_shuffle_seed": SEED_BOUNDS,
            "price_seed": SEED_BOUNDS,
            # Where the splits cut the shuffled goals (1,000 products give about 4,400 goals).
            "test_goals": {"minimum": 0, "maximum": 100_000},
            "dev_goals": {"minimum": 0, "maximum": 100_000},
            "observation_mode": {"enum": list(OBSERVATION_MODES)},
            "results_per_page": {"minimum": 1, "maximum": 50},
            "max_results": {"minimum": 1, "maximum": 200},
            "reward_mode": {"enum": ["success", "score"]},
            "reward_success": REWARD_BOUNDS,
            "score_scale": {"minimum": 0.0, "maximum": 1000.0},
        },
        splits=tuple(Split(name, _split_doc(name), k * SPLIT_STRIDE, SPLIT_STRIDE)
                     for k, name in enumerate(SPLIT_NAMES)),
        default_action_format="free_think",
    )

    def __init__(self, config: Mapping[str, Any]):
        super().__init__(config)
        c = self.config
        try:
            self.store: Store = load_store(StoreKey(
                data_dir=c["data_dir"], num_products=int(c["num_products"]), catalogue_seed=int(c["catalogue_seed"]),
                goal_source=c["goal_source"], goal_shuffle_seed=int(c["goal_shuffle_seed"]),
                price_seed=int(c["price_seed"]), test_goals=int(c["test_goals"]), dev_goals=int(c["dev_goals"])))
        except OSError as e:
            # A data folder without WebShop's files is a bad config (INVALID_ARGUMENT), not a crash.
            raise ValueError(f"cannot read WebShop's data: {e}") from None
        title_nouns("warm up the tagger")  # loads spaCy once per process, not on the first purchase
        self._fresh(0)

    # -- state ------------------------------------------------------------------------------------
    def _fresh(self, goal_index: int) -> None:
        self.goal_index = goal_index
        self.page = "search"
        self.query = ""
        self.results: tuple[str, ...] = ()
        self.page_no = 1
        self.asin = ""
        self.options: dict[str, str] = {}
        self.sub_page = ""
        self.visited: tuple[str, ...] = ()
        self.done = False
        self.final_score: dict | None = None

    @property
    def goal(self) -> Goal:
        return self.store.goals[self.goal_index]

    def goal_index_of_seed(self, seed: int) -> int:
        return goal_index(self.store, seed)

    @classmethod
    def describe_task(cls, spec, seed: int) -> TaskDescription:
        """The goal a seed starts under the default config: its instruction (the agent's goal text),
        category and what it asks for. Builds the default store once per process (0.4 s)."""
        d = spec.config_defaults
        store = load_store(StoreKey(
            data_dir=d["data_dir"], num_products=d["num_products"], catalogue_seed=d["catalogue_seed"],
            goal_source=d["goal_source"], goal_shuffle_seed=d["goal_shuffle_seed"], price_seed=d["price_seed"],
            test_goals=d["test_goals"], dev_goals=d["dev_goals"]))
        try:
            index = goal_index(store, seed)
        except ValueError:
            return TaskDescription()
        g = store.goals[index]
        return TaskDescription(description=g.instruction, task_type=g.category,
                               parameters={"goal_index": index, "price_upper": g.price_upper,
                                           "attributes": len(g.attributes), "options": len(g.options)})

    # -- the five methods ---------------------------------------------------------------------------
    def reset(self, seed: int, options: Mapping[str, Any] | None = None) -> None:
        self._fresh(self.goal_index_of_seed(int(seed)))

    def step(self, action: str) -> ActionOutcome:
        if self.done:
            return ActionOutcome(valid=False, feedback="The purchase is done; reset the environment.")
        m = _ACTION.match(action or "")
        if not m:
            return self._invalid(f"Invalid action {action[:80]!r}: write search[query] or click[label].")
        kind, arg = m.group(1).lower(), m.group(2).strip().lower()
        if kind == "search":
            if self.page != "search":
                return self._invalid("There is no search bar on this page; click[Back to Search] first.")
            if not arg:
                return self._invalid("Empty search: write search[what you look for].")
            self.query = arg
            self.results = tuple(self.store.search(arg, int(self.config["max_results"])))
            self.page, self.page_no = "results", 1
            return ActionOutcome(info={"results": len(self.results)})
        clickables = self._clickables()
        if arg not in clickables:
            return self._invalid(f"click[{arg}] is not available on this page; available: "
                                 + ", ".join(f"click[{c}]" for c in clickables) + self._search_hint())
        return clickables[arg]()

    def render_text(self) -> str:
        mode = self.config["observation_mode"]
        if mode == "simple":
            text = _simple(self.goal.instruction, self._page_parts())
        elif mode == "text":
            text = " [SEP] ".join(t for t, _ in self._parts())
        else:
            text = _rich(self._parts())
        return f"{text}\nAvailable actions: {', '.join(self.valid_actions() or ['none'])}"

    def ground_truth(self) -> GroundTruth:
        g = self.goal
        state: dict[str, Any] = {
            "goal": {"asin": g.asin, "instruction": g.instruction, "attributes": list(g.attributes),
                     "options": dict(g.options) if isinstance(g.options, Mapping) else list(g.options),
                     "price_upper": g.price_upper, "category": g.category, "query": g.query,
                     "product_category": g.product_category, "source": g.source},
            "goal_index": self.goal_index,
            "catalogue": self.store.source,
            "page": self.page if not self.done else "done",
            "query": self.query,
            "results_page": self.page_no if self.page == "results" else None,
            "results": list(self.results) if self.page == "results" else [],
            # The products the results page shows, as it shows them.
            "shown": [{"asin": a, "title": self.store.product(a).title, "price": self.store.product(a).price_tag}
                      for a in self._page_products()] if self.page == "results" else [],
            "product": None,
            "selected_options": dict(self.options),
            "score_if_bought": None,
        }
        if self.asin:
            p = self.store.product(self.asin)
            state["product"] = {"asin": p.asin, "title": p.title, "price": round(self.store.price(p.asin), 2),
                                "options": {k: list(v) for k, v in p.options.items()}}
            state["score_if_bought"] = self._score(p).as_dict()
        if self.final_score is not None:
            state["final_score"] = self.final_score
        return GroundTruth(state=state, relations=self._relations())

    def _relations(self) -> list[str]:
        """The state in sentences, as the text families give them to judges."""
        if self.done:
            total = (self.final_score or {}).get("total", 0.0)
            return [f"the agent bought {self.asin} with the options {_options_text(self.options)}, "
                    f"which scores {total:.3g}"]
        if self.page == "search":
            return ["the agent is on the search page"]
        if self.page == "results":
            return [f"the agent is on results page {self.page_no} of the search for '{self.query}', "
                    f"which found {len(self.results)} products"]
        p = self.store.product(self.asin)
        where = "product page" if self.page == "item" else f"{self.sub_page} page"
        return [f"the agent is on the {where} of {p.asin}, {p.title}, at {p.price_tag}",
                f"the agent has selected {_options_text(self.options)}"]

    def anchor_data(self) -> Any:
        # What the agent sees: the page, its query and page number, the product and its options.
        return (self.goal_index, self.page, self.query, self.page_no, self.asin, self.sub_page,
                tuple(sorted(self.options.items())), self.done)

    def valid_actions(self) -> list[str]:
        if self.done:
            return []
        acts = ["search[<your query>]"] if self.page == "search" else []
        return acts + [f"click[{c}]" for c in self._clickables()]

    def snapshot(self) -> Any:
        snap = {k: v for k, v in self.__dict__.items() if k not in ("store", "config")}
        snap["options"] = dict(self.options)
        return snap

    def restore(self, snap: Any) -> None:
        self.__dict__.update(snap)
        self.options = dict(snap["options"])

    # -- pages --------------------------------------------------------------------------------------
    def _invalid(self, feedback: str) -> ActionOutcome:
        return ActionOutcome(valid=False, feedback=feedback)

    def _search_hint(self) -> str:
        return "" if self.page != "search" else "; or search[query]"

    def _page_products(self) -> tuple[str, ...]:
        n = int(self.config["results_per_page"])
        return self.results[(self.page_no - 1) * n: self.page_no * n]

    def _clickables(self) -> dict[str, Any]:
        """label (lower case) -> what clicking it does, for the current page."""
        c: dict[str, Any] = {}
        if self.page == "search":
            return c
        c["back to search"] = self._to_search
        if self.page == "results":
            if self.page_no > 1:
                c["< prev"] = lambda: self._to_results(self.page_no - 1)
            c["next >"] = lambda: self._to_results(self.page_no + 1)
            for asin in self._page_products():
                c[asin.lower()] = lambda asin=asin: self._to_item(asin)
        elif self.page == "item":
            c["< prev"] = lambda: self._to_results(self.page_no)
            p = self.store.product(self.asin)
            # Keyed by value, a later group's value replacing an earlier one's: a value listed
            # under two groups selects it in the last, as WebShop's text environment does.
            for group, values in p.options.items():
                for v in values:
                    c[v] = lambda group=group, v=v: self._select(group, v)
            for name in self._sub_pages():
                c[name] = lambda name=name: self._to_sub(name)
            c["buy now"] = self._buy
        elif self.page == "sub":
            c["< prev"] = self._back_to_item
        return c

    def _sub_pages(self) -> tuple[str, ...]:
        return SUB_PAGES + (("attributes",) if self.config["show_attributes"] else ())

    def _to_search(self) -> ActionOutcome:
        self.page, self.asin, self.options, self.sub_page = "search", "", {}, ""
        return ActionOutcome()

    def _to_results(self, page_no: int) -> ActionOutcome:
        self.page, self.page_no, self.asin, self.options, self.sub_page = "results", page_no, "", {}, ""
        return ActionOutcome(info={"results_page": page_no})

    def _to_item(self, asin: str) -> ActionOutcome:
        self.page, self.asin, self.options, self.sub_page = "item", asin, {}, ""
        if asin not in self.visited:
            self.visited += (asin,)
        return ActionOutcome()

    def _select(self, group: str, value: str) -> ActionOutcome:
        self.options[group] = value   # another value of the same group replaces it
        return ActionOutcome()

    def _to_sub(self, name: str) -> ActionOutcome:
        self.page, self.sub_page = "sub", name
        return ActionOutcome()

    def _back_to_item(self) -> ActionOutcome:
        self.page, self.sub_page = "item", ""
        return ActionOutcome()

    def _score(self, p: Product):
        return score_purchase(self.goal, p, self.store.price(p.asin), self.options,
                              option_quirk=bool(self.config["option_quirk"]))

    def _buy(self) -> ActionOutcome:
        p = self.store.product(self.asin)
        score = self._score(p)
        self.done, self.page = True, "done"
        self.final_score = score.as_dict()
        c = self.config
        if c["reward_mode"] == "success":
            reward = float(c["reward_success"]) if score.success else 0.0
        else:
            reward = float(c["score_scale"]) * score.total
        return ActionOutcome(reward=reward, done=True, success=score.success,
                             components={"purchase": reward},
                             info={"score": score.total, "r_type": score.r_type, "r_att": score.r_att,
                                   "r_option": score.r_option, "r_price": score.r_price, "asin": p.asin})

    # -- observation parts: (text, kind) in page order ----------------------------------------------
    def _parts(self) -> list[tuple[str, str]]:
        """The whole page as WebShop's HTML shows it: the instruction on top of every page but
        the last (its search page also has the site's name)."""
        if self.done:
            return self._page_parts()
        head = [("WebShop", "text")] if self.page == "search" else []
        return head + [("Instruction:", "text"), (self.goal.instruction, "text")] + self._page_parts()

    def _page_parts(self) -> list[tuple[str, str]]:
        """The page below the instruction."""
        if self.done:
            return [("Thank you for shopping with us!", "text"), ("Your score (min 0.0, max 1.0)", "text"),
                    (f"{(self.final_score or {}).get('total', 0.0):.4g}", "text")]
        if self.page == "search":
            return [("Search", "button")]
        parts = [("Back to Search", "button")]
        if self.page == "results":
            parts.append((f"Page {self.page_no} (Total results: {len(self.results)})", "text"))
            if self.page_no > 1:
                parts.append(("< Prev", "button"))
            parts.append(("Next >", "button"))
            for asin in self._page_products():
                p = self.store.product(asin)
                parts += [(asin, "product_visited" if asin in self.visited else "product"),
                          (p.title, "text"), (p.price_tag, "text")]
            return parts
        p = self.store.product(self.asin)
        parts.append(("< Prev", "button"))
        if self.page == "item":
            for group, values in p.options.items():
                parts.append((group, "text"))
                parts += [(v, "option_selected" if self.options.get(group) == v else "option") for v in values]
            parts += [(p.title, "text"), (f"Price: {p.price_tag}", "text"), (f"Rating: {p.rating}", "text")]
            parts += [(name.capitalize(), "button") for name in self._sub_pages()]
            return parts + [("Buy Now", "button")]
        if self.sub_page == "description":
            return parts + [(p.description, "text")]
        if self.sub_page == "features":
            return parts + [(b, "text") for b in p.bullets]
        if self.sub_page == "reviews":
            for r in p.reviews:
                parts += [(f"Rating: {r.get('score', '')}", "text"), (r.get("body", ""), "text")]
            return parts
        return parts + [(a, "text") for a in p.attributes]


def _options_text(options: Mapping[str, str]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(options.items())) or "no options"


def _simple(instruction: str, page: list[tuple[str, str]]) -> str:
    """The observation as verl-agent and LaMer give WebShop's to the model: the instruction
    (their prompt's task) on its own line, then the page's texts after it, each quoted."""
    return f"Instruction: {instruction}\n" + " [SEP] ".join(f"'{t}'" for t, _ in page)


def _rich(parts: list[tuple[str, str]]) -> str:
    """WebShop's text_rich rendering: buttons marked, chosen options and visited products too."""
    out, clicked = [], []
    for text, kind in parts:
        if kind == "button":
            out.append(f"[button] {text} [button_]")
        elif kind == "option":
            out.append(f"  [button] {text} [button_]")
        elif kind == "option_selected":
            out.append(f"  [clicked button] {text} [clicked button_]")
            clicked.append(text)
        elif kind == "product":
            out.append(f"\n[button] {text} [button_]")
        elif kind == "product_visited":
            out.append(f"\n[clicked button] {text} [clicked button_]")
        else:
            out.append(text)
    return "".join(f"You have clicked {t}.\n" for t in clicked) + "\n".join(out)
