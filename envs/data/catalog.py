"""Product catalogues and shopping instructions for the WebShop env.

`synthetic_catalog(seed, n_products)` invents a catalogue (product types across clothing, shoes, beauty, grocery,
electronics and home; brands, attributes, selectable options, prices, descriptions and feature bullets) and one
instruction per product, all from one seed, and caches it per process. `load_webshop(path)` reads the official
WebShop files instead (see `load_webshop` for which ones).
"""

from __future__ import annotations

import functools
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from envs.data import squash, to_charset

SIZES = ["x-small", "small", "medium", "large", "x-large", "xx-large"]
COLORS = ["black", "white", "red", "navy blue", "grey", "green", "pink", "beige", "purple", "yellow"]
SHOE_SIZES = ["6", "6.5", "7", "7.5", "8", "8.5", "9", "9.5", "10", "11", "12"]
WAISTS = ["28w x 30l", "30w x 30l", "32w x 32l", "34w x 32l", "36w x 34l", "38w x 34l"]
DENIM = ["light wash", "medium wash", "dark wash", "black denim", "stone grey"]
SCENTS = ["lavender", "coconut", "unscented", "citrus", "vanilla", "eucalyptus"]
FLAVORS = ["vanilla", "chocolate", "peanut butter", "salted caramel", "berry", "hazelnut"]
TEAS = ["chamomile", "peppermint", "ginger", "lemon", "hibiscus", "rooibos"]
SHADES = ["ruby red", "nude", "coral", "mauve", "berry", "plum"]
PHONES = ["iphone 15", "iphone 14", "galaxy s24", "galaxy s23", "pixel 8", "pixel 7"]

# product type -> (category, attribute pool, option kinds with their value pools, price range in dollars)
PRODUCT_TYPES: dict[str, tuple[str, list[str], dict[str, list[str]], tuple[float, float]]] = {
    "t-shirt": ("clothing", ["cotton", "short sleeve", "long sleeve", "slim fit", "machine wash", "crew neck",
                             "moisture wicking", "v-neck"], {"size": SIZES, "color": COLORS}, (8, 40)),
    "hoodie": ("clothing", ["fleece", "pullover", "zip up", "machine wash", "cotton blend", "drawstring",
                            "kangaroo pocket"], {"size": SIZES, "color": COLORS}, (20, 70)),
    "jeans": ("clothing", ["slim fit", "straight leg", "stretch", "high waist", "button closure", "machine wash"],
              {"size": WAISTS, "color": DENIM}, (20, 80)),
    "dress": ("clothing", ["maxi", "floral print", "short sleeve", "a-line", "pockets", "hand wash", "v-neck"],
              {"size": SIZES, "color": COLORS}, (18, 90)),
    "sneakers": ("shoes", ["non slip", "rubber sole", "lightweight", "breathable", "lace up", "memory foam"],
                 {"size": SHOE_SIZES, "color": COLORS}, (30, 120)),
    "sandals": ("shoes", ["open toe", "arch support", "waterproof", "adjustable strap", "cushioned", "leather"],
                {"size": SHOE_SIZES, "color": COLORS}, (15, 70)),
    "shampoo": ("beauty", ["sulfate free", "paraben free", "natural ingredients", "for dry hair", "cruelty free",
                           "color safe"], {"size": ["8 fl oz", "16 fl oz", "32 fl oz"], "scent": SCENTS}, (5, 35)),
    "face serum": ("beauty", ["vitamin c", "hyaluronic acid", "fragrance free", "anti aging", "for sensitive skin",
                              "dermatologist tested"], {"size": ["1 fl oz", "2 fl oz"]}, (10, 60)),
    "lipstick": ("beauty", ["long lasting", "matte", "moisturizing", "cruelty free", "waterproof", "vegan"],
                 {"color": SHADES}, (6, 30)),
    "coffee": ("grocery", ["organic", "dark roast", "fair trade", "whole bean", "medium roast", "low acid"],
               {"size": ["12 ounce", "2 pound", "5 pound"], "flavor": FLAVORS}, (8, 45)),
    "snack bars": ("grocery", ["gluten free", "high protein", "low sugar", "keto friendly", "vegan", "non gmo"],
                   {"size": ["pack of 6", "pack of 12", "pack of 24"], "flavor": FLAVORS}, (6, 40)),
    "herbal tea": ("grocery", ["organic", "caffeine free", "loose leaf", "non gmo", "kosher", "individually wrapped"],
                   {"size": ["20 count", "40 count", "100 count"], "flavor": TEAS}, (4, 25)),
    "headphones": ("electronics", ["wireless", "noise cancelling", "bluetooth", "long battery life", "over ear",
                                   "built-in microphone"], {"color": COLORS}, (20, 250)),
    "phone case": ("electronics", ["shockproof", "slim", "wireless charging compatible", "clear", "kickstand",
                                   "drop protection"], {"size": PHONES, "color": COLORS}, (6, 40)),
    "usb cable": ("electronics", ["fast charging", "braided", "usb c", "durable", "data transfer", "6 ft"],
                  {"size": ["3 ft", "6 ft", "10 ft"], "color": ["black", "white", "grey"]}, (5, 25)),
    "throw pillow": ("home", ["machine washable", "soft", "decorative", "zipper closure", "hypoallergenic",
                              "velvet"], {"size": ["16 x 16 inch", "18 x 18 inch", "20 x 20 inch"], "color": COLORS},
                     (10, 45)),
    "blanket": ("home", ["fleece", "lightweight", "machine washable", "queen size", "sherpa", "soft"],
                {"size": ["throw", "twin", "queen", "king"], "color": COLORS}, (15, 80)),
    "desk lamp": ("home", ["led", "dimmable", "usb charging port", "eye caring", "touch control", "adjustable arm"],
                  {"color": ["black", "white", "silver", "gold"]}, (15, 70)),
}
BRANDS = ["Lumora", "Kestrel", "Nordby", "Havenly", "Orchid & Oak", "Brightline", "Vantana", "Copperleaf",
          "Miravel", "Tessaro", "Quillon", "Sundra", "Paxwell", "Everpine", "Zelco", "Rowan Bay"]
