"""WebShop (Yao et al., 2022) as a raygent text env: find and buy the product an instruction describes.

Pages and actions follow WebShop's text interface (its "simple" observation mode, fields joined by " [SEP] "):

- search page: ``search[query]`` (BM25 over the catalogue, top 50 results);
- results page, 10 per page: ``click[<product id>]``, ``click[next >]``, ``click[< prev]``, ``click[back to search]``;
- item page: ``click[<option value>]`` (selects it: size, color, flavor ...), ``click[description]``,
  ``click[features]``, ``click[< prev]`` (back to the results), ``click[back to search]``, ``click[buy now]``;
- description / features page: ``click[< prev]``, ``click[back to search]``.

Actions are lower-cased (WebShop does the same), so ``click[B07XYZ]`` and ``click[b07xyz]`` are one action.
Buying ends the episode with WebShop's reward (`webshop_reward`); 1.0, a perfect purchase, is a win. `info["score"]`
is the reward times 100 on the last step. 15 steps by default.

Data: a generated catalogue (`envs.data.catalog.synthetic_catalog`, thousands of products, one instruction each),
or the official WebShop files when `data=` or $WEBSHOP_DATA names their folder (`envs.data.catalog.load_webshop`).
"""

from __future__ import annotations

import functools
import math
import os
import re
from typing import Any

from envs.base import Outcome, TextEnv, parse_action, split_pool
from envs.data import clip, squash, to_charset
from envs.data.catalog import Catalog, Goal, Product, load_webshop, synthetic_catalog
from envs.retrieval import words

DATA_ENV = "WEBSHOP_DATA"
PAGE_SIZE = 10
MAX_RESULTS = 50
SEP = " [SEP] "
BACK, NEXT, PREV, BUY, DESCRIPTION, FEATURES = "back to search", "next >", "< prev", "buy now", "description", "features"


def _norm(text: str) -> str:
    return " ".join(words(text))


def webshop_reward(product: Product, goal: Goal, chosen: dict[str, str]) -> tuple[float, dict[str, float]]:
    """WebShop's purchase reward, in its spirit (Yao et al., 2022, section 3.1):

        reward = r_type * (attributes matched + options matched + price ok) / (goal attributes + goal options + 1)

    - r_type, whether the right kind of product was bought: 1.0 when every word of the goal's product type occurs
      in the purchased product's type or title, 0.5 when some do, 0.1 when none do but the category is the same,
      else 0. (WebShop scores this from query, category and title-noun overlap into the same four levels.)
    - an attribute matches when the product lists it, or when its words all occur in the product's title,
      description or features (WebShop: a fuzzy match against attributes, then the same texts).
    - an option matches when the value chosen for its kind equals the goal's, after normalisation.
    - price ok: the product's price is at most the goal's ceiling (always ok without one).

    Returns the reward and its parts.
    """
    type_words = set(words(goal.product_type))
    have = set(words(product.product_type + " " + product.title))
    overlap = len(type_words & have) / len(type_words) if type_words else 1.0
    if overlap == 1.0:
        r_type = 1.0
    elif overlap > 0:
        r_type = 0.5
    else:
        r_type = 0.1 if product.category and product.category == goal.category else 0.0
    listed = {_norm(a) for a in product.attributes}
    text = f" {_norm(' '.join([product.title, product.description, *product.features]))} "
    attr_hits = sum(1 for a in goal.attributes if _norm(a) in listed or f" {_norm(a)} " in text)
    chosen_norm = {_norm(k): _norm(v) for k, v in chosen.items()}
    option_hits = sum(1 for k, v in goal.options.items() if chosen_norm.get(_norm(k)) == _norm(v))
    price_ok = 1.0 if goal.price_upper is None or product.price <= goal.price_upper + 1e-9 else 0.0
    total = (attr_hits + option_hits + price_ok) / (len(goal.attributes) + len(goal.options) + 1) * r_type
    parts = {"r_type": r_type, "r_att": attr_hits / max(1, len(goal.attributes)),
             "r_option": option_hits / max(1, len(goal.options)), "r_price": price_ok}
    return float(total), parts


@functools.lru_cache(maxsize=4)
def _load_official(path: str) -> Catalog:
    return load_webshop(path)


