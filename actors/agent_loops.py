"""Custom conversation loops: the worked example of `rollout.agent_loop: "package.module:Class"`.

A custom loop is a subclass of `actors.episodes.ConversationDecider`, one instance per episode. Its `__call__(turn)`
plays one env step: it may call `self.reply(turn, messages, attempt)` as often as it needs, each call appending
`messages` (as a template delta) and one reply of the policy to the episode's conversation, and it returns the
`Decision` whose reply the env steps with. Every reply is trained with the step's advantage; everything else (the
env's and the loop's own messages) is masked out. Training, validation, `raygent eval` and the agent endpoint all
play the loop the agent card names.
"""

from __future__ import annotations

from typing import Any

from actors.episodes import ConversationDecider, Decision, Turn


class FormatRetry(ConversationDecider):
    """Asks again, within the same env step, when the env cannot read the reply: a user turn says so and restates
    the reply format, up to `retries` times. The env then steps with the last reply (the penalty for an invalid
    action applies as usual), so the policy learns both to answer in format and to repair a reply it got wrong."""

    retries = 1
    nudge = "The env could not read an action in that reply. Reply again in the required format, e.g. {example}"

    async def __call__(self, turn: Turn) -> Decision:
        decision = await self.reply(turn, self.messages(turn))
        for attempt in range(1, self.retries + 1):
            if turn.env.match_action(decision.reply) is not None:
                break
            message: dict[str, Any] = {"role": "user",
                                       "content": self.nudge.format(example=getattr(turn.env, "example_action", ""))}
            decision = await self.reply(turn, [message], attempt)
        return decision
