"""WebShop: pages and actions, the reward formula on a hand-made catalogue, the oracle, the official-data loader."""

from __future__ import annotations

import json

import pytest
from gymnasium.utils.env_checker import check_env
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import envs
from envs.data.catalog import Catalog, Goal, Product, load_webshop, synthetic_catalog
from envs.webshop import WebShop, webshop_reward


def act(action: str) -> str:
    return f"<action>{action}</action>"


def play_expert(env: WebShop, seed: int) -> tuple[float, dict]:
    env.reset(seed=seed)
    while True:
        _, reward, terminated, truncated, info = env.step(act(env.expert_action()))
        if terminated or truncated:
            return reward, info


# ---- a tiny hand-made catalogue -----------------------------------------------------------------------------------
def tee(asin: str, attrs: list[str], price: float, title: str = "Acme Cotton Tee T-Shirt") -> Product:
    return Product(asin, title, "clothing", "t-shirt", attrs, {"size": ["s", "m", "l"], "color": ["red", "blue"]},
                   price, "A plain tee.", [f"{a}." for a in attrs])


TINY = Catalog(
    products=[
        tee("B000000001", ["cotton", "machine wash"], 20.0),
        tee("B000000002", ["polyester"], 50.0, title="Zed Sport T-Shirt"),
        Product("B000000003", "Zed Coffee Mug", "home", "mug", ["ceramic"], {"color": ["red"]}, 9.0),
        Product("B000000004", "Zed Dress Shirt", "clothing", "dress shirt", ["cotton", "machine wash"],
                {"size": ["m"], "color": ["red"]}, 25.0),
    ],
    goals=[Goal("B000000001", "i need a cotton machine wash t-shirt in size m and red color, under 30 dollars",
                "t-shirt", "clothing", ["cotton", "machine wash"], {"size": "m", "color": "red"}, 30.0)],
)


@pytest.mark.parametrize(
    ("index", "chosen", "expected"),
    [
        (0, {"size": "m", "color": "red"}, 1.0),  # (2 attributes + 2 options + price) / 5, right type
        (0, {"size": "m"}, 4 / 5),
        (0, {}, 3 / 5),
        (0, {"size": "l", "color": "blue"}, 3 / 5),
        (1, {"size": "m", "color": "red"}, 2 / 5),  # no attribute, over budget
        (2, {"color": "red"}, 0.0),  # a mug: other type and other category
        (3, {"size": "m", "color": "red"}, 0.5),  # "dress shirt" shares one of "t", "shirt": half type credit
    ],
)
def test_reward_formula_by_hand(index: int, chosen: dict, expected: float) -> None:
    reward, parts = webshop_reward(TINY.products[index], TINY.goals[0], chosen)
    assert reward == pytest.approx(expected)
    assert set(parts) == {"r_type", "r_att", "r_option", "r_price"}


def test_same_category_other_type_gets_a_tenth() -> None:
    hat = Product("B000000009", "Zed Cap", "clothing", "cap", ["cotton", "machine wash"], {}, 5.0)
    assert webshop_reward(hat, TINY.goals[0], {})[0] == pytest.approx(0.1 * 3 / 5)


def test_playing_the_tiny_shop_by_hand() -> None:
    env = WebShop(catalog=TINY)
    obs, info = env.reset(seed=0)
    assert obs.startswith("WebShop [SEP] Instruction:") and info["admissible_actions"] == ["search[...]"]
    obs, _, _, _, info = env.step(act("search[Cotton T-Shirt]"))
    assert info["action"] == "search[cotton t-shirt]" and "Page 1 (Total results:" in obs
    assert "click[b000000001]" in info["admissible_actions"] and "click[back to search]" in info["admissible_actions"]
    assert "click[b000000003]" not in info["admissible_actions"]  # the mug shares no query word: BM25 drops it
    for bad in ["search[again]", "click[buy now]", "click[b999]", "click b000000001", "click[]"]:
        new_obs, _, _, _, info = env.step(act(bad))
        assert new_obs == obs and not info["is_action_valid"]
    obs, _, _, _, info = env.step(act("CLICK[B000000001]"))
    assert info["action"] == "click[b000000001]" and "Buy Now" in obs and "size [SEP] s [SEP] m [SEP] l" in obs
    obs, *_ = env.step(act("click[description]"))
    assert "A plain tee." in obs
    obs, *_ = env.step(act("click[< prev]"))
    assert "Buy Now" in obs
    env.step(act("click[m]"))
    obs, _, _, _, info = env.step(act("click[red]"))
    assert "Selected: size m, color red" in obs
    obs, reward, terminated, truncated, info = env.step(act("click[buy now]"))
    assert reward == 1.0 and terminated and not truncated and info["won"] and info["score"] == 100.0


def test_paging_and_back_to_search() -> None:
    env = WebShop()
    env.reset(seed=0)
    obs, *_ = env.step(act("search[shirt]"))
    assert "Next >" in obs and "< Prev" not in obs
    first = obs
    obs, _, _, _, info = env.step(act("click[next >]"))
    assert "Page 2" in obs and "click[< prev]" in info["admissible_actions"]
    obs, *_ = env.step(act("click[< prev]"))
    assert obs == first
    obs, _, _, _, info = env.step(act("click[back to search]"))
    assert info["admissible_actions"] == ["search[...]"] and obs.endswith("Search")