class WebShop(TextEnv):
    """Shop for the product an instruction describes: search, browse, pick options, buy."""

    name = "webshop"
    task_description = ("WebShop: you are shopping online. Find the product that matches the instruction (type, "
                        "attributes, options, price) and buy it. Use search[keywords] on the search page and "
                        "click[button] elsewhere.")
    example_action = "search[red cotton t-shirt]"
    max_steps = 15

    heldout_splits = {"test": {"goal_split": "test"}}

    def __init__(self, data: str | None = None, catalog: Catalog | None = None, num_products: int = 2000,
                 catalog_seed: int = 0, max_steps: int | None = None, max_obs_chars: int = 4096,
                 max_query_chars: int = 200, goal_split: str = "train"):
        split_pool([], goal_split)  # a bad split name fails here
        super().__init__(max_steps=max_steps, max_obs_chars=max_obs_chars)
        self.goal_split = goal_split
        self.data = data if data is not None else os.environ.get(DATA_ENV) or None
        self.num_products, self.catalog_seed = num_products, catalog_seed
        self.max_query_chars = max_query_chars
        self._catalog = catalog
        self.goal: Goal | None = None
        self._page, self._query, self._results, self._page_no = "search", "", [], 1
        self._item: int | None = None
        self._chosen: dict[str, str] = {}
        self._searches = 0
        self._score: float | None = None

    @property
    def catalog(self) -> Catalog:
        """Built (or loaded) on first use and shared per process: making the env stays cheap."""
        if self._catalog is None:
            self._catalog = (_load_official(str(self.data)) if self.data
                             else synthetic_catalog(self.catalog_seed, self.num_products))
        return self._catalog

    # ---- hooks ----------------------------------------------------------------------------------------------------
    def _new_episode(self, options: dict[str, Any] | None) -> None:
        goals = split_pool(self.catalog.goals, self.goal_split)  # "train" never sees a "test" goal
        self.goal = goals[int(self.np_random.integers(len(goals)))]
        self._page, self._query, self._results, self._page_no = "search", "", [], 1
        self._item, self._chosen, self._searches, self._score = None, {}, 0, None

    def _product(self) -> Product:
        assert self._item is not None
        return self.catalog.products[self._item]

    def _observe(self) -> str:
        head = f"Instruction:{SEP}{to_charset(self.goal.instruction) if self.goal else ''}"
        if self._page == "search":
            text = f"WebShop{SEP}{head}{SEP}Search"
        elif self._page == "results":
            parts = [head, "Back to Search", f"Page {self._page_no} (Total results: {len(self._results)})"]
            if self._page_no > 1:
                parts.append("< Prev")
            if self._page_no * PAGE_SIZE < len(self._results):
                parts.append("Next >")
            for i in self._page_items():
                p = self.catalog.products[i]
                parts += [p.asin.upper(), clip(to_charset(p.title), 200), f"${p.price:.2f}"]
            if not self._results:
                parts.append("No products found")
            text = SEP.join(parts)
        elif self._page == "item":
            p = self._product()
            parts = [head, "Back to Search", "< Prev"]
            for kind, values in p.options.items():
                parts += [kind, *values]
            if self._chosen:
                parts.append("Selected: " + ", ".join(f"{k} {v}" for k, v in self._chosen.items()))
            parts += [clip(to_charset(p.title), 300), f"Price: ${p.price:.2f}", "Rating: N.A.", "Description",
                      "Features", "Buy Now"]
            text = SEP.join(parts)
        else:  # description or features
            p = self._product()
            body = p.description if self._page == DESCRIPTION else SEP.join(p.features)
            text = SEP.join([head, "Back to Search", "< Prev", clip(to_charset(body), 2000) or "(none)"])
        return clip(text, self.observation_space.max_length)

    def _page_items(self) -> list[int]:
        start = (self._page_no - 1) * PAGE_SIZE
        return self._results[start : start + PAGE_SIZE]

    def _clickables(self) -> list[str]:
        if self._page == "results":
            out = [BACK]
            if self._page_no > 1:
                out.append(PREV)
            if self._page_no * PAGE_SIZE < len(self._results):
                out.append(NEXT)
            return out + [self.catalog.products[i].asin.lower() for i in self._page_items()]
        if self._page == "item":
            values = [v for vs in self._product().options.values() for v in vs]
            return [BACK, PREV, *dict.fromkeys(values), DESCRIPTION, FEATURES, BUY]
        if self._page in (DESCRIPTION, FEATURES):
            return [BACK, PREV]
        return []

    def admissible_actions(self) -> list[str]:
        if self._page == "search":
            return ["search[...]"]
        return [f"click[{c}]" for c in self._clickables()]

    def match_action(self, reply: str) -> str | None:
        """``search[query]`` on the search page (any query with a word in it) or ``click[x]`` for a clickable x on
        this page, matched case-insensitively; the canonical action is lower-cased."""
        parsed = parse_action(reply)
        if parsed is None:
            return None
        m = re.fullmatch(r"(search|click)\s*\[(.*)\]", parsed.strip(), re.IGNORECASE | re.DOTALL)
        if m is None:
            return None
        verb, arg = m.group(1).lower(), squash(m.group(2)).lower()
        if verb == "search":
            query = arg[: self.max_query_chars].strip()
            if self._page != "search" or not re.search(r"[a-z0-9]", query):
                return None
            return f"search[{query}]"
        return f"click[{arg}]" if arg in self._clickables() else None

    def _apply(self, action: str) -> Outcome:
        verb, arg = action[:-1].split("[", 1)
        if verb == "search":
            self._searches += 1
            self._query = arg
            self._results = self.catalog.search(arg, MAX_RESULTS)
            self._page, self._page_no = "results", 1
        elif arg == BACK:
            self._page, self._item, self._chosen = "search", None, {}
        elif arg == NEXT:
            self._page_no += 1
        elif arg == PREV:
            if self._page == "results":
                self._page_no -= 1
            elif self._page == "item":
                self._page, self._item, self._chosen = "results", None, {}
            else:
                self._page = "item"
        elif self._page == "results":
            self._page, self._item, self._chosen = "item", self.catalog.by_asin[arg], {}
        elif arg in (DESCRIPTION, FEATURES):
            self._page = arg
        elif arg == BUY:
            reward, _ = webshop_reward(self._product(), self.goal, self._chosen)  # type: ignore[arg-type]
            self._score = reward * 100
            won = math.isclose(reward, 1.0)
            return Outcome(reward, terminated=True, won=won,
                           key_event=f"bought {self._product().asin} for a score of {reward * 100:.0f}")
        else:  # an option value: select it under its kind
            kind = next(k for k, vs in self._product().options.items() if arg in vs)
            self._chosen[kind] = arg
        return Outcome(0.0)

    def step(self, reply: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        obs, reward, terminated, truncated, info = super().step(reply)
        if terminated or truncated:
            info["score"] = self._score if self._score is not None else 0.0
        return obs, reward, terminated, truncated, info

    # ---- the oracle -----------------------------------------------------------------------------------------------
    def _goal_options_for(self, product: Product) -> dict[str, str]:
        assert self.goal is not None
        return {k: v for k, v in self.goal.options.items() if v in product.options.get(k, [])}

    def _perfect(self, index: int) -> bool:
        p = self.catalog.products[index]
        return webshop_reward(p, self.goal, self._goal_options_for(p))[0] >= 1.0 - 1e-9  # type: ignore[arg-type]

    def expert_action(self) -> str | None:
        """Search the instruction's key words (product type and attributes); click the goal's product, or else a
        product that would score 1.0, paging on when none is on the page; on the item page pick the goal's options,
        then buy. If the key words do not find one, search again with the goal product's title."""
        goal = self.goal
        if goal is None:
            return None
        target = self.catalog.by_asin.get(goal.asin.lower())
        if self._page == "search":
            if self._searches == 0 or target is None:
                query = " ".join([*goal.attributes, goal.product_type])
            else:
                query = self.catalog.products[target].title
            return f"search[{squash(query).lower()[: self.max_query_chars].strip()}]"
        if self._page == "results":
            page = self._page_items()
            pick = target if target in page else next((i for i in page if self._perfect(i)), None)
            if pick is not None:
                return f"click[{self.catalog.products[pick].asin.lower()}]"
            if NEXT in self._clickables():
                return f"click[{NEXT}]"
            if self._searches < 2 and target is not None:
                return f"click[{BACK}]"
            return f"click[{self.catalog.products[page[0]].asin.lower()}]" if page else f"click[{BACK}]"
        if self._page == "item":
            for kind, value in self._goal_options_for(self._product()).items():
                if self._chosen.get(kind) != value:
                    return f"click[{value}]"
            return f"click[{BUY}]"
        return f"click[{PREV}]"
