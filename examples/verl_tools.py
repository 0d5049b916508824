"""A tool written for verl, trained in raygent unchanged: `examples/verl_tools.yaml` loads it with verl's own
GSM8K reward tool (which raygent maps to `envs.tools.AnswerCheck`) into the math_tool env:

    env: {name: math_tool, kwargs: {tools: [], tools_config: examples/verl_tools.yaml, max_parallel_calls: 2}}

`UnitPrice` has verl's async create / execute / release interface (it does not import verl; a subclass of verl's
`BaseTool` loads the same way). Each trajectory gets its own instance, created with that task row's
`extra_info.tools_kwargs["unit_price"]["create_kwargs"]` (a price list per task), and released when the episode
ends. Its arguments were checked against the YAML's JSON schema before `execute` is called.
"""

from __future__ import annotations

import uuid
from typing import Any


class UnitPrice:
    """The price of `quantity` units of `item`, from this trajectory's price list."""

    def __init__(self, config: dict[str, Any], tool_schema: Any):
        self.config, self.tool_schema = config, tool_schema
        self.currency = str(config.get("currency", "coins"))
        self._prices: dict[str, dict[str, float]] = {}

    async def create(self, instance_id: str | None = None, prices: dict[str, float] | None = None,
                     **_: Any) -> str:
        instance_id = instance_id or str(uuid.uuid4())
        self._prices[instance_id] = {k.lower(): float(v) for k, v in (prices or {}).items()}
        return instance_id

    async def execute(self, instance_id: str, parameters: dict[str, Any], **_: Any) -> tuple[str, float, dict]:
        prices = self._prices[instance_id]
        item = str(parameters["item"]).lower()
        if item not in prices:
            raise ValueError(f"no price for {item!r}; priced: {', '.join(sorted(prices)) or 'nothing'}")
        total = prices[item] * float(parameters.get("quantity", 1))
        return f"{total:g} {self.currency}", 0.0, {}

    async def release(self, instance_id: str, **_: Any) -> None:
        del self._prices[instance_id]