def test_truncates_at_15_steps_with_score_zero() -> None:
    env = WebShop()
    env.reset(seed=1)
    for i in range(15):
        _, reward, terminated, truncated, info = env.step("no action")
        assert reward == 0.0 and not terminated and truncated == (i == 14)
    assert info["score"] == 0.0


# ---- the contract -------------------------------------------------------------------------------------------------
def test_check_env_and_registry() -> None:
    env = envs.make("webshop")
    assert isinstance(env, WebShop) and env.max_steps == 15
    check_env(env.unwrapped, skip_render_check=True)


def test_deterministic_under_seed() -> None:
    def trace(seed: int) -> list:
        env = WebShop()
        out = [env.reset(seed=seed)[0]]
        for i in range(8):
            step = env.step("junk" if i == 2 else act(env.expert_action()))
            out.append(step[:4])
            if step[2] or step[3]:
                break
        return out

    assert trace(5) == trace(5) and trace(5) != trace(6)


def test_synthetic_catalogue_is_large_deterministic_and_cached() -> None:
    cat = synthetic_catalog(0, 2000)
    assert len(cat.products) == 2000 and len({p.asin for p in cat.products}) == 2000
    assert len({p.product_type for p in cat.products}) >= 15
    assert synthetic_catalog(0, 2000) is cat  # built once per process
    other = synthetic_catalog.__wrapped__(0, 2000)
    assert [p.title for p in other.products] == [p.title for p in cat.products]
    assert [g.instruction for g in other.goals] == [g.instruction for g in cat.goals]


def test_oracle_buys_perfectly_from_many_seeds() -> None:
    env = WebShop()
    for seed in range(100):
        reward, info = play_expert(env, seed)
        assert reward == 1.0 and info["won"] and info["score"] == 100.0, seed


_FRAGMENTS = ["search[", "click[", "]", "<action>", "</action>", "next >", "< prev", "buy now", "back to search",
              "red", "b0", " ", "\n", "é", "\x00"]  # fmt: skip


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.one_of(st.text(), st.lists(st.sampled_from(_FRAGMENTS), max_size=10).map("".join)), max_size=6))
def test_step_never_raises(replies: list[str]) -> None:
    env = WebShop()
    _, info = env.reset(seed=2)
    for reply in replies:
        anchor = info["anchor"]
        obs, reward, terminated, truncated, info = env.step(reply)
        assert obs in env.observation_space and isinstance(reward, float)
        if not info["is_action_valid"]:
            assert info["anchor"] == anchor
        if terminated or truncated:
            break


# ---- official WebShop files ---------------------------------------------------------------------------------------
def write_official(folder) -> None:
    products = [
        {"asin": "B07ABCDEF1", "name": "Solid Cotton Crew Neck T-Shirt for Men", "category": "fashion",
         "query": "men's t-shirts", "product_category": "Clothing, Shoes & Jewelry › Men › Shirts › T-Shirts",
         "pricing": "$12.99", "full_description": "Soft cotton tee.", "small_description": ["100% cotton"],
         "customization_options": {"Size": [{"value": "Small", "image": None}, {"value": "Medium", "image": None}],
                                   "Color": [{"value": "Navy", "image": "x.jpg"}]}},
        {"asin": "B07ABCDEF2", "name": "Herbal Tea Sampler, Caffeine Free", "category": "grocery",
         "query": "tea", "product_category": "Grocery › Beverages › Tea", "pricing": ["$8.50", "$9.00"],
         "full_description": "Calming blend.", "small_description": ["caffeine free", "organic"],
         "customization_options": {}},
    ]
    ins = {
        "B07ABCDEF1": {"attributes": ["cotton", "crew neck"], "instruction": "i want a cotton t-shirt, size medium",
                       "instruction_attributes": ["cotton"], "instruction_options": ["medium", "navy"]},
        "B07ABCDEF2": {"attributes": ["caffeine free"], "instruction": "find caffeine free tea lower than 20.00 dollars",
                       "instruction_attributes": ["caffeine free"], "instruction_options": []},
    }
    (folder / "items_shuffle_1000.json").write_text(json.dumps(products))
    (folder / "items_ins_v2_1000.json").write_text(json.dumps(ins))


def test_loads_official_files(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_official(tmp_path)
    cat = load_webshop(tmp_path)
    tee_, tea = cat.products
    assert tee_.price == 12.99 and tee_.options == {"size": ["small", "medium"], "color": ["navy"]}
    assert tee_.product_type == "t-shirts" and tee_.attributes == ["cotton", "crew neck"] and tea.price == 8.5
    g1, g2 = cat.goals
    assert g1.options == {"size": "medium", "color": "navy"} and g1.price_upper == 17.0
    assert g1.instruction.endswith("price lower than 17.00 dollars") and g2.price_upper == 20.0
    monkeypatch.setenv("WEBSHOP_DATA", str(tmp_path))
    env = envs.make("webshop")
    for seed in range(6):
        reward, info = play_expert(env, seed)
        assert reward == 1.0 and info["won"]