_ASIN_CHARS = "ABCDEFGHJKLMNPQRSTUVWXYZ0123456789"


@dataclass
class Product:
    asin: str
    title: str
    category: str
    product_type: str
    attributes: list[str]
    options: dict[str, list[str]]
    price: float
    description: str = ""
    features: list[str] = field(default_factory=list)

    def search_text(self) -> str:
        """What the search engine indexes."""
        return " ".join([self.title, self.product_type, self.category, *self.attributes, *self.features])


@dataclass
class Goal:
    """A shopping instruction: what the reward compares the purchase against. `asin` is the product it was written
    from (the expert aims there, but any product that meets the goal earns the full reward)."""

    asin: str
    instruction: str
    product_type: str
    category: str
    attributes: list[str]
    options: dict[str, str]
    price_upper: float | None


@dataclass
class Catalog:
    products: list[Product]
    goals: list[Goal]
    _index: Any = None

    def __post_init__(self) -> None:
        if not self.products or not self.goals:
            raise ValueError("a catalogue needs at least one product and one goal")
        self.by_asin = {p.asin.lower(): i for i, p in enumerate(self.products)}

    def search(self, query: str, k: int = 50) -> list[int]:
        """Indices of the top-`k` products for `query` by BM25 (the index is built on first use)."""
        if self._index is None:
            from envs.retrieval import BM25Retriever

            self._index = BM25Retriever([p.search_text() for p in self.products])
        return [i for i, _ in self._index.search_ids([query], k)[0]]


def _instruction(rng: np.random.Generator, ptype: str, attrs: list[str], options: dict[str, str],
                 budget: float) -> str:
    opts = [f"{v} {k}" if k in ("color", "flavor", "scent") else f"size {v}" for k, v in options.items()]
    attr_text = " and ".join([", ".join(attrs[:-1]), attrs[-1]] if len(attrs) > 1 else attrs)
    opt_text = " and ".join(opts)
    a = "" if ptype.endswith("s") else "a "
    forms = [
        f"i need {a}{attr_text} {ptype}{' in ' + opt_text if opts else ''}, and price lower than {budget:.2f} dollars",
        f"i'm looking for {a}{ptype} that is {attr_text}{', ' + opt_text if opts else ''}, under {budget:.2f} dollars",
        f"find me {attr_text} {ptype}{' with ' + opt_text if opts else ''}, price lower than {budget:.2f} dollars",
    ]
    return forms[rng.integers(len(forms))]


@functools.lru_cache(maxsize=4)
def synthetic_catalog(seed: int = 0, n_products: int = 2000) -> Catalog:
    """`n_products` invented products and one instruction per product, from `seed` (cached per process)."""
    rng = np.random.default_rng(seed)
    types = list(PRODUCT_TYPES)
    products, goals, seen = [], [], set()
    for _ in range(n_products):
        ptype = types[rng.integers(len(types))]
        category, pool, option_pools, (lo, hi) = PRODUCT_TYPES[ptype]
        while True:
            asin = "B0" + "".join(_ASIN_CHARS[i] for i in rng.integers(len(_ASIN_CHARS), size=8))
            if asin not in seen:
                seen.add(asin)
                break
        brand = BRANDS[rng.integers(len(BRANDS))]
        attrs = [pool[i] for i in sorted(rng.choice(len(pool), size=int(rng.integers(2, 5)), replace=False))]
        options = {}
        for kind, values in option_pools.items():
            n = int(rng.integers(min(2, len(values)), min(6, len(values)) + 1))
            options[kind] = [values[i] for i in sorted(rng.choice(len(values), size=n, replace=False))]
        price = float(math.floor(rng.uniform(lo, hi))) + 0.99
        name = " ".join(w.capitalize() for w in ptype.split())
        title = f"{brand} {' '.join(a.title() for a in attrs[:2])} {name}" + (
            f", {', '.join(a.title() for a in attrs[2:])}" if len(attrs) > 2 else "")
        description = (f"The {brand} {ptype} is {', '.join(attrs[:-1])} and {attrs[-1]}. "
                       f"Made for everyday use and backed by {brand}'s satisfaction promise.")
        features = [f"{a.capitalize()}: designed to be {a}." for a in attrs]
        products.append(Product(asin, title, category, ptype, attrs, options, price, description, features))

        goal_attrs = [attrs[i] for i in sorted(rng.choice(len(attrs), size=int(rng.integers(1, min(3, len(attrs)) + 1)),
                                                          replace=False))]
        goal_opts = {kind: values[rng.integers(len(values))] for kind, values in options.items()}
        budget = float(math.ceil(price * rng.uniform(1.1, 1.6) / 10) * 10)
        goals.append(Goal(asin, _instruction(rng, ptype, goal_attrs, goal_opts, budget), ptype, category,
                          goal_attrs, goal_opts, budget))
    return Catalog(products, goals)


# ---- the official WebShop files -----------------------------------------------------------------------------------
def _price(pricing: Any) -> float:
    if isinstance(pricing, (int, float)):
        return float(pricing)
    if isinstance(pricing, list) and pricing:
        return _price(pricing[0])
    found = re.findall(r"\d+(?:\.\d+)?", str(pricing).replace(",", ""))
    return float(found[0]) if found else 0.0


def _text(value: Any) -> str:
    if isinstance(value, list):
        value = " ".join(map(str, value))
    return squash(to_charset(str(value or "")))


def _read_json(path: Path) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def load_webshop(path: str | Path, price_slack: float = 1.25) -> Catalog:
    """A catalogue from the official WebShop data (github.com/princeton-nlp/WebShop, `setup.sh` downloads it).

    `path` is the folder holding:

    - ``items_shuffle*.json`` (or ``items_*shuffle*.json``): a JSON list of products with "asin", "name",
      "category", "product_category" (breadcrumbs joined by " › "), "query", "pricing", "full_description",
      "small_description" (feature bullets), "customization_options" ({kind: [{"value": ...}, ...]}).
    - ``items_ins_v2*.json``: {asin: {"attributes": [...], "instruction": ..., "instruction_attributes": [...],
      "instruction_options": [...] or {kind: value}}}; products with an instruction become goals.
    - optionally ``items_human_ins.json``: {asin: [{"instruction", "instruction_attributes",
      "instruction_options"}, ...]}, the human-written instructions, used as goals when present.

    A single products file may also be given; its products then need "instruction" and "instruction_attributes" of
    their own. WebShop samples a price ceiling per goal; here it is the product's price times `price_slack`, rounded
    up to a whole dollar, unless the instruction already states "lower than N dollars".
    """
    path = Path(path)
    if path.is_dir():
        found = sorted(path.glob("items_*shuffle*.json"))
        if not found:
            raise ValueError(f"{path}: no items_shuffle*.json (the WebShop product file)")
        raw_products = _read_json(found[0])
        ins_files = sorted(path.glob("items_ins_v2*.json"))
        ins = _read_json(ins_files[0]) if ins_files else {}
        human = _read_json(path / "items_human_ins.json") if (path / "items_human_ins.json").exists() else {}
    else:
        raw_products, ins, human = _read_json(path), {}, {}
    if not isinstance(raw_products, list):
        raise ValueError(f"{path}: the product file must hold a JSON list")

    products, goals = [], []
    for row in raw_products:
        asin = str(row.get("asin", "")).strip()
        if not asin or not row.get("name"):
            continue
        info = ins.get(asin, {}) if isinstance(ins, dict) else {}
        options = {}
        for kind, values in (row.get("customization_options") or {}).items():
            vals = [_text(v.get("value") if isinstance(v, dict) else v).lower() for v in values or []]
            if vals:
                options[_text(kind).lower()] = vals
        crumbs = [c.strip() for c in re.split(r"›|>", str(row.get("product_category", ""))) if c.strip()]
        ptype = _text(crumbs[-1] if crumbs else row.get("query", "")).lower()
        bullets = row.get("small_description") or []
        features = [_text(b) for b in (bullets if isinstance(bullets, list) else [bullets]) if _text(b)]
        attributes = [_text(a).lower() for a in info.get("attributes", row.get("attributes", []))]
        product = Product(asin, _text(row["name"]), _text(row.get("category", "")).lower(), ptype, attributes,
                          options, _price(row.get("pricing", 0)), _text(row.get("full_description", "")), features)
        products.append(product)
        sources = human.get(asin) if isinstance(human, dict) and human.get(asin) else [info or row]
        for src in sources if isinstance(sources, list) else [sources]:
            if not src.get("instruction"):
                continue
            text = _text(src["instruction"]).lower()
            wanted = src.get("instruction_options") or {}
            if isinstance(wanted, list):  # official v2 lists values only: find each one's kind on the product
                wanted = {next((k for k, vs in options.items() if _text(v).lower() in vs), f"option {i}"): v
                          for i, v in enumerate(wanted)}
            goal_opts = {_text(k).lower(): _text(v).lower() for k, v in wanted.items()}
            stated = re.search(r"lower than (\d+(?:\.\d+)?) dollars", text)
            if stated:
                budget = float(stated.group(1))
            else:
                budget = float(math.ceil(max(product.price, 1.0) * price_slack))
                text += f", and price lower than {budget:.2f} dollars"
            goals.append(Goal(asin, text, ptype, product.category,
                              [_text(a).lower() for a in src.get("instruction_attributes", [])], goal_opts, budget))
    return Catalog(products, goals)
